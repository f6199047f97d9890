"""Synthetic calibration tokens for tiny models: Zipf-distributed ids, like natural text."""
from __future__ import annotations

import torch


def zipf_ids(num_samples: int, seq_len: int, seed: int, vocab: int = 512, support: int = 96) -> torch.Tensor:
    """``[num_samples, seq_len]`` ids drawn from ``support`` ids with Zipf(1) frequencies."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, support + 1, dtype=torch.float64)
    ranks = torch.multinomial(weights, num_samples * seq_len, replacement=True, generator=g)
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))[:support]
    return ids[ranks].reshape(num_samples, seq_len)
