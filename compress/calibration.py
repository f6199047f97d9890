"""Calibration text -> token batches for GPTQ Hessians and KV-cache scales.

The text is a named range (default ``wikipedia:calib``, disjoint from every evaluation range) or a
user's UTF-8 text file. It is tokenized once, without special tokens, and cut into
``num_samples`` consecutive, non-overlapping windows of ``seq_len`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from foundation.errors import KvslimError

DEFAULT_CALIB_TEXT = "wikipedia:calib"
DEFAULT_NUM_SAMPLES = 64
DEFAULT_SEQ_LEN = 512


@dataclass(frozen=True)
class CalibrationSpec:
    """Where calibration text comes from and how much of it to use."""

    source: str = DEFAULT_CALIB_TEXT  # a named range (``corpus:calib``) or a text file path
    num_samples: int = DEFAULT_NUM_SAMPLES
    seq_len: int = DEFAULT_SEQ_LEN

    def __post_init__(self) -> None:
        if self.num_samples <= 0:
            raise KvslimError(f"--num-calib-samples must be positive, got {self.num_samples}")
        if self.seq_len <= 1:
            raise KvslimError(f"--calib-seq-len must be at least 2, got {self.seq_len}")

    @property
    def is_named_range(self) -> bool:
        from foundation.texts import RANGES

        return self.source in RANGES

    def describe(self) -> str:
        return f"{self.num_samples} x {self.seq_len} tokens of {self.source}"

    def check(self) -> None:
        """Validate the source before anything heavy runs (bad range role, missing file)."""
        if self.is_named_range:
            from foundation.texts import text_range

            role = text_range(self.source).role
            if role != "calib":
                raise KvslimError(
                    f"--calib {self.source} is a {role} range; calibration must use a calib range "
                    "(e.g. wikipedia:calib) so evaluation text stays held out"
                )
            return
        path = Path(self.source).expanduser()
        if not path.is_file():
            raise KvslimError(f"calibration file {self.source} not found (pass a text file or a range such as {DEFAULT_CALIB_TEXT})")

    def load_text(self) -> str:
        self.check()
        if self.is_named_range:
            from foundation.texts import load_text

            return load_text(self.source)
        try:
            return Path(self.source).expanduser().read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise KvslimError(f"calibration file {self.source} is not UTF-8 text") from None


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's own tokenizer (calibration needs one)."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise KvslimError(f"{model_dir} has no tokenizer files; calibration (--method gptq, --kv-cache-fp8) needs one")
    return AutoTokenizer.from_pretrained(model_dir)


def token_windows(ids: torch.Tensor | list[int], spec: CalibrationSpec) -> torch.Tensor:
    """Cut a token stream into ``[num_samples, seq_len]`` consecutive windows."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    needed = spec.num_samples * spec.seq_len
    if ids.numel() < needed:
        raise KvslimError(
            f"calibration text {spec.source} has {ids.numel()} tokens; {spec.num_samples} samples x "
            f"{spec.seq_len} tokens need {needed} (lower --num-calib-samples or --calib-seq-len)"
        )
    return ids[:needed].reshape(spec.num_samples, spec.seq_len).clone()


def calibration_ids(model_dir: str | Path, spec: CalibrationSpec) -> torch.Tensor:
    """Token windows ``[num_samples, seq_len]`` (int64) of the calibration text for ``model_dir``."""
    text = spec.load_text()
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return token_windows(ids, spec)


def check_ids_in_vocab(ids: torch.Tensor, config: dict, where: str | Path) -> None:
    """Refuse token ids the model's embedding cannot hold (a tokenizer that does not match it)."""
    vocab = int(config.get("vocab_size") or 0)
    if vocab and int(ids.max()) >= vocab:
        raise KvslimError(f"{where}: its tokenizer produced id {int(ids.max())} >= vocab_size {vocab}")
