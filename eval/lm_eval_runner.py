"""Run the eval pack on a checkpoint: lm-eval's ``simple_evaluate`` + the perplexity entries.

A backend turns a checkpoint directory into an :class:`EvalModel`: an lm-eval ``LM`` for the tasks
and a logits function + tokenizer for the perplexity entries. ``hf`` is lm-eval's own ``hf`` model
(``HFLM``) over a transformers model we load ourselves, so that compressed-tensors checkpoints are
dequantized by transformers and remote code runs only when it is one of kvslim's modeling files.
Another backend is one more entry in :data:`BACKENDS`.
"""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from eval.perplexity_task import (
    PERPLEXITY_TASKS,
    PERPLEXITY_TOKENS,
    TEXT_FILE_TASK,
    PerplexityTask,
    run_perplexity_task,
)
from eval.results_cache import EvalResults, TaskScore
from eval.retrieval_task import ANSWER_TOKENS, DEFAULT_CONTEXTS, DEFAULT_SAMPLES, RETRIEVAL_TASKS, RetrievalTask
from eval.retrieval_task import score as retrieval_score
from eval.task_pack import LM_EVAL_TASKS, PACK_VERSION, ensure_pack
from foundation.errors import CheckpointError, KvslimError
from foundation.perplexity import DEFAULT_CONTEXT, LogitsFn, TargetLogprobsFn

# Docs per lm-eval task in a default run (the first N docs of the split). Chosen from measured
# token counts (SmolLM2 tokenizer, tokens per doc summed over choices: hellaswag 176, arc_easy 133,
# arc_challenge 166, piqa 74, winogrande 46, lambada 78, boolq 295, sciq 444) and SmolLM2-135M fp32's
# measured ~250 tokens/s forward on 2 cores (by CPU time; the machine was shared), so that a default
# run (~125k task tokens + 2 x 8,192-token perplexities, ~16k tokens forwarded each) stays under
# 15 minutes on 2 cores (measured: 5 min 00 s on idle cores, peak RSS 3.6 GiB).
DEFAULT_LIMITS: dict[str, int] = {
    "hellaswag": 100,
    "arc_easy": 150,
    "arc_challenge": 100,
    "piqa": 200,
    "winogrande": 200,
    "lambada_openai": 200,
    "boolq": 60,
    "sciq": 30,
}
# Retrieval in the default run: the evaluation variants (the *_calib ones are a planner's).
DEFAULT_RETRIEVAL = ("passkey", "needle")
DEFAULT_TASKS: tuple[str, ...] = tuple(LM_EVAL_TASKS) + tuple(PERPLEXITY_TASKS) + DEFAULT_RETRIEVAL
DEFAULT_BATCH_SIZE = 8
BOOTSTRAP_ITERS = 1000  # lambada's perplexity stderr is bootstrapped; lm-eval's 100k is minutes on CPU
SEED = 1234


@dataclass(frozen=True)
class EvalModel:
    """What the eval pack needs from a backend."""

    lm: Any  # an lm_eval.api.model.LM
    logits_fn: LogitsFn
    tokenizer: Any
    logprobs_fn: TargetLogprobsFn | None = None  # perplexity without a [T, vocab] tensor, where the backend can


def remote_code_allowed(ckpt: Path) -> bool:
    """True when the checkpoint carries modeling code that is verifiably kvslim's own.

    Never arbitrary ``trust_remote_code``: every ``.py`` file must be one of our modeling files,
    checked by sha256 in ``attention_variants.modeling_files``.
    """
    py_files = sorted(p.name for p in ckpt.glob("*.py"))
    if not py_files:
        return False
    from attention_variants.modeling_files import is_our_modeling_file

    foreign = [name for name in py_files if not is_our_modeling_file(ckpt / name)]
    if foreign:
        raise KvslimError(
            f"{ckpt}: {', '.join(foreign)} is not one of kvslim's modeling files (name or sha256 mismatch); "
            "refusing trust_remote_code"
        )
    return True


def load_hf(ckpt: Path, batch_size: int) -> EvalModel:
    """lm-eval's own ``hf`` model over a transformers model loaded from ``ckpt`` (fp32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_file = ckpt / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{ckpt}: no config.json (not a checkpoint directory)")
    config = json.loads(config_file.read_text())
    kwargs: dict[str, Any] = {"dtype": torch.float32, "trust_remote_code": remote_code_allowed(ckpt)}
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if quant else None
    if method == "bitsandbytes":  # bitsandbytes' own Linears, as its users run them
        kwargs["device_map"] = "cpu"
    elif quant is not None:
        if method != "compressed-tensors":
            raise CheckpointError(f"{ckpt}: quantization method {method!r} is neither compressed-tensors nor bitsandbytes")
        from transformers import CompressedTensorsConfig

        kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(ckpt), **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{ckpt}: transformers cannot load it ({str(e).splitlines()[0]})") from None
    return hf_eval_model(model.eval(), tokenizer, batch_size)


def hf_eval_model(model, tokenizer, batch_size: int) -> EvalModel:
    """lm-eval's own ``hf`` model (and a logits function) over an in-memory transformers model."""
    from lm_eval.api.registry import get_model

    from foundation.perplexity import hf_logits_fn

    lm = get_model("hf")(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(model.device))
    return EvalModel(lm=lm, logits_fn=hf_logits_fn(model), tokenizer=tokenizer)


def load_kvslim(ckpt: Path, plan: "EvalPlan") -> EvalModel:
    """lm-eval model ``kvslim``: kvslim's paged-KV engine, quantized weights and KV cache as served,
    activations in ``plan.dtype``."""
    from eval.lm_eval_adapter import KvslimLM, register

    register()
    lm = KvslimLM(pretrained=str(ckpt), batch_size=plan.batch_size, dtype=plan.dtype,
                  kv_cache_dtype=plan.kv_cache_dtype, min_length=max(plan.context, plan.longest_retrieval()),
                  device=plan.device, kernels=plan.kernels)
    return EvalModel(lm=lm, logits_fn=lm.logits_fn, tokenizer=lm.tokenizer, logprobs_fn=lm.logprobs_fn)


# backend name -> loader.
BACKENDS: dict[str, Callable[[Path, "EvalPlan"], EvalModel]] = {
    "hf": lambda ckpt, plan: load_hf(ckpt, plan.batch_size), "kvslim": load_kvslim}


@dataclass(frozen=True)
class EvalPlan:
    """What to run: tasks, per-task doc limits, perplexity tokens and context, batch size."""

    tasks: tuple[str, ...]
    limits: dict[str, int]
    perplexity_tokens: int | None = None  # --ppl-tokens; None: 8,192 of a named range, all of a --text file
    batch_size: int = DEFAULT_BATCH_SIZE
    dtype: str = "auto"  # the kvslim backend's activations (the hf backend runs float32)
    kv_cache_dtype: str = "auto"  # the kvslim backend's KV cache (runtime.cache.kv_dtype_choices)
    context: int = DEFAULT_CONTEXT  # every perplexity entry's window (stride half of it)
    text_file: str | None = None  # --text FILE: the ppl_text entry
    device: str = "auto"  # the kvslim backend's placement (runtime.device)
    kernels: str = "auto"
    retrieval_contexts: tuple[int, ...] = DEFAULT_CONTEXTS  # prompt lengths of the retrieval tasks
    retrieval_samples: int = DEFAULT_SAMPLES  # prompts per retrieval task, context and depth

    @classmethod
    def make(cls, tasks: list[str] | None, limit: int | None, perplexity_tokens: int | None, batch_size: int,
             dtype: str = "auto", kv_cache_dtype: str = "auto", context: int | None = None,
             text_file: str | None = None, device: str = "auto", kernels: str = "auto",
             retrieval_contexts: tuple[int, ...] | None = None, retrieval_samples: int | None = None) -> "EvalPlan":
        """``tasks`` None: the whole pack, or only ``ppl_text`` when ``text_file`` is given."""
        if tasks:
            names = tuple(tasks)
        else:
            names = (TEXT_FILE_TASK,) if text_file else DEFAULT_TASKS
        if text_file and TEXT_FILE_TASK not in names:
            names = (*names, TEXT_FILE_TASK)
        if TEXT_FILE_TASK in names and not text_file:
            raise KvslimError(f"task {TEXT_FILE_TASK} scores a file: give it with --text FILE")
        known = tuple(dict.fromkeys((*DEFAULT_TASKS, TEXT_FILE_TASK, *RETRIEVAL_TASKS)))
        unknown = [t for t in names if t not in known]
        if unknown:
            raise KvslimError(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(known)}")
        if limit is not None and limit < 1:
            raise KvslimError(f"--limit must be >= 1, got {limit}")
        if context is not None and context < 2:
            raise KvslimError(f"--ctx must be >= 2, got {context}")
        if retrieval_contexts is not None and (not retrieval_contexts or min(retrieval_contexts) < 64):
            raise KvslimError(f"--retrieval-contexts must be token counts >= 64, got {list(retrieval_contexts)}")
        if retrieval_samples is not None and retrieval_samples < 1:
            raise KvslimError(f"--retrieval-samples must be >= 1, got {retrieval_samples}")
        limits = {t: min(limit or DEFAULT_LIMITS[t], LM_EVAL_TASKS[t].num_docs) for t in names if t in LM_EVAL_TASKS}
        return cls(names, limits, perplexity_tokens, batch_size, dtype, kv_cache_dtype,
                   context or DEFAULT_CONTEXT, str(Path(text_file).resolve()) if text_file else None, device, kernels,
                   tuple(sorted(set(retrieval_contexts))) if retrieval_contexts else DEFAULT_CONTEXTS,
                   retrieval_samples or DEFAULT_SAMPLES)

    def retrieval_tasks(self) -> list[RetrievalTask]:
        return [RetrievalTask(t, contexts=self.retrieval_contexts, samples=self.retrieval_samples)
                for t in self.tasks if t in RETRIEVAL_TASKS]

    def longest_retrieval(self) -> int:
        """Tokens a backend must hold for the longest retrieval prompt and its answer (0: none)."""
        return max((t.longest for t in self.retrieval_tasks()), default=0)

    def perplexity_tasks(self) -> list[PerplexityTask]:
        """The plan's perplexity entries, in task order, at the plan's context."""
        entries = []
        for name in self.tasks:
            if name == TEXT_FILE_TASK:
                entries.append(PerplexityTask.of_file(self.text_file))
            elif name in PERPLEXITY_TASKS:
                entries.append(PERPLEXITY_TASKS[name])
        return [e.at_context(self.context) if self.context != DEFAULT_CONTEXT else e for e in entries]

    def settings(self, auto_kv_dtype: str | None = None) -> dict:
        """Everything that changes the numbers: part of the results cache key. ``auto_kv_dtype``: what
        ``kv_cache_dtype`` auto serves the checkpoint with (its plan's choice, ``auto_kv_dtype_of``), so
        that the packed KV's storage rules are keyed under auto too."""
        import lm_eval
        import transformers

        from foundation.kv_dtype_mix import SEPARATOR, split_variants
        from runtime.cache.low_bit_kv import KEY_RANGE_SHRINKS, LOW_BIT_KV
        from runtime.cache.packed_recipe import PackedRecipe
        from runtime.device import CPU, Placement
        from runtime.model.layers.activation_dtype import choose_activation_dtype

        placement = Placement.resolve(self.device, self.kernels)
        named_ppl = any(t in PERPLEXITY_TASKS for t in self.tasks)
        served = auto_kv_dtype if self.kv_cache_dtype == "auto" and auto_kv_dtype else self.kv_cache_dtype
        base, variants = split_variants(served)
        packed = [PackedRecipe.of(LOW_BIT_KV[part], variants) for part in base.split(SEPARATOR) if part in LOW_BIT_KV]
        key_basis = [name for name, rule in (("pre-rope", "keys_before_rope"), ("hadamard", "keys_rotated"))
                     if any(getattr(r, rule) for r in packed)]
        return {
            "tasks": sorted(self.tasks),
            "limits": dict(sorted(self.limits.items())),
            "perplexity_tokens": (self.perplexity_tokens or PERPLEXITY_TOKENS) if named_ppl else None,
            **({"perplexity_context": self.context} if self.context != DEFAULT_CONTEXT else {}),
            **({"text_file": self._text_file_settings()} if self.text_file else {}),
            "batch_size": self.batch_size,
            "kvslim_dtype": choose_activation_dtype(self.dtype, device=placement.device).name,  # auto: by the device
            **({"kvslim_placement": f"{placement.device.type}/{placement.kernels}"} if placement != CPU else {}),
            **({"kvslim_kv_cache_dtype": self.kv_cache_dtype} if self.kv_cache_dtype != "auto" else {}),
            # how packed KV is stored and read (2: a step's own rows exact, score a block per step;
            # 3: each sequence's first block also kept exact, PackedRecipe.exact_first_block)
            **({"kvslim_low_bit_read": 3 if any(r.exact_first_block for r in packed) else 2} if packed else {}),
            # key channel ranges clipped to least squared error (PackedRecipe.keys_clipped; never in
            # a sequence's first block): the narrowest range tried, low_bit_kv.KEY_RANGE_SHRINKS
            **({"kvslim_key_clip": min(KEY_RANGE_SHRINKS)} if any(r.keys_clipped for r in packed) else {}),
            # keys stored before RoPE, or after it in a rotated basis (PackedRecipe); a mix may hold both
            **({"kvslim_key_basis": "+".join(key_basis)} if key_basis else {}),
            # values kept in a rotated basis (PackedRecipe.values_rotated)
            **({"kvslim_value_basis": "hadamard"} if any(r.values_rotated for r in packed) else {}),
            # how FP8/INT8 KV is read (2: a step's own rows exact, earlier rows as stored; 3: and
            # a scored token its own row exact, as decoded); also under "auto", where a
            # checkpoint's kv_cache_scheme may choose FP8
            "kvslim_kv_read": 3,
            **({"retrieval_contexts": list(self.retrieval_contexts), "retrieval_version": 1,
                "retrieval_wordings": {t.name: t.wording.digest for t in self.retrieval_tasks()}}
               if self.retrieval_tasks() else {}),
            **({"retrieval_samples": self.retrieval_samples}
               if self.retrieval_tasks() and self.retrieval_samples != DEFAULT_SAMPLES else {}),
            "pack_version": PACK_VERSION,
            "lm_eval": lm_eval.__version__,
            "transformers": transformers.__version__,
            "seed": SEED,
        }

    def _text_file_settings(self) -> dict:
        import hashlib

        from eval.perplexity_task import read_text_file

        digest = hashlib.sha256(read_text_file(self.text_file).encode()).hexdigest()
        return {"path": self.text_file, "sha256": digest, "tokens": self.perplexity_tokens}


def lm_eval_scores(model: EvalModel, plan: EvalPlan) -> dict[str, TaskScore]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    names = [t for t in plan.tasks if t in LM_EVAL_TASKS]
    if not names:
        return {}
    manager = TaskManager(include_path=str(ensure_pack()), include_defaults=False)
    # `samples` gives each task its own first-N docs in one run (`limit` is one number for all).
    out = simple_evaluate(
        model=model.lm,
        tasks=names,
        task_manager=manager,
        samples={t: list(range(plan.limits[t])) for t in names},
        bootstrap_iters=BOOTSTRAP_ITERS,
        log_samples=False,
        random_seed=SEED,
        numpy_random_seed=SEED,
        torch_random_seed=SEED,
        fewshot_random_seed=SEED,
    )
    scores = {}
    for name in names:
        row = out["results"][name]
        metric = LM_EVAL_TASKS[name].primary_metric
        metrics = {k.split(",")[0]: float(v) for k, v in row.items() if "," in k and isinstance(v, (int, float))}
        stderr = metrics.get(f"{metric}_stderr")
        scores[name] = TaskScore(
            task=name,
            metric=metric,
            value=metrics[metric],
            stderr=stderr,
            num_samples=int(out["n-samples"][name]["effective"]),
            higher_is_better=True,
            metrics=metrics,
            detail=f"first {plan.limits[name]} docs, 0-shot",
        )
    return scores


def _perplexity_scores(model: EvalModel, plan: EvalPlan) -> dict[str, TaskScore]:
    scores = {}
    for task in plan.perplexity_tasks():
        r = run_perplexity_task(task, model.logits_fn, model.tokenizer, plan.perplexity_tokens, model.logprobs_fn)
        scores[task.name] = TaskScore(
            task=task.name,
            metric="perplexity",
            value=r["perplexity"],
            stderr=None,
            num_samples=r["num_tokens"],
            higher_is_better=False,
            metrics={
                "perplexity": r["perplexity"],
                "nll_sum": r["nll_sum"],
                "num_scored": float(r["num_scored"]),
                # a uniform guess over the vocabulary: the "chance" of a perplexity entry
                "uniform_perplexity": float(len(model.tokenizer)),
            },
            detail=f"{r['text']}, first {r['num_tokens']} tokens, context {r['context']}, stride {r['stride']}",
        )
    return scores


def _retrieval_scores(model: EvalModel, plan: EvalPlan) -> dict[str, TaskScore]:
    """Each retrieval task's prompts answered by greedy generation through the backend's own
    ``generate_until`` (the kvslim engine: the cache compressed as served)."""
    from lm_eval.api.instance import Instance

    scores = {}
    for task in plan.retrieval_tasks():
        prompts = task.prompts(model.tokenizer)
        gen = {"until": ["\n"], "max_gen_toks": ANSWER_TOKENS, "do_sample": False}
        requests = [Instance("generate_until", {}, (p.text, dict(gen)), i) for i, p in enumerate(prompts)]
        accuracy, metrics = retrieval_score(task, prompts, model.lm.generate_until(requests))
        scores[task.name] = TaskScore(
            task=task.name, metric="acc", value=accuracy, stderr=None, num_samples=len(prompts),
            higher_is_better=True, metrics=metrics,
            detail=f"contexts {', '.join(map(str, task.contexts))} tokens x depths "
                   f"{', '.join(map(str, task.depths))}%, {task.samples} prompts each, greedy",
        )
    return scores


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def auto_kv_dtype_of(ckpt: str | Path, backend: str) -> str | None:
    """The KV dtype ``--kv-cache-dtype auto`` takes from the checkpoint's ``plan.json`` on the kvslim
    backend, else None."""
    from foundation.kv_plan_file import planned_kv_dtype

    return planned_kv_dtype(ckpt) if backend == "kvslim" and Path(ckpt).is_dir() else None


def run_eval(ckpt: Path, ckpt_sha256: str, plan: EvalPlan, backend: str = "hf") -> EvalResults:
    """Evaluate ``ckpt`` on ``plan`` with ``backend`` (offline: the hub is switched off)."""
    if backend not in BACKENDS:
        raise KvslimError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import torch

    torch.manual_seed(SEED)
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    model = BACKENDS[backend](ckpt, plan)
    scores = {**lm_eval_scores(model, plan), **_perplexity_scores(model, plan), **_retrieval_scores(model, plan)}
    ordered = {t: scores[t] for t in plan.tasks}
    return EvalResults(
        checkpoint=str(ckpt),
        checkpoint_sha256=ckpt_sha256,
        backend=backend,
        settings=plan.settings(auto_kv_dtype_of(ckpt, backend)),
        scores=ordered,
        seconds=time.perf_counter() - start,
        cpu_seconds=_cpu_seconds() - cpu_start,
    )
