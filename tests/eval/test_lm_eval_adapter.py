"""The ``kvslim`` lm-eval model against lm-eval's own ``hf`` model, request by request."""
from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

from eval.lm_eval_adapter import KvslimLM, register
from foundation.texts import load_text
from tests.tiny_models import make_tiny_checkpoint

TOLERANCE_NATS = 1e-4
FP32_EPS = 2.0 ** -23


@pytest.fixture(scope="module")
def tiny_real_vocab(tmp_path_factory, default_model_dir):
    """A tiny random Llama with the default model's tokenizer (so real text tokenizes for real)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lm_eval_adapter") / "tiny", "llama",
                                vocab_size=49152, tokenizer_from=default_model_dir, max_position_embeddings=256)


@pytest.fixture(scope="module")
def lms(tiny_real_vocab):
    from lm_eval.api.registry import get_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_real_vocab), dtype=torch.float32).eval()
    hf = get_model("hf")(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(str(tiny_real_vocab)),
                         batch_size=4, device="cpu")
    ours = get_model("kvslim").create_from_arg_string(f"pretrained={tiny_real_vocab},dtype=float32",
                                                     {"batch_size": 4, "device": "cpu"})
    return hf, ours


def _requests(kind: str, args_list) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args_list)]


def _sentences(n: int) -> list[str]:
    words = load_text("wikipedia:eval").split()
    return [" ".join(words[i * 40:(i + 1) * 40]) for i in range(n)]


def test_registered_beside_hf():
    from lm_eval.api.registry import get_model

    register()
    register()  # idempotent
    assert get_model("kvslim") is KvslimLM
    assert get_model("hf").__name__ == "HFLM"


def test_loglikelihood_matches_hf(lms):
    hf, ours = lms
    texts = _sentences(6)
    args = [(t[: len(t) // 2], t[len(t) // 2:]) for t in texts]  # mid-word and mid-sentence splits
    args += [(texts[0] + " ", "the"), ("", texts[1][:60]), ("Question: what is it?\nAnswer:", " a city")]
    ref = hf.loglikelihood(_requests("loglikelihood", args))
    got = ours.loglikelihood(_requests("loglikelihood", args))
    assert len(got) == len(ref)
    for (lp_ref, greedy_ref), (lp, greedy) in zip(ref, got):
        assert abs(lp - lp_ref) < TOLERANCE_NATS
        assert greedy == greedy_ref


def test_loglikelihood_rolling_matches_hf(lms):
    """Documents longer than max_length (256) take several rolling windows."""
    hf, ours = lms
    words = load_text("wikipedia:eval").split()
    docs = [" ".join(words[:30]), " ".join(words[100:500]), " ".join(words[600:1400])]
    ref = hf.loglikelihood_rolling(_requests("loglikelihood_rolling", [(d,) for d in docs]))
    got = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", [(d,) for d in docs]))
    assert len(ours.tok_encode(docs[2])) > 2 * ours.max_length
    for lp_ref, lp in zip(ref, got):
        # hf rounds each window's sum to fp32 (an ulp is 5e-4 nats at 7,000 nats), ours sums in
        # float64: 1e-4 nats plus two fp32 ulps of the total.
        assert abs(lp - lp_ref) < TOLERANCE_NATS + 2 * FP32_EPS * abs(lp_ref)


def test_generate_until_matches_hf(lms):
    hf, ours = lms
    args = [(t, {"until": ["."], "max_gen_toks": 12, "do_sample": False}) for t in _sentences(3)]
    assert ours.generate_until(_requests("generate_until", args)) == hf.generate_until(_requests("generate_until", args))


def test_bad_kv_dtype(tiny_real_vocab):
    from foundation.errors import KvslimError

    with pytest.raises(KvslimError, match="kv_cache_dtype"):
        KvslimLM(pretrained=str(tiny_real_vocab), kv_cache_dtype="fp4")


def test_cli_entry_point_registers_then_hands_over(monkeypatch):
    """`kvslim-lm-eval` is lm-eval's own CLI, entered with `kvslim` already registered.
    (A real `kvslim-lm-eval run --model kvslim ...` is in BENCHMARKS.md; it takes a minute.)"""
    import lm_eval.__main__
    from lm_eval.api.registry import get_model

    from cli import lm_eval as lm_eval_cli

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append((get_model("kvslim"), get_model("hf").__name__)))
    lm_eval_cli.main()
    assert seen == [(KvslimLM, "HFLM")]


def test_compress_eval_backend_kvslim_agrees_with_hf(tiny_real_vocab, tmp_path, monkeypatch, capsys):
    """`compress eval --backend kvslim`: the same task accuracy and perplexity as the hf backend."""
    from cli.main import main
    from eval import results_cache

    monkeypatch.setattr(results_cache, "results_dir", lambda: tmp_path / "results")
    args = [str(tiny_real_vocab), "--tasks", "arc_easy", "ppl_wikipedia", "--limit", "4", "--ppl-tokens", "200"]  # within the tiny context
    scores = {}
    for backend in ("hf", "kvslim"):
        assert main(["eval", *args, "--backend", backend]) == 0
        path = next(p for p in (tmp_path / "results").glob("*.json") if p.name not in scores.values())
        scores[backend] = path.name
    parsed = {b: results_cache.EvalResults.from_json((tmp_path / "results" / n).read_text()) for b, n in scores.items()}
    assert parsed["kvslim"].backend == "kvslim"
    assert parsed["kvslim"].scores["arc_easy"].metrics["acc"] == parsed["hf"].scores["arc_easy"].metrics["acc"]
    ppl_hf, ppl_ours = (parsed[b].scores["ppl_wikipedia"].value for b in ("hf", "kvslim"))
    assert abs(ppl_ours - ppl_hf) / ppl_hf < 1e-4
    assert "backend kvslim" in capsys.readouterr().out
