import itertools

import pytest

from foundation.errors import KvslimError
from foundation.texts import RANGES, check_disjoint, load_documents, text_range


def test_roles_never_overlap():
    for a, b in itertools.combinations(RANGES.values(), 2):
        if a.role != b.role:
            assert not a.overlaps(b), (a, b)


def test_check_disjoint_and_unknown_names():
    check_disjoint("wikipedia:calib", "wikipedia:eval")
    with pytest.raises(KvslimError, match="overlap"):
        check_disjoint("wikipedia:eval", "wikipedia:eval")
    with pytest.raises(KvslimError, match="unknown text range"):
        text_range("wikitext:test")


def test_real_corpora_load():
    calib, heal, held_out = (load_documents(f"wikipedia:{r}") for r in ("calib", "heal", "eval"))
    assert (len(calib), len(heal)) == (24, 40) and len(held_out) > 30
    assert not set(calib) & set(held_out) and not set(heal) & set(held_out)
    assert all(len(d) > 500 for d in held_out)
    assert len(load_documents("pydoc:eval")) > 50


def test_code_calibration_text_shares_nothing_with_pydoc():
    source, reference = load_documents("pysrc:calib"), load_documents("pydoc:eval")
    assert len(source) == 24 and all("def " in d for d in source)
    assert not any(topic in d for d in source for topic in reference if len(topic) > 200)


def test_documentation_calibration_text_is_help_text_of_other_modules():
    from foundation.texts import PYHELP_MODULES, PYSRC_MODULES

    docs, reference = load_documents("pyhelp:calib"), load_documents("pydoc:eval")
    assert len(docs) == len(PYHELP_MODULES) and not set(PYHELP_MODULES) & set(PYSRC_MODULES)
    assert all(d.startswith("NAME\n") for d in docs) and sum(map(len, docs)) > 300_000
    assert not any(marker in d for d in docs for marker in ("\nFILE\n", "\nDATA\n", " at 0x"))  # the same anywhere
    assert not any(topic in d for d in docs for topic in reference if len(topic) > 200)
