"""`compress heal --data self`: the teacher writes the distillation text, the same for a seed."""
from __future__ import annotations

import pytest
import torch

from attention_variants.convert import ConvertSpec, convert
from attention_variants.heal import HealSpec, heal
from attention_variants.self_data import teacher_continuations
from attention_variants.summary import load_for_eval
from foundation.errors import KvslimError
from foundation.texts import DEFAULT_CALIB, load_text
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, default_model_dir):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("self") / "teacher", "llama",
                                tokenizer_from=default_model_dir, vocab_size=49152)


def test_continuations_are_deterministic_under_a_seed_and_start_with_calibration_prompts(teacher_dir):
    from transformers import AutoTokenizer

    teacher, tokenizer = load_for_eval(teacher_dir), AutoTokenizer.from_pretrained(teacher_dir)
    a = teacher_continuations(teacher, tokenizer, 3, 40, seed=7, prompt_len=8, progress=False)
    b = teacher_continuations(teacher, tokenizer, 3, 40, seed=7, prompt_len=8, progress=False)
    c = teacher_continuations(teacher, tokenizer, 3, 40, seed=8, prompt_len=8, progress=False)
    assert a == b and a != c and len(a) == 3 * 40
    calib = tokenizer(load_text(DEFAULT_CALIB)[:2000], add_special_tokens=False)["input_ids"]
    seqs = torch.tensor(a).view(3, 40)
    for i in range(3):
        assert seqs[i, :8].tolist() == calib[8 * i: 8 * i + 8]
    with pytest.raises(KvslimError, match="--seq-len"):
        teacher_continuations(teacher, tokenizer, 1, 8, seed=0, prompt_len=8)


def test_heal_on_self_data(teacher_dir, tmp_path):
    student = tmp_path / "student"
    convert(teacher_dir, ConvertSpec(kv_heads=1, merge="mean"), student)
    spec = HealSpec(steps=2, data="self", seq_len=48, batch_size=2, lr=1e-3, warmup_steps=1)
    result = heal(student, teacher_dir, spec, tmp_path / "healed")
    assert result.data.startswith("self") and result.tokens == 2 * 2 * 48
    with pytest.raises(KvslimError, match="do not fill one batch"):
        HealSpec(minutes=1, data="self", self_sequences=1, batch_size=2).check()
