"""Healing on a tiny model with the default model's tokenizer (so real text tokenizes)."""
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from attention_variants.convert import ConvertSpec, convert
from attention_variants.heal import (
    MERGED_KV_LR,
    SHARED_KV_LR,
    HealSpec,
    default_lr,
    distill_loss,
    heal,
    hidden_state_loss,
)
from attention_variants.summary import load_for_eval
from cli.main import main
from foundation.errors import KvslimError
from foundation.perplexity import hf_logits_fn, perplexity
from tests.tiny_models import make_tiny_checkpoint

SPEC = HealSpec(steps=6, seq_len=64, batch_size=2, lr=3e-3, warmup_steps=2, save_every=100)


@pytest.fixture(scope="module")
def heal_text(tmp_path_factory):
    """A slice of wikipedia:heal as a file (tokenizing the whole range each run is slow)."""
    from foundation.texts import load_text

    path = tmp_path_factory.mktemp("text") / "heal.txt"
    path.write_text(load_text("wikipedia:heal")[:20000])
    return path


@pytest.fixture(scope="module")
def spec(heal_text):
    return replace(SPEC, data=str(heal_text))


@pytest.fixture(scope="module")
def pair(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("heal")
    teacher = make_tiny_checkpoint(root / "teacher", "llama", tokenizer_from=default_model_dir, vocab_size=49152)
    student = root / "student"
    convert(teacher, ConvertSpec(kv_heads=1, kv_share=2, merge="mean"), student)
    return teacher, student


def _eval_ids(path, n=256):
    from transformers import AutoTokenizer

    from foundation.texts import load_documents

    text = load_documents("wikipedia:eval")[0]
    return AutoTokenizer.from_pretrained(path)(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :n]


@torch.no_grad()
def _held_out_kl(student, teacher):
    ids = _eval_ids(teacher)
    return float(distill_loss(load_for_eval(student)(ids).logits, load_for_eval(teacher)(ids).logits))


def _eval_ppl(path):
    ids = _eval_ids(path)[0]
    return perplexity(hf_logits_fn(load_for_eval(path)), ids, "wikipedia:eval", context=128, stride=64).perplexity


def test_heal_lowers_loss_and_held_out_perplexity_and_keeps_the_rest(pair, spec, tmp_path):
    teacher, student = pair
    out = tmp_path / "healed"
    heal(student, teacher, spec, out)
    assert _held_out_kl(out, teacher) < _held_out_kl(student, teacher)
    assert _eval_ppl(out) < _eval_ppl(student)
    before, after = load_file(student / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".self_attn." in n for n in changed)  # untouched parameters bit-identical


@pytest.mark.parametrize("optim", ["adamw", "adamw8bit"])
def test_resume_continues_the_same_run(pair, spec, tmp_path, optim):
    if optim == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    spec = replace(spec, optim=optim)
    teacher, student = pair
    straight = heal(student, teacher, spec, tmp_path / "straight")

    def interrupt(report, _model):
        if report.step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        heal(student, teacher, spec, tmp_path / "resumed", on_step=interrupt)
    assert not (tmp_path / "resumed").exists()
    resumed = heal(student, teacher, spec, tmp_path / "resumed")
    assert resumed.resumed_from == 3
    a, b = load_file(straight.out / "model.safetensors"), load_file(resumed.out / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)


def test_adamw8bit_heals_in_a_quarter_of_the_optimizer_memory(pair, spec, tmp_path):
    pytest.importorskip("bitsandbytes")
    teacher, student = pair
    full = heal(student, teacher, spec, tmp_path / "adamw")
    small = heal(student, teacher, replace(spec, optim="adamw8bit"), tmp_path / "adamw8bit")
    # 8 bytes of fp32 moments per trained parameter vs 2 bytes of 8-bit moments (+ block scales, maps)
    assert small.optimizer_bytes < 0.3 * full.optimizer_bytes
    assert _held_out_kl(small.out, teacher) < _held_out_kl(student, teacher)


def test_cpu_clock_budget_follows_cpu_time_and_stops(pair, spec, tmp_path, monkeypatch):
    import attention_variants.heal as heal_module

    ticks = iter(range(0, 10_000, 30))  # a fake CPU clock: 30 s per reading, i.e. 30 s per step
    monkeypatch.setattr(heal_module, "_cpu_time", lambda: float(next(ticks)))
    reports = []
    budget = replace(spec, steps=None, minutes=1.5, clock="cpu")  # 90 CPU-seconds: three steps
    teacher, student = pair
    result = heal(student, teacher, budget, tmp_path / "out", on_step=lambda r, _m: reports.append(r))
    assert result.steps == 3 and result.train_seconds == 90.0
    assert [r.train_seconds for r in reports] == [30.0, 60.0, 90.0]
    assert all(r.wall_seconds < 30 for r in reports)  # the wall clock is kept apart
    with pytest.raises(KvslimError, match="wall clock"):
        heal(student, teacher, replace(budget, device="cuda"), tmp_path / "gpu")


def test_distill_loss_is_zero_for_identical_logits():
    x = torch.randn(2, 5, 11)
    assert float(distill_loss(x, x)) == pytest.approx(0.0, abs=1e-6)


@torch.no_grad()
def _held_out_hidden_error(student, teacher):
    ids = _eval_ids(teacher)
    s = load_for_eval(student)(ids, output_hidden_states=True).hidden_states
    return float(hidden_state_loss(s, load_for_eval(teacher)(ids, output_hidden_states=True).hidden_states))


def test_hidden_state_matching_lowers_held_out_hidden_error_and_kl(pair, spec, tmp_path):
    teacher, student = pair
    out = tmp_path / "healed"
    result = heal(student, teacher, replace(spec, hidden_weight=1.0), out)
    assert result.last_loss < result.first_loss
    assert _held_out_hidden_error(out, teacher) < _held_out_hidden_error(student, teacher)
    assert _held_out_kl(out, teacher) < _held_out_kl(student, teacher)


def test_hidden_state_loss_is_zero_for_identical_states_and_relative_per_token():
    h = tuple(torch.randn(2, 5, 8) for _ in range(3))
    assert float(hidden_state_loss(h, h)) == 0.0
    sink = tuple(x.clone() for x in h)
    for x in sink:
        x[:, 0] *= 100  # a token with 100x the norm counts as much as any other
    off = tuple(x * 1.1 for x in sink)  # every token 10% off: relative squared error 0.01 each
    assert float(hidden_state_loss(off, sink)) == pytest.approx(0.01, rel=1e-4)
    assert float(hidden_state_loss((h[0] * 5,) + h[1:], h)) == 0.0  # index 0 (embeddings) is skipped


def test_default_lr_follows_the_rewrite(tmp_path, default_model_dir):
    """2e-4 where KV heads were merged (alone or with sharing), 5e-4 for KV sharing alone."""
    teacher = make_tiny_checkpoint(tmp_path / "teacher", "llama", tokenizer_from=default_model_dir, vocab_size=49152)
    config = lambda p: json.loads((p / "config.json").read_text())  # noqa: E731
    for name, convert_spec, lr in (("mqa", ConvertSpec(kv_heads=1, merge="mean"), MERGED_KV_LR),
                                   ("both", ConvertSpec(kv_heads=1, kv_share=2, merge="mean"), MERGED_KV_LR),
                                   ("share", ConvertSpec(kv_share=2), SHARED_KV_LR)):
        convert(teacher, convert_spec, tmp_path / name)
        assert default_lr(config(tmp_path / name), config(teacher)) == lr, name


def test_bad_input(pair, tiny_llama, heal_text, tmp_path, capsys):
    teacher, student = pair
    out = tmp_path / "out"
    cases = [
        ([str(student), "--teacher", str(tiny_llama), "--steps", "1"], "differ in vocab_size"),
        ([str(teacher), "--teacher", str(teacher), "--steps", "1"], "not a `compress convert` output"),
        ([str(student), "--teacher", str(teacher), "--steps", "100", "--data", str(heal_text)], "steps of"),
        ([str(student), "--teacher", str(teacher), "--steps", "1", "--data", "wikipedia:eval"], "evaluation text"),
        ([str(student), "--teacher", str(teacher), "--steps", "1", "--hidden-weight", "-1"], "--hidden-weight"),
        ([str(student), "--teacher", str(teacher), "--steps", "1", "--lr", "0"], "--lr"),
        ([str(student), "--teacher", str(teacher), "--steps", "1", "--eval-tokens", "-5"], "--eval-tokens"),
    ]
    for flags, message in cases:
        assert main(["heal", "--eval-tokens", "0", *flags, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
        assert not out.exists()


@pytest.mark.parametrize("settings,message", [
    (dict(), "exactly one of --steps S or --minutes M"),
    (dict(steps=0), "must be positive"),
    (dict(steps=1, seq_len=1), "--seq-len must be at least 2"),
    (dict(steps=1, batch_size=0), "--batch-size at least 1"),
    (dict(steps=1, train="some"), "--train some"),
    (dict(steps=1, optim="sgd"), "--optim sgd"),
    (dict(steps=2, local_steps=3), "--local-steps 3"),
    (dict(steps=2, local_steps=1, train="all"), "does not combine with --train all"),
])
def test_spec_is_checked_before_any_checkpoint_is_read(settings, message, tmp_path):
    with pytest.raises(KvslimError, match=message):
        HealSpec(**settings).check()
    with pytest.raises(KvslimError, match=message):  # heal() refuses it before opening the missing checkpoints
        heal(tmp_path / "no-student", tmp_path / "no-teacher", HealSpec(**settings), tmp_path / "out")


def test_other_tokenizer_is_refused(pair, spec, tmp_path, default_model_dir):
    teacher, student = pair
    other = make_tiny_checkpoint(tmp_path / "other", "llama", tokenizer_from=default_model_dir, vocab_size=49152)
    tok = other / "tokenizer.json"
    data = json.loads(tok.read_text())
    vocab = data["model"]["vocab"]
    vocab["the"], vocab["and"] = vocab["and"], vocab["the"]  # same tokens, other ids
    tok.write_text(json.dumps(data))
    with pytest.raises(KvslimError, match="vocabulary differs"):
        heal(student, other, spec, tmp_path / "out")


def test_convert_heal_steps_shortcut(pair, tmp_path, capsys):
    teacher, _ = pair
    out = tmp_path / "out"
    assert main(["convert", str(teacher), "--mqa", "--merge", "mean", "--heal-steps", "2", "--eval-tokens", "0",
                 "-o", str(out)]) == 0
    assert "healed 2 steps" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no unhealed copy or training state left behind


def test_default_lr_is_resolved_and_reported(pair, spec, tmp_path):
    teacher, student = pair  # MQA + kv-share 2: KV heads merged
    result = heal(student, teacher, replace(spec, lr=None, steps=1), tmp_path / "o")
    assert result.lr == MERGED_KV_LR
