"""Calibration text -> token windows: the spec's checks, the windows, the vocabulary check."""
from __future__ import annotations

import pytest
import torch

from foundation.calibration import (
    CalibrationSpec,
    CalibrationTextTooShort,
    calibration_ids,
    check_ids_in_vocab,
    load_tokenizer,
    token_windows,
)
from foundation.errors import KvslimError


def test_default_text_is_the_calib_range():
    spec = CalibrationSpec(num_samples=2, seq_len=8)
    assert spec.source == "wikipedia:calib" and spec.is_named_range and spec.num_tokens == 16
    assert spec.describe() == "2 x 8 tokens of wikipedia:calib"
    spec.check()


def test_sizes_are_keyword_only():
    with pytest.raises(TypeError):
        CalibrationSpec("wikipedia:calib", 2, 8)  # type: ignore[misc]


@pytest.mark.parametrize("samples,seq_len,needle", [(0, 8, "positive"), (2, 1, "at least 2")])
def test_sizes_are_checked(samples, seq_len, needle):
    with pytest.raises(KvslimError, match=needle):
        CalibrationSpec(num_samples=samples, seq_len=seq_len)


@pytest.mark.parametrize("source,needle", [
    ("wikipedia:eval", "is a eval range"),
    ("wikipedia:heal", "is a heal range"),
    ("no/such/file.txt", "not found"),
])
def test_sources_that_cannot_calibrate_are_refused(source, needle):
    with pytest.raises(KvslimError, match=needle):
        CalibrationSpec(source=source, num_samples=1, seq_len=2).check()


def test_a_text_file_is_read_as_utf8(tmp_path):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("calibration text")
    bad.write_bytes(b"\xff\xfe\x00text")
    assert CalibrationSpec(source=str(good), num_samples=1, seq_len=2).load_text() == "calibration text"
    with pytest.raises(KvslimError, match="not UTF-8"):
        CalibrationSpec(source=str(bad), num_samples=1, seq_len=2).load_text()


def test_windows_are_consecutive_and_disjoint():
    windows = token_windows(list(range(10)), CalibrationSpec(num_samples=2, seq_len=4))
    assert windows.dtype == torch.long and windows.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_too_short_a_text_is_its_own_error():
    with pytest.raises(CalibrationTextTooShort, match="has 5 tokens; 2 samples x 4 tokens need 8"):
        token_windows(list(range(5)), CalibrationSpec(num_samples=2, seq_len=4))
    assert issubclass(CalibrationTextTooShort, KvslimError)


def test_ids_beyond_the_vocabulary_are_refused():
    check_ids_in_vocab(torch.tensor([[0, 9]]), {"vocab_size": 10}, "m")
    with pytest.raises(KvslimError, match="id 10 >= vocab_size 10"):
        check_ids_in_vocab(torch.tensor([[0, 10]]), {"vocab_size": 10}, "m")


def test_a_checkpoint_without_tokenizer_is_one_line(tiny_llama):
    with pytest.raises(KvslimError, match="no tokenizer files"):
        load_tokenizer(tiny_llama)


def test_calibration_ids_use_the_models_tokenizer(tiny_with_tokenizer, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    spec = CalibrationSpec(source=str(text), num_samples=3, seq_len=16)
    ids = calibration_ids(tiny_with_tokenizer, spec)
    expected = load_tokenizer(tiny_with_tokenizer)(text.read_text(), add_special_tokens=False)["input_ids"][:48]
    assert ids.shape == (3, 16) and ids.flatten().tolist() == expected
