"""Streaming detokenization: deltas join to the full text, never split a character or leak a stop string."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from runtime.engine.detokenizer import Detokenizer

TEXT = "Caf\u00e9 na\u00efve \u65e5\u672c\u8a9e and emoji \U0001F642\U0001F680 then STOP here and more text."


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def stream(tokenizer, ids, stop=()):
    d = Detokenizer(tokenizer, tuple(stop))
    deltas = [d.update(ids[: i + 1], finished=i == len(ids) - 1) for i in range(len(ids))]
    return d, deltas


def test_deltas_join_to_the_decoded_text_without_partial_characters(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    d, deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in x for x in deltas)
    assert not d.stopped


@pytest.mark.parametrize("stop", [["STOP"], ["then S", "zzz"], [" and"]])
def test_stop_string_ends_the_text_before_it_and_never_leaks(tokenizer, stop):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    d, deltas = stream(tokenizer, ids, stop)
    first = min(TEXT.find(s) for s in stop if s in TEXT)
    assert d.stopped
    assert "".join(deltas) == TEXT[:first]
