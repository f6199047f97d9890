"""One healing step's cost: layer-local reconstruction vs end-to-end KL distillation, interleaved.

    python benchmarks/heal_step_cost.py [--student out/demo/smollm2-mqa-kv2] [--repeats 3]

Both steps train the rewritten attention projections of ``--student`` (a `compress convert` output
of the default model) on the same 4 x 256 tokens of ``wikipedia:heal``: forward, loss, backward.
The kinds alternate, ``--repeats`` times each, in one process, so a shared machine slows both alike;
the ratio of the fastest of each is printed and written to
``benchmarks/results/heal_step_cost.json``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from attention_variants.heal import HealSpec, _prepare, distill_loss, rewritten_layers, trainable_names
from attention_variants.local_reconstruction import local_loss
from attention_variants.summary import load_for_eval
from foundation.checkpoint import Checkpoint
from foundation.model_source import resolve_model
from foundation.texts import load_text

RESULTS = Path(__file__).parent / "results" / "heal_step_cost.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", default="out/demo/smollm2-mqa-kv2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher_dir = resolve_model("smollm2")
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student = load_for_eval(Path(args.student))
    s_config, t_config = Checkpoint.open(args.student).config, Checkpoint.open(teacher_dir).config
    model, params = _prepare(student, trainable_names(student, s_config, t_config, "attn"), HealSpec(steps=1))
    model.train()
    layers = rewritten_layers(s_config, t_config)
    ids = AutoTokenizer.from_pretrained(teacher_dir)(load_text("wikipedia:heal")[:40000], add_special_tokens=False)["input_ids"]
    batch = torch.tensor(ids[: 4 * 256]).view(4, 256)
    seconds: dict[str, list[float]] = {"local": [], "kl": []}
    for _ in range(args.repeats):
        for kind in seconds:
            start = time.perf_counter()
            if kind == "local":
                loss = local_loss(model, teacher, batch, layers)
            else:
                with torch.no_grad():
                    target = teacher(input_ids=batch, use_cache=False).logits
                loss = distill_loss(model(input_ids=batch, use_cache=False).logits, target)
            loss.backward()
            for _, p in params:
                p.grad = None
            seconds[kind].append(time.perf_counter() - start)
    ratio = min(seconds["kl"]) / min(seconds["local"])
    result = {"student": args.student, "tokens_per_step": batch.numel(), "seconds": seconds, "kl_over_local": ratio}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"step seconds (best of {args.repeats}): local {min(seconds['local']):.2f}, KL {min(seconds['kl']):.2f}; "
          f"a local step costs 1/{ratio:.2f} of a KL step")


if __name__ == "__main__":
    main()
