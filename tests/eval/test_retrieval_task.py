"""Retrieval tasks: prompts seeded and laid out as stated, calibration wording disjoint from the
evaluation's, answers scored by the first number, and `compress eval --tasks passkey` end to end."""
from __future__ import annotations

import json

import pytest

from cli.main import main
from eval import results_cache
from eval.retrieval_task import WORDINGS, RetrievalTask, _place, answered, contexts_run, depth_accuracies, score


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("name", ["passkey", "needle", "needle_pydoc", "multikey", "passkey_calib", "needle_calib",
                                  "needle_code_calib", "needle_doc_calib"])
def test_prompts_are_seeded_and_as_long_as_asked(tokenizer, name):
    task = RetrievalTask(name, contexts=(256, 512), depths=(0, 50, 100), samples=2)
    prompts = task.prompts(tokenizer)
    assert prompts == task.prompts(tokenizer)  # the same every run
    assert len(prompts) == 12 and len({p.answer for p in prompts}) >= 10
    for p in prompts:
        n = len(tokenizer(p.text, add_special_tokens=False)["input_ids"])
        assert 0.8 * p.context <= n <= p.context + 8, (p.context, n)
        assert p.text.count(p.answer) == (2 if name.startswith("passkey") else 1)  # passkey states it twice
        assert len(p.answer) == 5 and p.text.endswith(" is")  # the answer is the continuation


@pytest.mark.parametrize("name", ["passkey_calib", "needle_calib"])
def test_a_later_first_sample_continues_the_seeded_sequence(tokenizer, name):
    """Samples from index 2 are the 3rd and 4th of a 4-sample task at each depth: new prompts."""
    all4 = RetrievalTask(name, contexts=(256,), depths=(0, 50), samples=4).prompts(tokenizer)
    later = RetrievalTask(name, contexts=(256,), depths=(0, 50), samples=2, first_sample=2).prompts(tokenizer)
    assert later == all4[2:4] + all4[6:8]


def test_a_context_longer_than_the_text_is_refused(tokenizer, monkeypatch):
    from eval import retrieval_task
    from foundation.errors import KvslimError

    monkeypatch.setattr(retrieval_task, "_prose_ids", lambda tok, text_range, tokens: list(range(300)))
    with pytest.raises(KvslimError, match="needle_pydoc at 512 tokens needs that much text of pydoc:eval, which has 300"):
        RetrievalTask("needle_pydoc", contexts=(256, 512)).prompts(tokenizer)


def test_depth_places_the_fact():
    sentences = [f"S{i}." for i in range(10)]
    text = _place(sentences, {0: "FACT0.", 50: "FACT50.", 100: "FACT100."})
    words = text.split()
    assert words[0] == "FACT0." and words[-1] == "FACT100." and words.index("FACT50.") == 6


def test_calibration_wording_shares_nothing_with_evaluation():
    for kind in ("passkey", "needle", "multikey"):
        ev, cal = WORDINGS[kind], WORDINGS[f"{kind}_calib"]
        assert ev.filler != cal.filler or not ev.filler
        assert ev.fact != cal.fact and ev.question != cal.question and ev.prose != cal.prose or ev.prose is None
        assert not set(ev.labels) & set(cal.labels)
    assert WORDINGS["needle"].prose == "wikipedia:eval" and WORDINGS["needle_calib"].prose == "wikipedia:calib"
    assert WORDINGS["needle_pydoc"].prose == "pydoc:eval" and WORDINGS["needle_code_calib"].prose == "pysrc:calib"
    assert WORDINGS["needle_code_calib"].question != WORDINGS["needle_pydoc"].question
    assert WORDINGS["needle_doc_calib"].prose == "pyhelp:calib"
    doc, pydoc = WORDINGS["needle_doc_calib"], WORDINGS["needle_pydoc"]
    assert doc.fact != pydoc.fact and doc.question != pydoc.question


def test_answers_are_scored_by_the_first_number():
    assert answered(" 12345. Remember it.", "12345")
    assert not answered(" 1234 then 12345", "12345") and not answered(" green", "12345")
    task = RetrievalTask("passkey", contexts=(100,), depths=(0, 100), samples=2)
    from eval.retrieval_task import RetrievalPrompt

    prompts = [RetrievalPrompt("", "11111", 100, d) for d in (0, 0, 100, 100)]
    acc, metrics = score(task, prompts, [" 11111", " 2", " 11111", " 11111"])
    assert acc == 0.75 and metrics == {"acc@ctx100": 0.75, "acc@ctx100/depth0": 0.5, "acc@ctx100/depth100": 1.0}
    assert contexts_run(metrics) == [100] and depth_accuracies(metrics, 100) == {0: 0.5, 100: 1.0}
    assert depth_accuracies(metrics, 200) == {}


def test_compress_eval_passkey_through_the_engine(tiny_with_tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results_cache, "results_dir", lambda: tmp_path / "results")
    out = tmp_path / "r.json"
    assert main(["eval", str(tiny_with_tokenizer), "--backend", "kvslim", "--tasks", "passkey",
                 "--retrieval-contexts", "128", "--json", str(out)]) == 0
    got = json.loads(out.read_text())["results"]["scores"]["passkey"]
    assert 0.0 <= got["value"] <= 1.0 and got["num_samples"] == 20
    assert set(got["metrics"]) == {"acc@ctx128", *(f"acc@ctx128/depth{d}" for d in (0, 25, 50, 75, 100))}
    by_depth = next(line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("@128"))
    assert "by depth 0%:" in by_depth and "100%:" in by_depth  # accuracy per context and depth, printed
    assert main(["eval", str(tiny_with_tokenizer), "--tasks", "passkey", "--retrieval-contexts", "8"]) == 2
