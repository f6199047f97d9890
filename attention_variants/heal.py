"""Healing: short distillation from the original model into a converted one.

The student (a `compress convert` output) learns to match the teacher's (the original model's)
next-token distributions, KL(teacher || student) on every position, over real text disjoint
from evaluation text (``wikipedia:heal`` by default); ``hidden_weight > 0`` adds hidden-state
matching (every decoder layer's output, relative squared error per token). By default only the
attention projections of the layers whose attention the rewrite changed are trained; everything
else stays bit-identical. Training state (trainable tensors, AdamW moments, step) is saved as safetensors
next to the output every ``save_every`` steps and on interrupt; rerunning the same command resumes.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, replace
from importlib.util import find_spec
from pathlib import Path
from typing import Callable, Literal

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from attention_variants.local_reconstruction import local_loss
from attention_variants.modeling_files import write_modeling_file
from attention_variants.self_data import SELF_DATA, teacher_continuations
from foundation.architecture import ATTENTION_PROJECTIONS
from foundation.atomic import atomic_output_dir, check_output_dir
from foundation.attention_layout import AttentionLayout
from foundation.checkpoint import Checkpoint, ShardWriter, write_config
from foundation.errors import KvslimError
from foundation.texts import DEFAULT_CALIB, DEFAULT_HEAL, RANGES, load_text

TrainMode = Literal["attn", "all", "lora"]
Clock = Literal["wall", "cpu"]
TRAIN_MODES = ("attn", "all", "lora")
OPTIMIZERS = ("adamw", "adamw8bit")
Optim = Literal["adamw", "adamw8bit"]


@dataclass(frozen=True)
class HealSpec:
    steps: int | None = None
    minutes: float | None = None  # training time budget (evaluation pauses excluded)
    # "wall": elapsed time; "cpu": process CPU time / torch threads, which other processes on the
    # cores do not inflate (on idle cores the wall time is ~1.3x that: parts of a step are serial).
    clock: Clock = "wall"
    data: str | None = None  # named range (default wikipedia:heal), a text file, or "self" (the teacher writes it)
    self_sequences: int = 256  # --data self with a --minutes budget: sequences written, then reused in turn
    train: TrainMode = "attn"
    device: str = "cpu"
    seq_len: int = 256
    batch_size: int = 4
    lr: float | None = None  # peak learning rate; None: default_lr(student, teacher)
    # "adamw": torch's (8 bytes of fp32 moments per trained parameter); "adamw8bit": bitsandbytes'
    # blockwise 8-bit moments (2 bytes; tensors under 4,096 values keep fp32 moments).
    optim: Optim = "adamw"
    warmup_steps: int = 5
    hidden_weight: float = 0.0  # weight of hidden_state_loss added to the KL (0: logits only)
    # The first ``local_steps`` steps fit each rewritten attention to the teacher's on the teacher's
    # inputs (attention_variants.local_reconstruction), the rest distil end to end.
    local_steps: int = 0
    lora_rank: int = 16
    save_every: int = 25
    seed: int = 0

    def check(self) -> None:
        """Refuse settings that cannot run, before any checkpoint is read."""
        if (self.steps is None) == (self.minutes is None):
            raise KvslimError("heal needs exactly one of --steps S or --minutes M")
        if (self.steps is not None and self.steps < 1) or (self.minutes is not None and self.minutes <= 0):
            raise KvslimError("--steps / --minutes must be positive")
        if self.seq_len < 2 or self.batch_size < 1:
            raise KvslimError("--seq-len must be at least 2 and --batch-size at least 1")
        if self.clock not in ("wall", "cpu"):
            raise KvslimError(f"clock {self.clock!r}: expected wall or cpu")
        if self.clock == "cpu" and self.device != "cpu":
            raise KvslimError(f"the CPU clock measures CPU work only; use the wall clock with --device {self.device}")
        if self.lr is not None and not 0 < self.lr < math.inf:
            raise KvslimError(f"--lr {self.lr}: must be a positive number")
        if self.hidden_weight < 0:
            raise KvslimError(f"--hidden-weight {self.hidden_weight}: must be >= 0")
        if self.data == SELF_DATA and self.self_sequences < self.batch_size:
            raise KvslimError(f"--data self: {self.self_sequences} sequences do not fill one batch of {self.batch_size}")
        if self.local_steps < 0 or (self.steps is not None and self.local_steps > self.steps):
            raise KvslimError(f"--local-steps {self.local_steps}: must be between 0 and --steps")
        if self.local_steps and self.train == "all":
            raise KvslimError("--local-steps fits the rewritten attention layers; it does not combine with --train all")
        if self.optim not in OPTIMIZERS:
            raise KvslimError(f"--optim {self.optim}: expected one of {', '.join(OPTIMIZERS)}")
        if self.optim == "adamw8bit" and find_spec("bitsandbytes") is None:
            raise KvslimError("--optim adamw8bit needs bitsandbytes: pip install bitsandbytes")
        if self.train not in TRAIN_MODES:
            raise KvslimError(f"--train {self.train}: expected one of {', '.join(TRAIN_MODES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise KvslimError("--device cuda: no CUDA device available")


@dataclass(frozen=True)
class StepReport:
    step: int
    total_steps: int | None  # None when a --minutes budget ends the run
    loss: float
    train_seconds: float  # by the spec's clock
    tokens: int
    wall_seconds: float


@dataclass(frozen=True)
class HealResult:
    out: Path
    steps: int
    tokens: int
    train_seconds: float
    first_loss: float
    last_loss: float
    resumed_from: int
    data: str
    wall_seconds: float  # of this invocation (a resumed run's earlier part not included)
    lr: float  # the peak learning rate used
    optimizer_bytes: int = 0  # the optimizer's state at the end (moments and their scales)
    local_first_loss: float = float("nan")  # the layer-local stage's loss (relative attention-output error)
    local_last_loss: float = float("nan")


def _state_dir(out: Path) -> Path:
    out = Path(out).expanduser().resolve()
    return out.with_name(f".{out.name}.heal-state")


def heal_tokens(tokenizer, data: str | None) -> tuple[str, list[int]]:
    """``(name, ids)`` of the healing text: a named heal range or a UTF-8 file (never eval text)."""
    name = data or DEFAULT_HEAL
    if name in RANGES:
        if RANGES[name].role == "eval":
            raise KvslimError(f"--data {name}: healing must not train on evaluation text; use {DEFAULT_HEAL}")
        text = load_text(name)
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise KvslimError(f"--data {name}: neither a known text range ({', '.join(RANGES)}) nor a file")
        text = path.read_text(encoding="utf-8", errors="strict")
    return name, tokenizer(text, add_special_tokens=False)["input_ids"]


def check_pair(student: Checkpoint, teacher: Checkpoint) -> None:
    """The student must be a conversion of the teacher: same model, same vocabulary, new layout."""
    s, t = student.config, teacher.config
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if s.get(key) != t.get(key):
            raise KvslimError(f"student and teacher differ in {key} ({s.get(key)} vs {t.get(key)}): "
                              "the student must be a `compress convert` output of this teacher")
    if AttentionLayout.from_config(s) == AttentionLayout.from_config(t):
        raise KvslimError("student has the teacher's attention layout: not a `compress convert` output of it")
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(student.path).get_vocab() != AutoTokenizer.from_pretrained(teacher.path).get_vocab():
        raise KvslimError("teacher's tokenizer vocabulary differs from the student's")


def rewritten_layers(student_config: dict, teacher_config: dict) -> list[int]:
    """Layers whose attention the rewrite changed (their own or as a KV supplier)."""
    s, t = AttentionLayout.from_config(student_config), AttentionLayout.from_config(teacher_config)
    suppliers = {l.kv_source for i, l in enumerate(s.layers) if l.kv_source != i}
    return [i for i in range(s.num_layers) if s.layers[i] != t.layers[i] or i in suppliers]


MERGED_KV_LR, SHARED_KV_LR = 2e-4, 5e-4


def default_lr(student_config: dict, teacher_config: dict) -> float:
    """Peak learning rate for a rewrite: 2e-4 when it merged KV heads (GQA/MQA, alone or with
    other rewrites), 5e-4 otherwise (KV sharing, sliding windows).

    Measured on the default model with calibrated MQA merges, 5 CPU-minutes each (benchmarks/results/
    heal_levers.json): MQA 36.3 at 2e-4 vs 46.9 at 5e-4, MQA + kv-share 2 100.2 vs 107.4, kv-share 2
    76.2 vs 53.8. A calibrated merge starts near a good solution that a high rate unsettles; a
    KV-sharing reader has further to move. Other merges (mean, GQA with several heads) take the
    same rate by extension, unmeasured.
    """
    s, t = AttentionLayout.from_config(student_config), AttentionLayout.from_config(teacher_config)
    merged = any(a.num_kv_heads != b.num_kv_heads for a, b in zip(s.layers, t.layers))
    return MERGED_KV_LR if merged else SHARED_KV_LR


def trainable_names(model, student_config: dict, teacher_config: dict, mode: TrainMode) -> list[str]:
    if mode == "all":
        return [n for n, _ in model.named_parameters()]
    layers = rewritten_layers(student_config, teacher_config)
    prefixes = tuple(f"model.layers.{i}.self_attn.{p}." for i in layers for p in ATTENTION_PROJECTIONS)
    return [n for n, _ in model.named_parameters() if n.startswith(prefixes)]


def _lr_factor(spec: HealSpec, step: int, seconds: float) -> float:
    """Linear warmup, then cosine decay over the run (by steps, or by time with --minutes)."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = seconds / (60 * spec.minutes) if spec.minutes else step / spec.steps
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per token, averaged."""
    t = torch.log_softmax(teacher_logits.float(), dim=-1)
    s = torch.log_softmax(student_logits.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def hidden_state_loss(student_hidden: tuple[torch.Tensor, ...], teacher_hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean over decoder-layer outputs and tokens of ``|h_s - h_t|^2 / |h_t|^2``.

    Per token relative, so the attention-sink tokens (residual norms ~10x the others) do not
    outweigh the rest. Index 0 (the embeddings, shared by both models) is skipped.
    """
    losses = []
    for s, t in zip(student_hidden[1:], teacher_hidden[1:], strict=True):
        t = t.float()
        err = (s.float() - t).pow(2).sum(-1)
        losses.append((err / t.pow(2).sum(-1).clamp_min(1e-6)).mean())
    return torch.stack(losses).mean()


def heal(
    student_dir: Path, teacher_dir: Path, spec: HealSpec, out: Path, force: bool = False,
    on_step: Callable[[StepReport, torch.nn.Module], None] | None = None,
) -> HealResult:
    """Distil ``teacher_dir`` into ``student_dir``; write the healed checkpoint to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attention_variants.summary import load_for_eval

    spec.check()
    student_ckpt, teacher_ckpt = Checkpoint.open(student_dir), Checkpoint.open(teacher_dir)
    for ckpt in (student_ckpt, teacher_ckpt):
        if ckpt.quantization_config:
            raise KvslimError(f"{ckpt.path}: heal works on unquantized checkpoints (heal first, then quantize)")
    check_pair(student_ckpt, teacher_ckpt)
    check_output_dir(Path(out), force)
    tokenizer = AutoTokenizer.from_pretrained(student_ckpt.path)
    device = torch.device(spec.device)

    def load_teacher():
        return AutoModelForCausalLM.from_pretrained(teacher_ckpt.path, dtype=torch.float32).to(device).eval()

    teacher = None
    if spec.data == SELF_DATA:
        teacher = load_teacher()
        count = spec.steps * spec.batch_size if spec.steps else spec.self_sequences
        data_name = f"self (the teacher's continuations of {DEFAULT_CALIB} prompts)"
        ids = teacher_continuations(teacher, tokenizer, count, spec.seq_len, spec.seed)
    else:
        data_name, ids = heal_tokens(tokenizer, spec.data)
    chunk = spec.seq_len * spec.batch_size
    available = len(ids) // chunk
    if spec.steps is not None and spec.steps > available:
        raise KvslimError(f"--data {data_name}: {len(ids)} tokens hold {available} steps of "
                          f"{spec.batch_size} x {spec.seq_len} tokens; {spec.steps} requested")
    if available < 1:
        raise KvslimError(f"--data {data_name}: {len(ids)} tokens, one step needs {chunk}")
    order = torch.randperm(available, generator=torch.Generator().manual_seed(spec.seed))
    batches = torch.tensor(ids[: available * chunk]).view(available, spec.batch_size, spec.seq_len)[order]

    teacher = teacher or load_teacher()  # after the data checks: a bad --data fails before any model loads
    student = load_for_eval(student_ckpt.path).to(device)
    names = trainable_names(student, student_ckpt.config, teacher_ckpt.config, spec.train)
    model, params = _prepare(student, names, spec)
    if spec.lr is None:  # resolved here, so a saved state records (and resumes with) the rate used
        spec = replace(spec, lr=default_lr(student_ckpt.config, teacher_ckpt.config))
    optimizer = make_optimizer([p for _, p in params], spec)

    state_dir = _state_dir(out)
    start, seconds, first_loss, losses = _load_state(state_dir, spec, params, optimizer)
    last_loss = losses[-1] if losses else float("nan")
    model.train()
    # A --minutes budget runs until the time is spent, going over the text again if it runs out.
    bar = tqdm(range(start, spec.steps) if spec.steps else itertools.count(start), desc="heal", initial=start,
               total=spec.steps, unit="step")
    completed = start
    wall = 0.0
    hidden = spec.hidden_weight > 0  # match hidden states too
    local_layers = rewritten_layers(student_ckpt.config, teacher_ckpt.config)
    # On a GPU the forwards run in bf16 autocast (weights and optimizer state stay fp32; the losses
    # are computed in fp32 by distill_loss / relative_error); the CPU keeps fp32 throughout.
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    local_losses: list[float] = []
    try:
        for step in bar:
            t0, c0 = time.perf_counter(), _cpu_time()
            batch = batches[step % available].to(device)
            local = step < spec.local_steps
            with autocast:
                if local:
                    loss = local_loss(model, teacher, batch, local_layers)
                else:
                    with torch.no_grad():
                        target = teacher(input_ids=batch, use_cache=False, output_hidden_states=hidden)
                    pred = model(input_ids=batch, use_cache=False, output_hidden_states=hidden)
                    loss = distill_loss(pred.logits, target.logits)
                    if hidden:
                        loss = loss + spec.hidden_weight * hidden_state_loss(pred.hidden_states, target.hidden_states)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
            for group in optimizer.param_groups:
                group["lr"] = spec.lr * _lr_factor(spec, step, seconds)
            optimizer.step()
            wall += time.perf_counter() - t0
            seconds += time.perf_counter() - t0 if spec.clock == "wall" else _cpu_time() - c0
            value = float(loss.detach())
            if local:
                local_losses.append(value)
            else:
                last_loss = value
                first_loss = last_loss if math.isnan(first_loss) else first_loss
            losses.append(value)
            bar.set_postfix(loss=f"{value:.4f}", stage="local" if local else "kl")
            completed = step + 1
            if completed % spec.save_every == 0:
                _save_state(state_dir, spec, params, optimizer, completed, seconds, first_loss, losses)
            if on_step is not None:
                model.eval()
                on_step(StepReport(completed, spec.steps, last_loss, seconds, completed * chunk, wall), model)
                model.train()
            if spec.minutes is not None and seconds >= 60 * spec.minutes:
                break
    except KeyboardInterrupt:
        _save_state(state_dir, spec, params, optimizer, completed, seconds, first_loss, losses)
        raise
    finally:
        bar.close()
    model.eval()
    _write_student(model, student_ckpt, spec, out, force)
    shutil.rmtree(state_dir, ignore_errors=True)
    local_first, local_last = (local_losses[0], local_losses[-1]) if local_losses else (float("nan"), float("nan"))
    return HealResult(Path(out), completed, completed * chunk, seconds, first_loss, last_loss, start, data_name, wall, spec.lr,
                      optimizer_state_bytes(optimizer), local_first, local_last)


def _cpu_time() -> float:
    """Process CPU seconds divided by torch's thread count."""
    return time.process_time() / torch.get_num_threads()


def _prepare(student, names: list[str], spec: HealSpec):
    """Freeze all but ``names`` (or wrap them in LoRA adapters); return (model, named params)."""
    for p in student.parameters():
        p.requires_grad_(False)
    if spec.train != "lora":
        wanted = set(names)
        params = [(n, p) for n, p in student.named_parameters() if n in wanted]
        for _, p in params:
            p.requires_grad_(True)
        return student, params
    if find_spec("peft") is None:
        raise KvslimError("--train lora needs the peft package: pip install peft")
    from peft import LoraConfig, get_peft_model

    modules = sorted({n.rsplit(".", 1)[0] for n in names})
    peft_model = get_peft_model(student, LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_rank, target_modules=modules))
    return peft_model, [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]


def make_optimizer(params: list[torch.nn.Parameter], spec: HealSpec) -> torch.optim.Optimizer:
    """AdamW (no weight decay) over ``params``: torch's, or bitsandbytes' 8-bit one."""
    if spec.optim == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=spec.lr, weight_decay=0.0)
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor the optimizer keeps per parameter (moments, their scales and maps)."""
    tensors = {v.data_ptr(): v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)}
    return sum(v.numel() * v.element_size() for v in tensors.values())


def _save_state(state_dir: Path, spec: HealSpec, params, optimizer, step: int, seconds: float,
                first_loss: float, losses: list[float]) -> None:
    tensors = {f"param.{n}": p.detach().cpu().contiguous() for n, p in params}
    for n, p in params:  # every entry of the optimizer's state (torch's and bitsandbytes' keys alike)
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{key}.{n}"] = value.detach().cpu().clone()  # bitsandbytes shares its code maps
            else:  # a Python number (bitsandbytes' step)
                tensors[f"optim_number.{key}.{n}"] = torch.tensor([value], dtype=torch.float64)
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "state.safetensors"))
    meta = dict(spec=asdict(spec), step=step, seconds=seconds, first_loss=first_loss, losses=losses)
    (tmp / "state.json").write_text(json.dumps(meta))
    shutil.rmtree(state_dir, ignore_errors=True)
    tmp.rename(state_dir)


def _load_state(state_dir: Path, spec: HealSpec, params, optimizer) -> tuple[int, float, float, list[float]]:
    """Resume from a saved state of the same run; a state of a different run is an error."""
    if not (state_dir / "state.json").is_file():
        return 0, 0.0, float("nan"), []
    meta = json.loads((state_dir / "state.json").read_text())
    if meta["spec"] != json.loads(json.dumps(asdict(spec))):
        raise KvslimError(f"{state_dir} holds a healing run with other settings; delete it to start over")
    tensors = load_file(str(state_dir / "state.safetensors"))
    with torch.no_grad():
        for n, p in params:
            p.copy_(tensors[f"param.{n}"])
            state = {}
            for name, value in tensors.items():
                kind, _, rest = name.partition(".")
                key, _, param = rest.partition(".")
                if param != n or kind not in ("optim", "optim_number"):
                    continue
                if kind == "optim":  # torch's AdamW keeps its step as a CPU tensor
                    state[key] = value if key == "step" else value.to(p.device)
                else:
                    number = float(value[0])
                    state[key] = int(number) if number.is_integer() else number
            if state:
                optimizer.state[p] = state
    return int(meta["step"]), float(meta["seconds"]), float(meta["first_loss"]), list(meta["losses"])


def _write_student(model, student_ckpt: Checkpoint, spec: HealSpec, out: Path, force: bool) -> None:
    """Write the healed weights under the student checkpoint's own tensor names."""
    if spec.train == "lora":
        model = model.merge_and_unload()
    state = model.state_dict()
    with atomic_output_dir(out, force) as tmp:
        writer = ShardWriter(tmp)
        for name in student_ckpt.names():
            dtype = student_ckpt.headers[name][0]
            tensor = state[name].detach().cpu()
            writer.add(name, tensor.to(_DTYPES[dtype]))
        writer.close()
        student_ckpt.copy_side_files(tmp)
        if "auto_map" in student_ckpt.config:
            write_modeling_file(tmp)
        write_config(tmp, student_ckpt.config)


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
