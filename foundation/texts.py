"""Real text that ships inside packages, split into named, disjoint ranges.

Every figure kvslim prints names the range it was measured on. Calibration (quantization,
KV scales, convert's calibrated merges), healing and evaluation never share text:

=====================  =======================================  ==========================
name                   what                                     used for
=====================  =======================================  ==========================
``wikipedia:calib``    gensim's enwiki dump, articles [0, 24)   calibration
``wikipedia:heal``     articles [24, 64)                        healing (distillation)
``wikipedia:eval``     articles [64, end)                       perplexity, held out
``pydoc:eval``         stdlib ``pydoc_data.topics``             second held-out corpus
``pysrc:calib``        the source of 24 stdlib modules          code-like calibration
``pyhelp:calib``       ``help()`` of 28 other stdlib modules    documentation calibration
=====================  =======================================  ==========================

``pysrc`` is read from the running interpreter's standard library (``PYSRC_MODULES``, pure-Python
modules every CPython 3.10-3.14 ships): code and docstrings, a calibration twin of ``pydoc:eval``
(the language reference, not the library's source) that shares none of its text. ``pyhelp`` is
documentation, as ``pydoc:eval`` is: what ``help(module)`` prints for other stdlib modules
(``PYHELP_MODULES``: description, classes and functions with their signatures and docstrings; no
file paths, data values or object addresses, so the same Python gives the same text anywhere).
"""
from __future__ import annotations

import bz2
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from foundation.atomic import atomic_output_dir
from foundation.errors import KvslimError
from foundation.model_source import cache_root

Role = Literal["calib", "heal", "eval"]
WIKI_DUMP = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


@dataclass(frozen=True)
class TextRange:
    """A named slice of a corpus, in whole documents."""

    corpus: str
    role: Role
    start: int
    stop: int | None

    @property
    def name(self) -> str:
        return f"{self.corpus}:{self.role}"

    def describe(self) -> str:
        stop = "end" if self.stop is None else str(self.stop)
        return f"{self.name} (docs [{self.start}, {stop}))"

    def overlaps(self, other: "TextRange") -> bool:
        if self.corpus != other.corpus:
            return False
        a_stop = self.stop if self.stop is not None else 1 << 30
        b_stop = other.stop if other.stop is not None else 1 << 30
        return self.start < b_stop and other.start < a_stop


RANGES: dict[str, TextRange] = {
    r.name: r
    for r in (
        TextRange("wikipedia", "calib", 0, 24),
        TextRange("wikipedia", "heal", 24, 64),
        TextRange("wikipedia", "eval", 64, None),
        TextRange("pydoc", "eval", 0, None),
        TextRange("pysrc", "calib", 0, None),
        TextRange("pyhelp", "calib", 0, None),
    )
}
DEFAULT_CALIB = "wikipedia:calib"
DEFAULT_HEAL = "wikipedia:heal"
DEFAULT_EVAL = "wikipedia:eval"


def _wikipedia_docs() -> list[str]:
    cached = cache_root() / "texts" / "wikipedia.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise KvslimError("the wikipedia text needs the gensim package: pip install gensim")
    dump = Path(list(spec.submodule_search_locations)[0]) / WIKI_DUMP
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    docs = []
    with bz2.open(dump, "rb") as f:
        for title, text, _pageid in extract_pages(f):
            if not text or text.lower().startswith("#redirect"):
                continue
            clean = filter_wiki(text)
            # filter_wiki leaves markup-free prose with blank-line paragraph breaks; squash runs.
            paras = [" ".join(p.split()) for p in clean.split("\n\n")]
            body = "\n\n".join(p for p in paras if len(p) > 40)
            if len(body) > 500:
                docs.append(f"{title}\n\n{body}")
    with atomic_output_dir(cached.parent / "wikipedia.tmpdir", force=True) as tmp:
        (tmp / "wikipedia.json").write_text(json.dumps(docs))
    (cached.parent / "wikipedia.tmpdir" / "wikipedia.json").rename(cached)
    (cached.parent / "wikipedia.tmpdir").rmdir()
    return docs


def _pydoc_docs() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


PYSRC_MODULES = ("argparse", "ast", "calendar", "collections", "configparser", "csv", "dataclasses", "difflib",
                 "enum", "fractions", "functools", "gettext", "heapq", "inspect", "ipaddress", "logging",
                 "optparse", "pprint", "shlex", "statistics", "string", "tarfile", "textwrap", "typing")


def _pysrc_docs() -> list[str]:
    docs = []
    for name in PYSRC_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not (spec.origin or "").endswith(".py"):
            raise KvslimError(f"the pysrc text needs the source of the stdlib module {name}, which this Python lacks")
        docs.append(Path(spec.origin).read_text(encoding="utf-8"))
    return docs


PYHELP_MODULES = ("abc", "base64", "bisect", "cmd", "codecs", "contextlib", "copy", "doctest", "filecmp", "fnmatch",
                  "glob", "graphlib", "json", "mimetypes", "numbers", "queue", "random", "sched", "shutil",
                  "smtplib", "tempfile", "threading", "timeit", "traceback", "urllib.parse", "uuid", "weakref",
                  "zipfile")
PYHELP_SECTIONS = ("NAME", "DESCRIPTION", "CLASSES", "FUNCTIONS")  # what help() prints, less paths and values


def _pyhelp_docs() -> list[str]:
    import pydoc

    docs = []
    for name in PYHELP_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise KvslimError(f"the pyhelp text needs the stdlib module {name}, which this Python lacks ({e})") from None
        sections = re.split(r"\n(?=[A-Z][A-Z ]+\n)", pydoc.plaintext.document(module))
        kept = [s.rstrip() for s in sections if s.split("\n", 1)[0] in PYHELP_SECTIONS]
        docs.append(re.sub(r" at 0x[0-9a-fA-F]+", "", "\n\n".join(kept)))
    return docs


CORPORA = {"wikipedia": _wikipedia_docs, "pydoc": _pydoc_docs, "pysrc": _pysrc_docs, "pyhelp": _pyhelp_docs}


def text_range(name: str) -> TextRange:
    if name not in RANGES:
        raise KvslimError(f"unknown text range {name!r}; known: {', '.join(RANGES)}")
    return RANGES[name]


def load_documents(name: str) -> list[str]:
    """The documents of a named range (e.g. ``wikipedia:eval``)."""
    r = text_range(name)
    docs = CORPORA[r.corpus]()
    return docs[r.start : r.stop]


def load_text(name: str) -> str:
    """The documents of a named range joined by blank lines."""
    return "\n\n".join(load_documents(name))


def check_disjoint(a: str, b: str) -> None:
    """Raise if two named ranges share text (e.g. a calibration range that is also evaluated)."""
    if text_range(a).overlaps(text_range(b)):
        raise KvslimError(f"text ranges {a} and {b} overlap; calibration, healing and evaluation must be disjoint")
