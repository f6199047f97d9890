"""Read and write Hugging Face checkpoint directories (config.json + safetensors shards).

Only safetensors are ever loaded (never pickles). Tensors are read lazily, one at a time, so the
callers can stream a model that does not fit in memory.
"""
from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from foundation.errors import CheckpointError
from foundation.kv_plan_file import PLAN_FILE

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
# Files carried over unchanged from the source checkpoint to every output.
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def _check_safetensors_file(path: Path) -> dict[str, dict]:
    """Parse a safetensors header and verify the file holds every byte it declares."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated safetensors file (header cut off)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file ({size} bytes, header declares {8 + n + end})"
        )
    return header


@dataclass
class Checkpoint:
    """A checkpoint directory opened for lazy reading."""

    path: Path
    config: dict
    # tensor name -> shard file
    weight_map: dict[str, Path] = field(default_factory=dict)
    # tensor name -> (dtype string, shape) from the headers, without reading data
    headers: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | Path) -> "Checkpoint":
        path = Path(path).expanduser()
        if not path.exists():
            raise CheckpointError(f"{path}: no such file or directory")
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a checkpoint directory")
        cfg_path = path / CONFIG
        if not cfg_path.is_file():
            raise CheckpointError(f"{path}: no config.json (not a Hugging Face checkpoint)")
        try:
            config = json.loads(cfg_path.read_text())
        except ValueError as e:
            raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from None
        ckpt = cls(path=path, config=config)
        ckpt._index_shards()
        return ckpt

    def _index_shards(self) -> None:
        index = self.path / INDEX
        if index.is_file():
            wm = json.loads(index.read_text())["weight_map"]
            files = sorted(set(wm.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            if any(self.path.glob("*.bin")) or any(self.path.glob("*.pt")):
                raise CheckpointError(
                    f"{self.path}: only pickle weights (.bin/.pt) found; kvslim loads safetensors only"
                )
            raise CheckpointError(f"{self.path}: no *.safetensors weights")
        for name in files:
            shard = self.path / name
            if not shard.is_file():
                raise CheckpointError(f"{self.path}: shard {name} listed in the index is missing")
            for tname, meta in _check_safetensors_file(shard).items():
                self.weight_map[tname] = shard
                self.headers[tname] = (meta["dtype"], tuple(meta["shape"]))

    # --- reading -------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.weight_map)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return self.headers[name][1]

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor from disk (memory-mapped, copied out)."""
        if name not in self.weight_map:
            raise CheckpointError(f"{self.path}: missing tensor {name}")
        with safe_open(self.weight_map[name], framework="pt") as f:
            return f.get_tensor(name)

    def iter_tensors(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield tensors shard by shard, opening each shard once."""
        wanted = set(self.weight_map if names is None else names)
        by_file: dict[Path, list[str]] = {}
        for n in (names if names is not None else self.weight_map):
            if n in wanted:
                by_file.setdefault(self.weight_map[n], []).append(n)
        for shard, ns in by_file.items():
            with safe_open(shard, framework="pt") as f:
                for n in ns:
                    yield n, f.get_tensor(n)

    @property
    def quantization_config(self) -> dict | None:
        return self.config.get("quantization_config")

    @property
    def generation_config(self) -> dict:
        """generation_config.json (EOS ids, sampling defaults), or ``{}`` when there is none."""
        gen = self.path / GENERATION_CONFIG
        if not gen.is_file():
            return {}
        try:
            return json.loads(gen.read_text())
        except ValueError as e:
            raise CheckpointError(f"{gen}: invalid JSON ({e})") from None

    def copy_side_files(self, out: Path, kv_plan: bool = True) -> None:
        """Carry tokenizer and generation config over to ``out``, and the KV plan unless ``kv_plan``
        is False (a rewrite of the attention: the plan describes the layout it was made for)."""
        for name in SIDE_FILES + ((PLAN_FILE,) if kv_plan else ()):
            src = self.path / name
            if src.is_file():
                shutil.copy2(src, out / name)
        for src in self.path.glob("*.py"):  # a carried modeling file (auto_map)
            shutil.copy2(src, out / src.name)


class ShardWriter:
    """Write tensors into numbered safetensors shards as they come, then the index.

    Memory is bounded by ``max_shard_bytes``: a shard is flushed as soon as it is full.
    """

    def __init__(self, out: Path, max_shard_bytes: int = 2 * 1024**3) -> None:
        self.out = Path(out)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[dict[str, torch.Tensor] | list[str]] = []
        self._weight_map: dict[str, str] = {}
        self._total = 0
        self._files: list[Path] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._weight_map or name in self._pending:
            raise ValueError(f"tensor {name} written twice")
        t = tensor.detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        if not self._pending:
            return
        idx = len(self._files)
        path = self.out / f"model-{idx + 1:05d}.safetensors.part"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._files.append(path)
        self._shards.append(list(self._pending))
        self._pending = {}
        self._pending_bytes = 0

    def close(self) -> int:
        """Flush, name the shards ``model-0000i-of-0000n.safetensors`` (or ``model.safetensors``)."""
        self._flush()
        n = len(self._files)
        if n == 1:
            final = self.out / "model.safetensors"
            self._files[0].rename(final)
            return self._total
        for i, (path, names) in enumerate(zip(self._files, self._shards)):
            final_name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out / final_name)
            for name in names:
                self._weight_map[name] = final_name
        index = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(self._weight_map.items()))}
        (self.out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return self._total


def write_config(out: Path, config: dict) -> None:
    (Path(out) / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
