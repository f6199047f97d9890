"""Calibration text -> token windows, for every calibrated pass (quantization, attention rewrites).

The text is a named calib range (default ``wikipedia:calib``, disjoint from every healing and
evaluation range) or a user's UTF-8 text file. It is tokenized once with the model's own
tokenizer, without special tokens, and cut into ``num_samples`` consecutive, non-overlapping
windows of ``seq_len`` tokens. How many windows of how many tokens is each user's own default
(``compress.quantize_options``, ``attention_variants.convert``). Torch-free until windows are cut.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from foundation.errors import KvslimError
from foundation.texts import DEFAULT_CALIB, RANGES, load_text

if TYPE_CHECKING:
    import torch


class CalibrationTextTooShort(KvslimError):
    """The calibration text has fewer tokens than the windows asked for."""


@dataclass(frozen=True, kw_only=True)
class CalibrationSpec:
    """Where calibration text comes from and how much of it to use."""

    source: str = DEFAULT_CALIB  # a named range (``corpus:calib``) or a text file path
    num_samples: int
    seq_len: int

    def __post_init__(self) -> None:
        if self.num_samples <= 0:
            raise KvslimError(f"--num-calib-samples must be positive, got {self.num_samples}")
        if self.seq_len <= 1:
            raise KvslimError(f"--calib-seq-len must be at least 2, got {self.seq_len}")

    @property
    def is_named_range(self) -> bool:
        return self.source in RANGES

    @property
    def num_tokens(self) -> int:
        return self.num_samples * self.seq_len

    def describe(self) -> str:
        return f"{self.num_samples} x {self.seq_len} tokens of {self.source}"

    def check(self) -> None:
        """Validate the source before anything heavy runs (bad range role, missing file)."""
        if self.is_named_range:
            role = RANGES[self.source].role
            if role != "calib":
                raise KvslimError(
                    f"--calib {self.source} is a {role} range; calibration must use a calib range "
                    f"(e.g. {DEFAULT_CALIB}) so evaluation text stays held out"
                )
            return
        if not Path(self.source).expanduser().is_file():
            raise KvslimError(f"calibration file {self.source} not found (pass a text file or a range such as {DEFAULT_CALIB})")

    def load_text(self) -> str:
        self.check()
        if self.is_named_range:
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
        raise KvslimError(f"{model_dir} has no tokenizer files; calibration needs one")
    return AutoTokenizer.from_pretrained(model_dir)


def token_windows(ids: torch.Tensor | list[int], spec: CalibrationSpec) -> torch.Tensor:
    """Cut a token stream into ``[num_samples, seq_len]`` consecutive windows."""
    import torch

    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() < spec.num_tokens:
        raise CalibrationTextTooShort(
            f"calibration text {spec.source} has {ids.numel()} tokens; {spec.num_samples} samples x "
            f"{spec.seq_len} tokens need {spec.num_tokens}"
        )
    return ids[: spec.num_tokens].reshape(spec.num_samples, spec.seq_len).clone()


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
