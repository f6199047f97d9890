"""A checkpoint's BPE tokenizer as the GGUF metadata llama.cpp reads (``tokenizer.ggml.*``).

llama.cpp re-implements the pre-tokenizer (the regex split before BPE) by name
(``tokenizer.ggml.pre``), so the name must match what tokenizer.json does. We recognise the
pre-tokenizers whose llama.cpp counterpart we checked token for token; any other needs
``--tokenizer-pre NAME`` (a llama.cpp pre-tokenizer name) from the user.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf

from foundation.errors import KvslimError

# json.dumps(pre_tokenizer, sort_keys=True) with no normalizer -> llama.cpp's pre-tokenizer name
# (SmolLM2 as transformers writes it from the GGUF: GPT-2's byte-level regex).
_KNOWN_PRE = {
    json.dumps({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
               sort_keys=True): "gpt-2",
}


def pre_tokenizer_name(tokenizer: dict, override: str | None) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer (``override`` wins)."""
    if override:
        return override
    if tokenizer.get("normalizer") is None:
        name = _KNOWN_PRE.get(json.dumps(tokenizer.get("pre_tokenizer"), sort_keys=True))
        if name:
            return name
    raise KvslimError(
        "tokenizer.json's pre-tokenizer has no known llama.cpp counterpart; pass --tokenizer-pre NAME "
        "(llama.cpp's name for it, e.g. llama-bpe, qwen2, smollm)"
    )


def add_vocab(writer: gguf.GGUFWriter, checkpoint: Path, vocab_size: int, tokenizer_pre: str | None) -> str:
    """Write the BPE vocabulary, merges, special ids and chat template; returns the pre-tokenizer name."""
    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        raise KvslimError(f"{checkpoint}: GGUF export needs tokenizer.json (a BPE tokenizer)")
    try:
        tokenizer = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise KvslimError(f"{path}: cannot read ({e})") from None
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE":
        raise KvslimError(f"{path}: GGUF export writes BPE tokenizers; this one is {model.get('type')}")
    pre = pre_tokenizer_name(tokenizer, tokenizer_pre)
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    types: dict[int, int] = {}
    for added in tokenizer.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    if by_id and max(by_id) >= vocab_size:
        raise KvslimError(f"{path}: token id {max(by_id)} is outside the model's vocab_size {vocab_size}")
    tokens, token_types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            token_types.append(types.get(i, gguf.TokenType.NORMAL))
        else:  # embedding rows no token uses (vocab padded to a round size)
            tokens.append(f"[PAD{i}]")
            token_types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    gguf.SpecialVocab(checkpoint, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer)
    return pre
