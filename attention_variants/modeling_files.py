"""The modeling files kvslim writes into checkpoints, and how to recognise them.

A converted checkpoint whose layout plain transformers cannot express (hybrid sliding window on
Llama/Mistral, cross-layer KV sharing anywhere) carries ``modeling_kvslim.py`` and an ``auto_map``
pointing at it, so it loads with ``trust_remote_code=True``. Evaluation code should allow
``trust_remote_code`` only when :func:`checkpoint_code_is_ours` says every ``.py`` file in the
checkpoint is byte-identical to one of ours.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from foundation.errors import KvslimError

MODELING_DIR = Path(__file__).resolve().parent / "modeling"
MODELING_FILE = "modeling_kvslim.py"

# model_type -> the class in our modeling file that loads it.
CAUSAL_LM_CLASSES: dict[str, str] = {
    "llama": "KvslimLlamaForCausalLM",
    "mistral": "KvslimMistralForCausalLM",
    "qwen2": "KvslimQwen2ForCausalLM",
    "qwen3": "KvslimQwen3ForCausalLM",
    "gemma3_text": "KvslimGemma3ForCausalLM",  # attention sinks only
}
KV_SHARING_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # whose classes read another layer's K/V


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# sha256 of every earlier version of modeling_kvslim.py that kvslim wrote into checkpoints: their
# code is ours too, so checkpoints converted by an earlier kvslim keep loading (a heal rewrites them
# with the current file). Add the current hash here whenever the file changes.
EARLIER_MODELING_KVSLIM = frozenset({
    "4a28cabf9000be6ce2095d92a106ea1291c4c989a0d2eb81ca76af763c14bd8c",
    "c2bb0ce4f5f176160a5764771945f326f8f5479a9eab045c3827ba47ef88ba1e",
    "633259a2179de7a0cfc4c5a0536ff4245bd350743abae2493dc19d66e52f2b04",
    "8b6c6432a1893ede0150c84541783d5c699925d12c357ce1751baee733059842",
    "91634c5af9d83ad7d17859b4ab1d1f38e820999e75d6dbdf52b42ce2ffd866dd",
    "f1a8e4276a1321ace50b43501e1053fefd7064932cd3a613916d8d205233ae08",
    "5093e8846a49f1a2ea7f18cf41c59a456e01509770774c83530f1a0d3fd0cfde",
})


def known_modeling_hashes() -> dict[str, str]:
    """``{filename: sha256}`` of every modeling file kvslim writes into checkpoints."""
    return {p.name: _sha256(p) for p in sorted(MODELING_DIR.glob("modeling_*.py"))}


def is_our_modeling_file(path: str | Path) -> bool:
    """True when ``path`` has the name and the exact bytes of one of our modeling files (the current
    one, or an earlier version kvslim wrote)."""
    path = Path(path)
    expected = known_modeling_hashes().get(path.name)
    if expected is None or not path.is_file():
        return False
    digest = _sha256(path)
    return digest == expected or (path.name == MODELING_FILE and digest in EARLIER_MODELING_KVSLIM)


def checkpoint_code_is_ours(checkpoint_dir: str | Path) -> bool:
    """True when the checkpoint carries at least one ``.py`` file and all of them are ours."""
    files = sorted(Path(checkpoint_dir).glob("*.py"))
    return bool(files) and all(is_our_modeling_file(p) for p in files)


def auto_map_for(model_type: str) -> dict[str, str]:
    """The ``auto_map`` entry that points transformers at our class for ``model_type``."""
    if model_type not in CAUSAL_LM_CLASSES:
        raise KvslimError(f"kvslim's modeling file does not cover model_type {model_type}")
    return {"AutoModelForCausalLM": f"{Path(MODELING_FILE).stem}.{CAUSAL_LM_CLASSES[model_type]}"}


def write_modeling_file(out: Path) -> None:
    """Copy our modeling file into a checkpoint directory being written."""
    shutil.copy2(MODELING_DIR / MODELING_FILE, Path(out) / MODELING_FILE)
