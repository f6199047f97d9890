"""`compress quantize` as a plan: every check first, then each pass once.

``plan_quantization(options)`` resolves the source and opens and checks it, plans the Linears to
quantize, checks the output directory, refuses every flag combination that cannot run and
tokenizes the calibration text: each once, before any calibration pass or output. ``run_plan``
then smooths, calibrates (GPTQ Hessians, KV-cache scales), quantizes and tunes the scales, every
calibrated pass on the same windows, and publishes the output.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from compress.algorithms.gptq import GPTQOptions, default_options, with_act_order
from compress.quantize import QuantizeResult, open_source, plan_linears, quantize_checkpoint
from compress.quantize_options import DEFAULT_IGNORE, QuantizeOptions
from compress.scale_tuning import ScaleTuningSpec, check_tunable
from compress.smoothing_spec import SmoothingSpec
from foundation.atomic import check_output_dir
from foundation.calibration import CalibrationSpec, CalibrationTextTooShort, calibration_ids, check_ids_in_vocab
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError
from foundation.model_source import resolve_model
from foundation.schemes import QuantScheme, default_scheme

_OUTPUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class QuantizePlan:
    """A checked `compress quantize` request: what each pass will do, and on what."""

    options: QuantizeOptions
    source: Path  # the checkpoint directory the model argument names
    checkpoint: Checkpoint  # ``source`` opened and checked
    out: Path  # resolved; allowed by ``check_output_dir``
    scheme: QuantScheme  # as recorded in the output (GPTQ's activation ordering included)
    ignore: tuple[str, ...]
    linears: tuple[str, ...]  # weight names of the Linears to quantize
    dtype: torch.dtype | None  # cast of the floating-point tensors; None: the source's own
    calibration: CalibrationSpec | None  # None: no pass calibrates
    calib_ids: torch.Tensor | None  # its windows [num_samples, seq_len], shared by every pass
    smoothing: SmoothingSpec | None
    gptq: GPTQOptions | None  # --method gptq
    tuning: ScaleTuningSpec | None

    @property
    def calibrates_quantizer(self) -> bool:
        """Whether the quantizer streams the calibration windows (GPTQ Hessians, KV-cache scales)."""
        return self.gptq is not None or self.options.kv_cache_fp8

    def describe_calibration(self) -> str:
        """The quantizer's calibration, one line; "" when it has none."""
        if not self.calibrates_quantizer:
            return ""
        what = ["GPTQ" if self.gptq else "", "FP8 KV-cache scales" if self.options.kv_cache_fp8 else ""]
        note = f"calibration ({' + '.join(w for w in what if w)}): {self.calibration.describe()}"
        if self.gptq is not None:
            note += (f", dampening {self.gptq.dampening}" + (", act-order" if self.gptq.act_order else "")
                     + f", {self.gptq.observer} observer")
        if self.scheme.input_activations is not None:
            note += f"; inputs as served ({self.scheme.input_activations.describe()})"
        return note


@dataclass(frozen=True)
class PlanResult:
    """What ``run_plan`` wrote, with one line per optional pass ("" when it did not run)."""

    result: QuantizeResult
    smoothing: str
    calibration: str
    tuning: str
    tied_lm_head: bool = False  # the source tied its lm_head to the embedding


def plan_quantization(options: QuantizeOptions) -> QuantizePlan:
    """Check ``options`` against the source and the output directory; refuse anything that cannot
    run before any calibration pass or output, and tokenize the calibration text."""
    scheme = default_scheme(options.kind).with_options(group_size=options.group_size, symmetric=options.symmetric)
    source = resolve_model(options.model)
    checkpoint = open_source(source)  # a damaged source is refused before calibration or any output
    ignore = tuple(dict.fromkeys(DEFAULT_IGNORE if options.ignore is None else options.ignore))
    if options.lm_head is not None and "lm_head" not in ignore:
        raise KvslimError("--lm-head gives lm_head its own scheme; do not also target it (keep lm_head in --ignore)")
    out = Path(options.output).expanduser().resolve()
    check_output_dir(out, options.force)
    linears = tuple(plan_linears(checkpoint, scheme, ignore))
    smoothing = _smoothing(options, scheme)
    if options.method != "gptq" and options.gptq_flags:
        raise KvslimError(f"{options.gptq_flags[0]} is a GPTQ option; add --method gptq")
    if options.calibration_flags and not options.calibrates:
        raise KvslimError(f"{options.calibration_flags[0]} needs calibration: add --method gptq, --kv-cache-fp8, "
                          "--smooth or --tune-scales-steps")
    calibration = options.calibration() if options.calibrates else None
    if calibration is not None:
        calibration.check()
    tuning = None
    if options.tune_scales_steps is not None:
        tuning = ScaleTuningSpec(options.tune_scales_steps)
        check_tunable(scheme)
    gptq = _gptq_options(options, scheme)
    dtype = _output_dtype(options.dtype)
    calib_ids = None if calibration is None else _windows(checkpoint, calibration)
    if gptq is not None and gptq.act_order:
        scheme = with_act_order(scheme)
    return QuantizePlan(options, source, checkpoint, out, scheme, ignore, linears, dtype, calibration, calib_ids,
                        smoothing, gptq, tuning)


def run_plan(plan: QuantizePlan) -> PlanResult:
    """Run the passes ``plan`` holds and write its output."""
    options = plan.options
    source: Checkpoint = plan.checkpoint
    smoothing = ""
    if plan.smoothing is not None:
        from compress.smoothing import smooth_checkpoint

        source, report = smooth_checkpoint(plan.checkpoint, plan.calib_ids, plan.smoothing)
        smoothing = f"smoothing: {report.describe()}, on {plan.calibration.describe()}"
    quantizer, kv_cache_scheme = None, None
    if plan.calibrates_quantizer:
        from compress import sequential_quantizer
        from compress.kv_scales import KV_CACHE_SCHEME

        # The scheme's activation quantization (FP8_DYNAMIC, W8A8) is applied while calibrating, as served.
        quantizer = sequential_quantizer.windows_quantizer(
            source, options.method, plan.calib_ids, plan.gptq, kv_cache_fp8=options.kv_cache_fp8,
            activations=plan.scheme.input_activations)
        kv_cache_scheme = KV_CACHE_SCHEME if options.kv_cache_fp8 else None
    tunings: list[str] = []
    finish = None
    if plan.tuning is not None:
        from compress.scale_tuning import tune_scales

        def finish(tmp: Path) -> None:
            report = tune_scales(plan.source, tmp, plan.calib_ids, plan.tuning, progress=options.progress)
            tunings.append(f"{report.describe()}; on {plan.calibration.describe()}")

    result = quantize_checkpoint(source, plan.out, plan.scheme, ignore=plan.ignore, quantizer=quantizer,
                                 force=options.force, progress=options.progress, kv_cache_scheme=kv_cache_scheme,
                                 dtype=plan.dtype, finish=finish, linears=plan.linears, lm_head=options.lm_head)
    return PlanResult(result, smoothing, plan.describe_calibration(), tunings[0] if tunings else "",
                      bool(plan.checkpoint.config.get("tie_word_embeddings", False)))


def _smoothing(options: QuantizeOptions, scheme: QuantScheme) -> SmoothingSpec | None:
    if options.smooth is None:
        return None
    spec = SmoothingSpec(options.smooth)
    spec.check()
    if scheme.input_activations is None:
        raise KvslimError(f"--smooth moves activation outliers into the weights; {scheme.name} keeps "
                          "activations unquantized (use --w8a8 or --fp8)")
    return spec


def _gptq_options(options: QuantizeOptions, scheme: QuantScheme) -> GPTQOptions | None:
    """GPTQ's options for --method gptq: unset flags take ``default_options(scheme)``."""
    if options.method != "gptq":
        return None
    defaults = default_options(scheme)
    return replace(defaults,
                   dampening=defaults.dampening if options.dampening is None else options.dampening,
                   act_order=defaults.act_order if options.act_order is None else options.act_order,
                   observer=options.observer or defaults.observer)


def _output_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _OUTPUT_DTYPES:
        raise KvslimError(f"--dtype {name}: expected one of {', '.join(_OUTPUT_DTYPES)}")
    return _OUTPUT_DTYPES[name]


def _windows(checkpoint: Checkpoint, calibration: CalibrationSpec) -> torch.Tensor:
    """The calibration windows, tokenized once for every calibrated pass."""
    try:
        ids = calibration_ids(checkpoint.path, calibration)
    except CalibrationTextTooShort as e:
        raise KvslimError(f"{e} (lower --num-calib-samples or --calib-seq-len)") from None
    check_ids_in_vocab(ids, checkpoint.config, checkpoint.path)
    return ids
