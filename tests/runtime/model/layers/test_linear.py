"""Quantized Linear layers against the dequantized reference, and quantized checkpoints against
transformers + compressed-tensors (or, where that cannot load them, a dense dequantized copy).

Tolerances (fixed up front): fp32 paths compute exactly the reference's math, so
max |diff| <= 1e-5 x max |ref| per layer and <= 1e-4 on logits. bf16 kernel paths round
activations, scales and accumulations to bf16: max |diff| <= 2e-2 x max |ref| per layer.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from compress.quantize import quantize_checkpoint
from foundation.checkpoint import Checkpoint
from foundation.errors import CheckpointError
from foundation.primitives import (
    compute_qparams,
    dequantize_linear,
    encode_linear,
    quantize,
)
from foundation.schemes import (
    FP8_DYNAMIC,
    FP8_W8A16,
    PRESETS,
    W4A16,
    W4A16_ASYM,
    W8A8,
    W8A16,
)
from runtime.model.layers.activation_dtype import CpuFeatures
from runtime.model.layers.linear import (
    Fp8DequantizedLinear,
    Fp8Linear,
    Int4PackLinear,
    Int8PackLinear,
    PackedIntLinear,
    W8A8Linear,
    fake_quantize_fp8_per_token,
    fake_quantize_int8_per_token,
    linear_kernels,
    make_linear,
    quantize_int8_per_token,
)
from runtime.model.loader import live_weight_bytes, load_model
from tests.runtime.hf_oracle import hf_logits, hf_model, runtime_logits, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

SCHEMES = {
    **PRESETS,
    "FP8_W8A16": FP8_W8A16,
    "W8A16_G32_ASYM": replace(W8A16, name="W8A16_ASYM", strategy="group", group_size=32, symmetric=False),
    "W4A16_CHANNEL": replace(W4A16, strategy="channel", group_size=None),
    "W4A16_G128": replace(W4A16, group_size=128),
}


def _tensors(scheme, out=64, cols=256, act_order=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g) * 0.05
    g_idx = None
    if act_order:
        g_idx = torch.randperm(cols, generator=g) // int(scheme.group_size)
        scale, zp = compute_qparams(w, scheme)  # per-group params, then columns in permuted groups
        q = quantize(w, scale, zp, scheme)
    else:
        scale, zp = compute_qparams(w, scheme)
        q = quantize(w, scale, zp, scheme)
    return encode_linear(q, scale, zp, scheme, g_idx)


def _reference(x, tensors, scheme, bias=None):
    if scheme.input_activations is not None:
        x = (fake_quantize_fp8_per_token if scheme.type == "float" else fake_quantize_int8_per_token)(x)
    return F.linear(x.float(), dequantize_linear(tensors, scheme).float(), None if bias is None else bias.float())


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_fp32_paths_equal_dequantized_reference(name):
    scheme = SCHEMES[name]
    tensors = _tensors(scheme)
    bias = torch.randn(64) * 0.1
    x = torch.randn(5, 256)
    layer = make_linear("l", {**tensors, "bias": bias}, scheme, torch.float32)
    expected = (Fp8DequantizedLinear if scheme.type == "float" else W8A8Linear if scheme.input_activations
                else PackedIntLinear)
    assert isinstance(layer, expected)
    assert _rel(layer(x), _reference(x, tensors, scheme, bias)) <= 1e-5


@pytest.mark.parametrize("name", ["FP8_DYNAMIC", "FP8_W8A16"])
def test_fp8_on_a_cpu_is_dequantized_once_and_equals_the_per_forward_path(name):
    """FP8 has no CPU GEMM: the loader's CPU choice (use_cpu_kernels) holds the weight dequantized,
    in the activation dtype (2 bytes a weight in bf16), and computes what dequantizing per forward does."""
    scheme = SCHEMES[name]
    tensors = _tensors(scheme)
    once = make_linear("l", tensors, scheme, torch.bfloat16)
    per_forward = make_linear("l", tensors, scheme, torch.bfloat16, use_cpu_kernels=False)
    assert type(once) is Fp8DequantizedLinear and type(per_forward) is Fp8Linear
    assert once.weight.dtype == torch.bfloat16 and once.weight.nbytes == 2 * tensors["weight"].nbytes
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(once(x), per_forward(x))


def test_act_order_path_equals_reference():
    scheme = W4A16
    tensors = _tensors(scheme, act_order=True)
    x = torch.randn(3, 256)
    layer = make_linear("l", tensors, scheme, torch.bfloat16)
    assert isinstance(layer, PackedIntLinear)  # the CPU kernels have no g_idx: dequantize path
    assert _rel(layer(x.bfloat16()), _reference(x.bfloat16(), tensors, scheme)) <= 2e-2


@pytest.mark.parametrize("name,cls", [
    ("W4A16", Int4PackLinear), ("W4A16_ASYM", Int4PackLinear), ("W4A16_CHANNEL", Int4PackLinear),  # one group of 256 columns
    ("W4A16_G128", Int4PackLinear), ("W8A16", Int8PackLinear), ("W8A16_G32_ASYM", PackedIntLinear),
    ("FP8_DYNAMIC", Fp8DequantizedLinear), ("W8A8", W8A8Linear),
])
def test_bf16_kernel_paths_close_to_dequantized_reference(name, cls):
    scheme = SCHEMES[name]
    tensors = _tensors(scheme)
    bias = torch.randn(64) * 0.1
    layer = make_linear("l", {**tensors, "bias": bias}, scheme, torch.bfloat16)
    assert type(layer) is cls
    for rows in (1, 7):
        x = torch.randn(rows, 256).bfloat16()
        ref = _reference(x, tensors, scheme, bias)
        assert _rel(layer(x), ref) <= 2e-2
    # the kernel's weights are the checkpoint's, not a re-quantization
    assert _rel(layer.dequantized_weight(), dequantize_linear(tensors, scheme)) <= 1e-2


def test_fp8_activation_quantization_is_per_token():
    x = torch.randn(4, 64) * torch.tensor([[1.0], [10.0], [100.0], [0.0]])
    y = fake_quantize_fp8_per_token(x)
    assert torch.equal(y[3], x[3])  # an all-zero row stays zero
    rel = (y - x).abs().amax(-1)[:3] / x.abs().amax(-1)[:3]
    assert (rel <= 2**-3).all() and (rel > 0).all()  # E4M3 has 3 mantissa bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activation_quantization_is_compressed_tensors(dtype):
    """Bit-equal to compressed-tensors' dynamic per-token INT8 fake quantization (3-D input: its
    token strategy keeps dims 0 and 1), including an all-zero token."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    args = preset_name_to_scheme("W8A8", ["Linear"]).input_activations
    from compressed_tensors.quantization import QuantizationStatus

    module = torch.nn.Linear(64, 8)
    module.quantization_status = QuantizationStatus.FROZEN
    x = (torch.randn(2, 5, 64) * torch.tensor([1.0, 10.0, 1e-3, 0.0, 300.0])[None, :, None]).to(dtype)
    theirs = forward_quantize(module, x, "input", args)
    assert torch.equal(fake_quantize_int8_per_token(x), theirs)
    q, scale = quantize_int8_per_token(x)
    assert q.dtype == torch.int8 and scale.dtype == dtype and scale.shape == (2, 5, 1)
    assert int(q.max()) == 127 and int(q.min()) >= -128 and not q[:, 3].any()


@pytest.mark.parametrize("rows,cols,out", [(1, 256, 64), (7, 256, 64), (33, 24, 40), (5, 13, 7)])
def test_w8a8_int_mm_equals_fake_quant_reference(rows, cols, out):
    """``torch._int_mm`` (int32 accumulation, then token x channel scales) against the plain-torch
    reference (fake-quantized activations times the dequantized weight), odd shapes included; the
    non-int_mm fallback too. fp32: only summation order differs."""
    tensors = _tensors(W8A8, out=out, cols=cols, seed=rows)
    bias = torch.randn(out) * 0.1
    fast = make_linear("l", {**tensors, "bias": bias}, W8A8, torch.float32)
    slow = make_linear("l", {**tensors, "bias": bias}, W8A8, torch.float32, use_cpu_kernels=False)
    assert fast.use_int_mm and not slow.use_int_mm
    x = torch.randn(2, rows, cols)
    ref = _reference(x, tensors, W8A8, bias)
    assert _rel(slow(x), ref) <= 1e-5
    assert _rel(fast(x), ref) <= 1e-5
    assert fast(x).shape == (2, rows, out)
    import runtime.model.layers.linear as linear_module

    original = linear_module.int8_matmul
    linear_module.int8_matmul = lambda *_: None
    try:
        assert _rel(fast(x), ref) <= 1e-5
    finally:
        linear_module.int8_matmul = original


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 16, 17, 40])
def test_int8_matmul_on_cuda_pads_small_batches(rows):
    from runtime.model.layers.linear import int8_matmul

    q = torch.randint(-128, 128, (rows, 64), dtype=torch.int8, device="cuda")
    w = torch.randint(-128, 128, (48, 64), dtype=torch.int8, device="cuda")
    acc = int8_matmul(q, w)
    assert acc is not None and acc.shape == (rows, 48) and acc.dtype == torch.int32
    assert torch.equal(acc.cpu(), q.cpu().long() @ w.cpu().long().t())
    assert int8_matmul(q[:, :60], w[:, :60]) is None  # K not a multiple of 8


def test_mismatched_tensors_are_refused():
    tensors = _tensors(W4A16)
    with pytest.raises(ValueError, match="weight_scale"):
        make_linear("model.x", {k: v for k, v in tensors.items() if k != "weight_scale"}, W4A16, torch.float32)
    with pytest.raises(ValueError, match="floating-point weight"):
        make_linear("model.x", {"weight": torch.zeros(4, 4, dtype=torch.int8)}, None, torch.float32)
    with pytest.raises(ValueError, match="FP8"):
        make_linear("model.x", {"weight": torch.zeros(4, 4), "weight_scale": torch.ones(4, 1)}, FP8_DYNAMIC, torch.float32)
    with pytest.raises(ValueError, match="declares int8"):
        make_linear("model.x", {"weight": torch.zeros(4, 4), "weight_scale": torch.ones(4, 1)}, W8A8, torch.float32)


# --- whole quantized checkpoints -------------------------------------------------------------
@pytest.fixture(scope="module")
def quantized(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {name: quantize_checkpoint(tiny_checkpoints["llama"], root / name, s, progress=False).out
           for name, s in {**PRESETS, "FP8_W8A16": FP8_W8A16}.items()}
    torch.set_num_threads(before)
    return out


def _dense_copy(path, out):
    """The dequantized reference: the same checkpoint with every Linear dequantized to fp32."""
    ckpt = Checkpoint.open(path)
    from runtime.model.spec import ModelSpec

    spec = ModelSpec.from_config(ckpt.config)
    weights, groups = {}, {}
    for name, t in ckpt.iter_tensors():
        module, _, leaf = name.rpartition(".")
        if leaf.startswith("weight_"):
            groups.setdefault(module, {})[leaf] = t
        else:
            weights[name] = t
    for module, tensors in groups.items():
        weights[module + ".weight"] = dequantize_linear(tensors, spec.quant.scheme_for(module)).float()
    out.mkdir()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = dict(ckpt.config)
    del config["quantization_config"]
    (out / "config.json").write_text(__import__("json").dumps(config))
    return out


@pytest.mark.parametrize("name", ["FP8_DYNAMIC", "FP8_W8A16", "W8A16", "W4A16"])
def test_quantized_checkpoint_matches_transformers_compressed_tensors(quantized, name):
    """transformers + compressed-tensors decompress the checkpoint (and, for FP8_DYNAMIC and W8A8,
    fake-quantize activations per token): the fp32 runtime (W8A8: through torch._int_mm) equals it."""
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(hf_model(quantized[name]), ids)
    got = runtime_logits(load_model(quantized[name], "float32"), ids, (10,))
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["W8A16", "W4A16"])
def test_bf16_stored_checkpoint_matches_transformers(tiny_checkpoints, tmp_path, name):
    """A checkpoint quantized with ``dtype=bfloat16`` (bf16 scales, embeddings and norms from an
    fp32 source), run at fp32: equal to transformers decompressing it with compressed-tensors'
    own decompressor (``dequantize=True``: q * scale in the scale's dtype, bf16), the same
    tolerance as the fp32-stored checkpoints. (transformers' default route multiplies by the scale
    after widening it to fp32, so at fp32 it differs by one bf16 rounding of each weight.)"""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    path = quantize_checkpoint(tiny_checkpoints["llama"], tmp_path / name, PRESETS[name], progress=False,
                               dtype=torch.bfloat16).out
    hf = AutoModelForCausalLM.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True),
                                              dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(4))
    got = runtime_logits(load_model(path, "float32"), ids, (10,))
    assert (got - hf_logits(hf, ids)).abs().max().item() <= 1e-4


def test_asymmetric_int4_checkpoint_matches_dequantized_reference(quantized, tmp_path):
    # transformers 5.23 cannot load packed asymmetric zero points (size mismatch), so the oracle
    # is a dense copy holding dequantize_linear's weights, run by transformers.
    dense = _dense_copy(quantized["W4A16_ASYM"], tmp_path / "dense")
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf_model(dense), ids)
    got = runtime_logits(load_model(quantized["W4A16_ASYM"], "float32"), ids, (10,))
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["W4A16", "W4A16_ASYM", "W8A16"])
def test_bf16_cpu_kernels_close_to_dequantize_path(quantized, name):
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3))
    fast = runtime_logits(load_model(quantized[name], "bfloat16"), ids, (10,))
    slow = runtime_logits(load_model(quantized[name], "bfloat16", use_cpu_kernels=False), ids, (10,))
    ref = runtime_logits(load_model(quantized[name], "float32"), ids, (10,))
    assert (fast - ref).abs().max().item() <= 0.15
    assert (slow - ref).abs().max().item() <= 0.15


@pytest.mark.parametrize("name", ["FP8_DYNAMIC", "W8A8"])
def test_bf16_dynamic_activations_no_worse_than_transformers_bf16(quantized, name):
    """Per-token FP8 / INT8 activations amplify bf16 rounding (a value moving across an E4M3
    rounding boundary moves by up to 1/16; an INT8 one by a step), so the bound is relative: our
    bf16 logits are no further from the fp32 reference than transformers + compressed-tensors'
    own bf16 logits (x 1.5)."""
    path = quantized[name]
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3))
    ref = hf_logits(hf_model(path), ids)
    theirs = (hf_logits(hf_model(path, torch.bfloat16), ids) - ref).abs().max().item()
    ours = (runtime_logits(load_model(path, "bfloat16"), ids, (10,)) - ref).abs().max().item()
    assert ours <= 1.5 * theirs, (ours, theirs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted([*PRESETS, "FP8_W8A16"]))
def test_weights_stay_compressed_in_memory(quantized, name, dtype):
    """Resident bytes (live tensors) within 10% of the packed checkpoint's bytes, with the
    unquantized tensors (embeddings, norms, lm_head) counted at the runtime dtype. FP8 on a CPU is
    the exception, by choice: dequantized once at load, it is resident in the runtime dtype."""
    ckpt = Checkpoint.open(quantized[name])
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    expected = 0
    for n, t in ckpt.iter_tensors():
        packed = n.rsplit(".", 1)[-1].startswith("weight_") or t.dtype == torch.int8
        expected += t.numel() * (t.element_size() if packed else elem)
    resident = live_weight_bytes(load_model(quantized[name], dtype))
    assert abs(resident - expected) <= 0.10 * expected, (resident, expected)


def test_converted_then_quantized_matches_dequantized_reference(tiny_checkpoints, tmp_path):
    """Stages compose: KV sharing + hybrid window (convert), then INT4 (quantize); the oracle is
    the modeling file run on the dequantized weights."""
    from attention_variants.convert import ConvertSpec, convert

    converted = convert(tiny_checkpoints["llama"], ConvertSpec(kv_share=2, merge="mean", sliding_window=8,
                                                                 global_every=4), tmp_path / "conv").out
    quant = quantize_checkpoint(converted, tmp_path / "q", W4A16_ASYM, progress=False).out
    dense = _dense_copy(quant, tmp_path / "dense")
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(4))
    ref = hf_logits(hf_model(dense, ours=True), ids)
    got = runtime_logits(load_model(quant, "float32"), ids, (10,))
    assert (got - ref).abs().max().item() <= 1e-4



# compressed-tensors' INT8 scale is amax / 127.5, so a token's most negative value lands on
# -127.5, a rounding tie: a 1e-7 difference upstream (summation order) moves it between -127 and
# -128, and attention carries that one-step change to every later position. Whole-model W8A8
# logits are therefore bounded relative to the logit range (fixed before measuring); the exact
# check is per layer, on the same inputs.
W8A8_LOGITS_REL = 5e-2
VNNI_CPU = CpuFeatures(avx2=True, avx512=True, vnni=True, avx512_bf16=False, amx=False)


def _w8a8_logits_close(got, ref):
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= W8A8_LOGITS_REL * scale
    assert (got - ref).abs().mean().item() <= W8A8_LOGITS_REL / 5 * scale


def test_w8a8_int_mm_checkpoint_equals_reference_path(quantized):
    """The whole tiny W8A8 model (fused q/k/v and gate/up): every int_mm Linear equals the
    fake-quant + dequantized-weight reference on the activations it actually sees; logits are
    close to the reference path's."""
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(5))
    path = quantized["W8A8"]
    model = load_model(path, "float32", cpu_features=VNNI_CPU)
    assert isinstance(model.layers[0].self_attn.qkv_proj.linear, W8A8Linear)
    assert linear_kernels(model) == {"torch._int_mm (INT8 GEMM)": 4 * 4, "dense GEMM": 1}
    checked = []

    def same_input_check(module, inputs, output):
        module.use_int_mm = False
        ref = W8A8Linear.forward(module, inputs[0])  # not module(): that would re-enter this hook
        module.use_int_mm = True
        checked.append(_rel(output, ref))

    hooks = [m.register_forward_hook(same_input_check) for m in model.modules() if isinstance(m, W8A8Linear)]
    fast = runtime_logits(model, ids, (10,))
    for h in hooks:
        h.remove()
    assert len(checked) == 4 * 4 * (1 + 14) and max(checked) <= 1e-5
    slow = runtime_logits(load_model(path, "float32", use_cpu_kernels=False), ids, (10,))
    _w8a8_logits_close(fast, slow)


def test_w8a8_checkpoint_close_to_transformers_compressed_tensors(quantized):
    """transformers + compressed-tensors (default route: decompressed weights, activations
    fake-quantized per token by compressed-tensors itself) against our torch._int_mm runtime."""
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(hf_model(quantized["W8A8"]), ids)
    _w8a8_logits_close(runtime_logits(load_model(quantized["W8A8"], "float32"), ids, (10,)), ref)


@pytest.mark.parametrize("scheme", [FP8_DYNAMIC, W8A8], ids=lambda s: s.name)
def test_per_channel_scale_of_the_wrong_size_is_a_checkpoint_error(scheme):
    tensors = _tensors(scheme, out=64)
    tensors["weight_scale"] = tensors["weight_scale"][:32]
    with pytest.raises(CheckpointError, match="weight_scale has 32 values"):
        make_linear("q_proj", tensors, scheme, torch.float32)
