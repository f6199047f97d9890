"""Eval results as JSON, cached per checkpoint content hash + task set + limits, and parsed back."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from foundation.atomic import write_text_atomic
from foundation.errors import KvslimError
from foundation.model_source import cache_root

RESULTS_FORMAT = 1


@dataclass(frozen=True)
class TaskScore:
    """One row of the results table: a task's primary metric (or a perplexity) with its stderr."""

    task: str
    metric: str  # e.g. "acc_norm", "perplexity"
    value: float
    stderr: float | None  # None where no stderr is defined (our perplexity entries)
    num_samples: int  # docs (lm-eval tasks) or tokens (perplexity entries)
    higher_is_better: bool
    metrics: dict[str, float] = field(default_factory=dict)  # every metric lm-eval reported
    detail: str = ""  # e.g. "wikipedia:eval, first 8192 tokens, context 512, stride 256"


@dataclass(frozen=True)
class EvalResults:
    """Everything one `compress eval` run measured, and under which settings."""

    checkpoint: str
    checkpoint_sha256: str
    backend: str
    settings: dict  # task limits, perplexity tokens, batch size, versions: all part of the cache key
    scores: dict[str, TaskScore]
    seconds: float
    cpu_seconds: float

    def to_json(self) -> str:
        d = asdict(self)
        d["format"] = RESULTS_FORMAT
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "EvalResults":
        d = json.loads(text)
        if d.pop("format", None) != RESULTS_FORMAT:
            raise KvslimError(f"results JSON is not format {RESULTS_FORMAT}")
        d["scores"] = {k: TaskScore(**v) for k, v in d["scores"].items()}
        return cls(**d)


def checkpoint_sha256(ckpt: Path) -> str:
    """Content hash of every file of a checkpoint directory (names and bytes)."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(ckpt).rglob("*") if p.is_file())
    if not files:
        raise KvslimError(f"{ckpt}: empty checkpoint directory")
    for p in files:
        file_hash = hashlib.sha256()
        with p.open("rb") as f:
            while chunk := f.read(1 << 24):
                file_hash.update(chunk)
        h.update(f"{p.relative_to(ckpt)}\0{file_hash.hexdigest()}\n".encode())
    return h.hexdigest()


def cache_key(ckpt_sha256: str, backend: str, settings: dict) -> str:
    blob = json.dumps({"ckpt": ckpt_sha256, "backend": backend, "settings": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def results_dir() -> Path:
    return cache_root() / "eval_results"


def cache_path(ckpt_sha256: str, backend: str, settings: dict) -> Path:
    return results_dir() / f"{cache_key(ckpt_sha256, backend, settings)}.json"


def load_cached(path: Path) -> EvalResults | None:
    """The cached results at ``path``, or None if there are none."""
    if not path.is_file():
        return None
    return EvalResults.from_json(path.read_text())


def save(results: EvalResults, path: Path) -> Path:
    """Write results JSON atomically (write a temp file, then rename)."""
    return write_text_atomic(path, results.to_json())
