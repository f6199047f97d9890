"""`compress generate` and text-level generation (tokenizer, stop strings) on a tiny model that
carries the default model's tokenizer."""
from __future__ import annotations

import pytest

from cli.main import main
from runtime.engine.sampling import SamplingParams
from runtime.llm import LLM
from tests.runtime.hf_oracle import single_thread  # noqa: F401
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny_with_tokenizer(default_model_dir, tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tok") / "llama", "llama", tokenizer_from=default_model_dir,
        vocab_size=49152, tie_word_embeddings=True,
    )


def test_text_generation_and_stop_strings(tiny_with_tokenizer):
    llm = LLM(tiny_with_tokenizer)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = llm.generate("The capital of France is", greedy)[0]
    assert out.prompt == "The capital of France is"
    text = out.outputs[0].text
    assert text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    cut = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    assert cut.outputs[0].text == text[: text.index(stop)] and cut.outputs[0].finish_reason == "stop"
    kept = llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_cli_generate_with_stats(tiny_with_tokenizer, capsys):
    rc = main(["generate", str(tiny_with_tokenizer), "Hello there", "--max-tokens", "5", "--stats"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "weights:" in out and "MiB resident" in out
    # 4 layers x 2 x 2 KV heads x 32 x 4 bytes = 2 KiB per token (fp32)
    assert "kv cache: 2.00 KiB/token" in out
    assert "5 generated" in out


def test_cli_generate_with_int4_kv(tiny_with_tokenizer, capsys):
    rc = main(["generate", str(tiny_with_tokenizer), "Hello there", "--max-tokens", "5", "--stats",
               "--kv-cache-dtype", "int4"])
    out = capsys.readouterr().out
    assert rc == 0
    # per token and KV head: 32 dims at 4 bits x 2 (16 + 16 B), K parameters 4 B x 32 / 64 tokens,
    # V parameters 4 B: 38 B; x 2 KV heads x 4 layers = 304 B = 0.30 KiB
    assert "kv cache: 0.30 KiB/token" in out and "(int4)" in out


def test_bad_kv_cache_dtype_is_one_line_exit_2(tiny_with_tokenizer, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", str(tiny_with_tokenizer), "hi", "--kv-cache-dtype", "int3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "argument --kv-cache-dtype: unknown KV cache dtype 'int3'" in err


def test_cli_generate_with_a_kv_dtype_mix(tiny_with_tokenizer, capsys):
    """``FULL/WINDOWED`` on a model without windowed layers: every layer in the first dtype."""
    rc = main(["generate", str(tiny_with_tokenizer), "Hello there", "--max-tokens", "5", "--stats",
               "--kv-cache-dtype", "fp8/int2"])
    out = capsys.readouterr().out
    # fp8 per token and KV head: 32 B + a 4 B scale, x 2 (K, V) x 2 KV heads x 4 layers = 576 B
    assert rc == 0 and "kv cache: 0.56 KiB/token" in out and "(fp8_e4m3/int2)" in out


@pytest.mark.parametrize("argv,message", [
    (["generate", "{ckpt}", ""], "prompt 0 is empty"),
    (["generate", "/no/such/dir", "hi"], "no such file or directory"),
    (["generate", "{ckpt}", "a", "b"], "expected [CKPT] PROMPT"),
    (["generate", "{ckpt}"], "missing PROMPT after"),
    (["generate", "smollm2"], "missing PROMPT after smollm2"),
    (["generate", "{ckpt}", "hi", "--top-p", "2"], "top_p must be in (0, 1]"),
    (["generate", "{ckpt}", "hi " * 40, "--max-model-len", "16"], "longer than the context of 16"),
])
def test_cli_errors_are_one_line_exit_2(tiny_with_tokenizer, capsys, argv, message):
    rc = main([a.replace("{ckpt}", str(tiny_with_tokenizer)) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.count("\n") == 1 and err.startswith("compress generate: error:")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", [["generate", "{ckpt}", "hi"], ["serve", "{ckpt}"],
                                     ["eval", "{ckpt}", "--backend", "kvslim", "--tasks", "ppl_wikipedia"]])
def test_device_cuda_without_cuda_is_one_line_exit_2(tiny_with_tokenizer, capsys, command):
    rc = main([a.replace("{ckpt}", str(tiny_with_tokenizer)) for a in command] + ["--device", "cuda"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--device cuda: no CUDA device" in err
