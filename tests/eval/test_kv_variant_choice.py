"""``eval.kv_variant_choice``: the candidates of a packed KV dtype and the rule that picks one."""
import pytest

from eval.kv_variant_choice import LOGPROB_TOLERANCE, VariantCandidate, candidate_dtypes, pick
from foundation.errors import KvslimError


def test_candidates_are_the_variants_that_change_the_dtype():
    assert candidate_dtypes("int4") == ["int4", "int4:exact-first-block", "int4:keys-unrotated",
                                        "int4:exact-first-block+keys-unrotated"]
    assert candidate_dtypes("k4v2") == ["k4v2", "k4v2:keys-unrotated"]  # its 2-bit values keep the first block
    assert candidate_dtypes("int2") == ["int2"] and candidate_dtypes("int8") == ["int8"]
    with pytest.raises(KvslimError, match="name the dtype alone"):
        candidate_dtypes("int4:keys-unrotated")


def test_the_cheapest_close_to_the_best_wins():
    default, exact, unrotated = (VariantCandidate("int4", 100.0, -0.257), VariantCandidate("int4:e", 102.0, -0.194),
                                 VariantCandidate("int4:u", 100.0, -0.216))
    assert pick([default, exact, unrotated]) == exact
    tied = VariantCandidate("int4:e", 102.0, -0.120)
    assert pick([VariantCandidate("int4", 100.0, -0.120), tied]).kv_dtype == "int4"
    close = VariantCandidate("int4", 100.0, -0.200 - LOGPROB_TOLERANCE / 2)
    assert pick([close, VariantCandidate("int4:e", 102.0, -0.200)]) == close
    # equal bytes, both within the tolerance: the earlier (the runtime's default) stays
    assert pick([VariantCandidate("int4", 100.0, -0.205), VariantCandidate("int4:u", 100.0, -0.200)]).kv_dtype == "int4"


def test_one_candidate_is_named_not_served(tiny_llama):
    from eval.kv_variant_choice import choose_kv_variant

    choice = choose_kv_variant(tiny_llama, "int2", 256, progress=lambda line: pytest.fail(f"served: {line}"))
    assert choice.chosen.kv_dtype == "int2" and choice.chosen.calib_logprob is None and choice.candidates == (choice.chosen,)
    assert choice.times_smaller > 1
