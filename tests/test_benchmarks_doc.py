"""BENCHMARKS.md holds the product's current figures: short, and free of history."""
from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
MAX_BYTES = 30 * 1024
HISTORY = [
    r"\bsessions?\b", r"\bissues? #?\d+", r"#\d{2,}\b", r"\byesterday\b", r"\bpreviously\b", r"\bno longer\b",
    r"\bused to\b", r"\bbefore (?:that|this|the) change\b", r"\b(?:19|20)\d\d-\d\d-\d\d\b",
    r"\b(?:January|February|March|April|May|June|July|August|September|October|November|December) \d{4}\b",
    r"\bcommit\b", r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",
]


def test_benchmarks_doc_is_short():
    assert DOC.stat().st_size <= MAX_BYTES, f"BENCHMARKS.md is {DOC.stat().st_size} bytes (at most {MAX_BYTES})"


def test_benchmarks_doc_has_no_history():
    text = DOC.read_text()
    found = [m.group(0) for pattern in HISTORY for m in re.finditer(pattern, text, re.IGNORECASE)]
    assert found == [], f"history words in BENCHMARKS.md: {found}"


def test_benchmarks_doc_names_its_machines():
    head = DOC.read_text().split("\n## ", 1)[0]
    assert "H200" in head and "Xeon" in head
