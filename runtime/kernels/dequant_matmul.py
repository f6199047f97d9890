"""Fused dequantize + matmul over compressed-tensors weight layouts: ``y = x @ dequant(W).T``.

Weight layouts (exactly as compressed-tensors writes them, checked against
``compressed_tensors.compressors.pack_quantized``):

- ``pack-quantized`` INT4 / INT8 weight-only (W4A16, W8A16):
  ``weight_packed`` int32 ``[N, K * bits / 32]``: ``32 / bits`` values per word, lowest bits
  first, each stored as ``q + 2**(bits-1)`` (so INT4 nibbles hold ``q + 8``).
  ``weight_scale`` ``[N, K / group]`` (bf16/fp16/fp32; channel-wise is ``[N, 1]``).
  Asymmetric: ``weight_zero_point`` int32 ``[N * bits / 32, K / group]``, packed the same way
  but along the OUTPUT dimension. Act-order: ``weight_g_idx`` int ``[K]``, the group of each
  input column (otherwise column ``k`` is in group ``k // group``).
  ``W[n, k] = (q[n, k] - zp[n, g]) * scale[n, g]`` with ``g = g_idx[k]``; in stored (offset)
  values ``(u - u_zp) * scale``, and ``u_zp = 2**(bits-1)`` when symmetric.
- ``float-quantized`` FP8 (W8A16 weight-only, or W8A8 with dynamic per-token activations):
  ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` ``[N, 1]``; ``W = weight * scale``.

Activations ``x`` ``[M, K]`` bf16/fp16 (fp32 accepted, for the CPU interpreter), fp32
accumulation, output ``[M, N]`` in x's dtype. Decode (M <= 16) splits K across programs and
sums the fp32 partials; larger M uses bigger M tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundation.activation_quant import quantize_fp8_per_token
from foundation.errors import KvslimError

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DECODE_MAX_M = 16


# --------------------------------------------------------------------------- kernels
@triton.jit
def int_weight_matmul_kernel(
    x_ptr, packed_ptr, scale_ptr, zp_ptr, g_idx_ptr, out_ptr,
    M, N, K, group_size, k_per_split,
    stride_xm, stride_pn, stride_sn, stride_zn, stride_om, stride_on, stride_os,
    BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_G_IDX: tl.constexpr, TILE_IN_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), splits)``; program ``(i, j, s)`` sums
    K range ``[s * k_per_split, (s + 1) * k_per_split)`` into ``out[s, i-tile, j-tile]`` (fp32
    partials when splits > 1, else the final output in its dtype). ``TILE_IN_GROUP``: every
    K tile lies in one quantization group (no g_idx, ``group_size % BLOCK_K == 0``), so scales
    apply to the tile's dot product instead of each weight."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    BLOCK_W: tl.constexpr = BLOCK_K // PER_WORD

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    shifts = tl.arange(0, PER_WORD) * BITS
    if HAS_ZP:
        zp_shift = (offs_n % PER_WORD) * BITS

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # Packed words of the [BLOCK_K, BLOCK_N] tile of W^T, each loaded once, then split into
        # fields: k = word * PER_WORD + field, lowest bits first.
        offs_w = k0 // PER_WORD + tl.arange(0, BLOCK_W)
        words = tl.load(packed_ptr + offs_n[None, :] * stride_pn + offs_w[:, None],
                        mask=(offs_w[:, None] * PER_WORD < k_end) & n_ok[None, :], other=0)
        u = (words[:, None, :] >> shifts[None, :, None]) & MASK
        u = tl.reshape(u, (BLOCK_K, BLOCK_N))
        if TILE_IN_GROUP:
            g = k0 // group_size
            scale = tl.load(scale_ptr + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
            if HAS_ZP:
                zero = (tl.load(zp_ptr + (offs_n // PER_WORD) * stride_zn + g, mask=n_ok, other=0) >> zp_shift) & MASK
                w = u - zero[None, :]
            else:
                w = u - OFFSET
            # |w| <= 2**BITS - 1 <= 255 is exact in bf16/fp16.
            acc += tl.dot(x, w.to(x.dtype)) * scale[None, :]
        else:
            if HAS_G_IDX:
                groups = tl.load(g_idx_ptr + offs_k, mask=k_ok, other=0)
            else:
                groups = offs_k // group_size
            wk_ok = k_ok[:, None] & n_ok[None, :]
            scale = tl.load(scale_ptr + offs_n[None, :] * stride_sn + groups[:, None], mask=wk_ok, other=0.0)
            if HAS_ZP:
                zp_words = tl.load(zp_ptr + (offs_n // PER_WORD)[None, :] * stride_zn + groups[:, None],
                                   mask=wk_ok, other=0)
                zero = (zp_words >> zp_shift[None, :]) & MASK
            else:
                zero = OFFSET
            w = ((u - zero).to(tl.float32) * scale.to(tl.float32)).to(x.dtype)
            acc += tl.dot(x, w)

    out_ptrs = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def fp8_weight_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_on, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid as ``int_weight_matmul_kernel``. FP8 weight ``[N, K]`` upcast to x's dtype in
    registers; the per-channel scale is applied to the fp32 partial sums."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(x, w.to(x.dtype))

    scale = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    acc = acc * scale[None, :]
    out_ptrs = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------- launch plan
def _launch_plan(
    M: int, N: int, K: int, device: torch.device, group_size: int | None = None
) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits, k_per_split, num_warps): split K for decode until the grid
    covers the GPU about twice; plain tiles for prefill. With ``group_size`` (a multiple of
    32), BLOCK_K divides it so each K tile lies within one group; without (act-order), scales
    are gathered per weight."""
    if M <= DECODE_MAX_M:
        block_m, block_n, block_k = 16, 64, 128
    elif M <= 64:
        block_m, block_n, block_k = 64, 64, 64
    else:
        block_m, block_n, block_k = 64, 128, 64
    if group_size is not None:
        while group_size % block_k:
            block_k //= 2
    else:  # per-weight scale gathers: smaller K tiles keep registers from spilling
        block_k = min(block_k, 64)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    splits = 1
    if M <= DECODE_MAX_M:
        programs = torch.cuda.get_device_properties(device).multi_processor_count * 2 if device.type == "cuda" else 4
        splits = max(1, min(triton.cdiv(programs, tiles), triton.cdiv(K, block_k), 16))
    k_per_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    splits = triton.cdiv(K, k_per_split)
    num_warps = 8 if block_n >= 128 else 4  # sm_90 builds of these tiles use <= 255 registers, no spills
    return block_m, block_n, block_k, splits, k_per_split, num_warps


def _output(x: torch.Tensor, M: int, N: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel target [splits, M, N], final out [M, N])."""
    if splits == 1:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
        return out.unsqueeze(0), out
    partial = torch.empty((splits, M, N), device=x.device, dtype=torch.float32)
    return partial, partial


def _finish(target: torch.Tensor, splits: int, dtype: torch.dtype) -> torch.Tensor:
    return target[0] if splits == 1 else target.sum(0).to(dtype)


# --------------------------------------------------------------------------- checks
def _check_activation(x: torch.Tensor, K: int) -> None:
    if x.dim() != 2 or x.shape[1] != K:
        raise KvslimError(f"activation shape {tuple(x.shape)} does not match the weight's in_features {K}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise KvslimError(f"activation dtype {x.dtype} is not bf16/fp16/fp32")


def int_weight_shapes(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    num_bits: int,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Check a pack-quantized weight's tensors against each other; return ``(N, K, group_size)``."""
    if num_bits not in (4, 8):
        raise KvslimError(f"pack-quantized kernels support 4 or 8 bits, not {num_bits}")
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise KvslimError(f"weight_packed must be a 2-D int32 tensor, got {weight_packed.dtype} {tuple(weight_packed.shape)}")
    per_word = 32 // num_bits
    N, K = weight_packed.shape[0], weight_packed.shape[1] * per_word
    if weight_scale.dim() != 2 or weight_scale.shape[0] != N or weight_scale.dtype not in SCALE_DTYPES:
        raise KvslimError(f"weight_scale must be [{N}, groups] bf16/fp16/fp32, got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    groups = weight_scale.shape[1]
    if K % groups:
        raise KvslimError(f"weight_scale has {groups} groups, which do not divide in_features {K}")
    if weight_zero_point is not None:
        expected = (triton.cdiv(N, per_word), groups)
        if weight_zero_point.dtype != torch.int32 or tuple(weight_zero_point.shape) != expected:
            raise KvslimError(f"weight_zero_point must be int32 {list(expected)}, got {weight_zero_point.dtype} {tuple(weight_zero_point.shape)}")
    if weight_g_idx is not None and tuple(weight_g_idx.shape) != (K,):
        raise KvslimError(f"weight_g_idx must have shape [{K}], got {tuple(weight_g_idx.shape)}")
    return N, K, K // groups


def fp8_weight_shapes(weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[int, int]:
    """Check an FP8 per-channel weight; return ``(N, K)``."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise KvslimError(f"FP8 weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape
    if weight_scale.numel() not in (1, N) or weight_scale.dtype not in SCALE_DTYPES:
        raise KvslimError(f"FP8 weight_scale must hold one bf16/fp16/fp32 value per output channel ({N}) or one per tensor, got {tuple(weight_scale.shape)}")
    return N, K


def _channel_scale(weight_scale: torch.Tensor, N: int) -> torch.Tensor:
    """``[N]`` scales from a per-channel ``[N, 1]`` or per-tensor ``[1]`` FP8 weight_scale."""
    return weight_scale.reshape(-1).expand(N)


# --------------------------------------------------------------------------- wrappers (Triton)
def int_weight_matmul(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    num_bits: int,
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M, K] @ dequant(weight_packed).T -> [M, N]`` without materialising the weight."""
    N, K, group_size = int_weight_shapes(weight_packed, weight_scale, num_bits, weight_zero_point, weight_g_idx)
    _check_activation(x, K)
    x = x.contiguous()
    weight_packed, weight_scale = weight_packed.contiguous(), weight_scale.contiguous()
    zp = weight_zero_point.contiguous() if weight_zero_point is not None else weight_packed
    g_idx = weight_g_idx.to(torch.int32).contiguous() if weight_g_idx is not None else weight_packed
    M = x.shape[0]
    tile_in_group = weight_g_idx is None and group_size % 32 == 0
    block_m, block_n, block_k, splits, k_per_split, num_warps = _launch_plan(M, N, K, x.device, group_size if tile_in_group else None)
    target, _ = _output(x, M, N, splits)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), splits)
    int_weight_matmul_kernel[grid](
        x, weight_packed, weight_scale, zp, g_idx, target,
        M, N, K, group_size, k_per_split,
        x.stride(0), weight_packed.stride(0), weight_scale.stride(0), zp.stride(0),
        target.stride(1), target.stride(2), target.stride(0),
        BITS=num_bits, HAS_ZP=weight_zero_point is not None, HAS_G_IDX=weight_g_idx is not None,
        TILE_IN_GROUP=tile_in_group,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )
    return _finish(target, splits, x.dtype)


def fp8_weight_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """FP8 weight-only: ``x [M, K] @ (weight * scale).T -> [M, N]``, upcast fused in the kernel."""
    N, K = fp8_weight_shapes(weight, weight_scale)
    _check_activation(x, K)
    x, weight = x.contiguous(), weight.contiguous()
    scale = _channel_scale(weight_scale, N).contiguous()
    M = x.shape[0]
    block_m, block_n, block_k, splits, k_per_split, num_warps = _launch_plan(M, N, K, x.device)
    target, _ = _output(x, M, N, splits)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), splits)
    fp8_weight_matmul_kernel[grid](
        x, weight, scale, target, M, N, K, k_per_split,
        x.stride(0), weight.stride(0), target.stride(1), target.stride(2), target.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )
    return _finish(target, splits, x.dtype)


def fp8_w8a8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """FP8 W8A8 on Hopper: dynamic per-token activation scales, row-wise ``torch._scaled_mm``."""
    N, K = fp8_weight_shapes(weight, weight_scale)
    _check_activation(x, K)
    if x.dtype != torch.bfloat16:  # row-wise scaled_mm produces bf16 only
        raise KvslimError(f"FP8 W8A8 needs bf16 activations, got {x.dtype}")
    x_q, x_scale = quantize_fp8_per_token(x)
    w_scale = _channel_scale(weight_scale, N).float().reshape(1, N).contiguous()
    return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)


# --------------------------------------------------------------------------- references (plain torch)
def reference_unpack(packed: torch.Tensor, num_bits: int, rows: int, dim: int = 1) -> torch.Tensor:
    """Stored (offset, unsigned) values of a packed int32 tensor, ``dim`` = the packed dimension."""
    per_word = 32 // num_bits
    mask = (1 << num_bits) - 1
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int32) * num_bits
    src = packed if dim == 1 else packed.t()
    values = (src.unsqueeze(-1) >> shifts) & mask  # [R, W, per_word]
    values = values.reshape(src.shape[0], -1)[:, :rows]
    return values if dim == 1 else values.t()


def reference_dequantize_int_weight(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    num_bits: int,
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense fp32 ``W [N, K]`` from a pack-quantized weight."""
    N, K, group_size = int_weight_shapes(weight_packed, weight_scale, num_bits, weight_zero_point, weight_g_idx)
    u = reference_unpack(weight_packed, num_bits, K)
    groups = weight_g_idx.long() if weight_g_idx is not None else torch.arange(K, device=u.device) // group_size
    scale = weight_scale.float()[:, groups]
    if weight_zero_point is not None:
        zero = reference_unpack(weight_zero_point, num_bits, N, dim=0)[:, groups]
    else:
        zero = 1 << (num_bits - 1)
    return (u - zero).float() * scale


def reference_int_weight_matmul(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    num_bits: int,
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch oracle for ``int_weight_matmul`` (fp32 math, output in x's dtype)."""
    w = reference_dequantize_int_weight(weight_packed, weight_scale, num_bits, weight_zero_point, weight_g_idx)
    _check_activation(x, w.shape[1])
    return (x.float() @ w.t()).to(x.dtype)


def reference_fp8_weight_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Plain-torch oracle for ``fp8_weight_matmul``."""
    N, K = fp8_weight_shapes(weight, weight_scale)
    _check_activation(x, K)
    w = weight.float() * _channel_scale(weight_scale, N).float().reshape(N, 1)
    return (x.float() @ w.t()).to(x.dtype)


def reference_fp8_w8a8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Plain-torch oracle for ``fp8_w8a8_matmul``: same activation quantization, fp32 product."""
    N, K = fp8_weight_shapes(weight, weight_scale)
    _check_activation(x, K)
    x_q, x_scale = quantize_fp8_per_token(x)
    w = weight.float() * _channel_scale(weight_scale, N).float().reshape(N, 1)
    return ((x_q.float() * x_scale) @ w.t()).to(x.dtype)
