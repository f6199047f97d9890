"""The offline task pack: lm-eval's own task YAMLs over data shipped in packages, no hub."""
import json
from pathlib import Path

import pytest
import yaml

from eval.task_pack import LAMBADA_DOCS, LM_EVAL_TASKS, build_pack, lm_eval_tasks_dir


@pytest.fixture(scope="module")
def pack(tmp_path_factory) -> Path:
    return build_pack(tmp_path_factory.mktemp("pack") / "pack")


def test_pack_yamls_include_lm_eval_tasks_with_absolute_local_data(pack):
    for name, task in LM_EVAL_TASKS.items():
        cfg = yaml.safe_load((pack / f"{name}.yaml").read_text())
        assert cfg["task"] == name
        assert Path(cfg["include"]).is_absolute()
        assert Path(cfg["include"]) == lm_eval_tasks_dir() / task.upstream_yaml
        (data_file,) = cfg["dataset_kwargs"]["data_files"].values()
        assert Path(data_file).is_absolute() and Path(data_file).is_file(), data_file
        assert cfg["dataset_path"] in ("arrow", "json")


def test_lambada_rebuilt_from_olmo_requests(pack):
    lines = (pack / "lambada_openai_test.jsonl").read_text().splitlines()
    assert len(lines) == LAMBADA_DOCS
    first = json.loads(lines[0])["text"]
    assert first.endswith("I don't care about signs")


def test_every_task_loads_offline_with_its_docs(pack, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(pack), include_defaults=False)
    tasks = manager.load(list(LM_EVAL_TASKS))["tasks"]
    for name, spec in LM_EVAL_TASKS.items():
        task = tasks[name]
        docs = list(task.eval_docs)
        assert len(docs) == spec.num_docs, name
        if task.OUTPUT_TYPE != "multiple_choice":
            continue
        choices = task.doc_to_choice(docs[0])
        # winogrande scores one continuation after each of several contexts: its gold is the text index
        target = task.doc_to_text(docs[0]) if name == "winogrande" else task.doc_to_target(docs[0])
        assert isinstance(target, int) and 0 <= target < len(choices), (name, target, choices)


def test_boolq_target_comes_from_the_answer_column(pack):
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_path=str(pack), include_defaults=False).load(["boolq"])["tasks"]["boolq"]
    docs = list(task.eval_docs)[:20]
    assert [task.doc_to_target(d) for d in docs] == [int(d["answer"]) for d in docs]
