"""Every kernel compiles for sm_90 (Hopper) on this CPU-only machine, through Triton's own
ptxas, so a kernel that only ever ran in the interpreter cannot pass."""
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

from runtime.kernels import (
    add_rms_norm,
    compile_check,
    dequant_matmul,
    gated_activation,
    kv_store,
    packed_kv_store,
    packed_paged_attention,
    paged_attention,
    rotary,
)

ROOT = Path(__file__).resolve().parents[3]


def launched_kernels(module) -> set[str]:
    """Names of the module's kernels that its wrappers launch (``name[grid](...)``)."""
    source = inspect.getsource(module)
    return {name for name in vars(module) if name.endswith("_kernel") and f"{name}[" in source}


def test_variants_cover_every_launched_kernel():
    covered = compile_check.kernel_names()
    for module in (dequant_matmul, paged_attention, kv_store, packed_kv_store, packed_paged_attention,
                   add_rms_norm, rotary, gated_activation):
        assert launched_kernels(module), module.__name__
        assert launched_kernels(module) <= covered.get(module.__name__, set()), module.__name__


def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1")  # Triton's cache is keyed on the kernel source
    out = tmp_path / "compiled.json"
    proc = subprocess.run([sys.executable, "-m", "runtime.kernels.compile_check", "--quick", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    quick = [v for v in compile_check.variants() if v.quick]
    assert [r["name"] for r in results] == [v.name for v in quick]
    assert {r["kernel"] for r in results} == {k for names in compile_check.kernel_names().values() for k in names}
    for r in results:
        assert r["ptx_target"].startswith("sm_90") and r["cubin_bytes"] > 0, r
        # would launch on an H100: registers and shared memory within the per-block limits
        assert r["registers"] <= 255 and r["shared_bytes"] <= compile_check.H100_SHARED_BYTES, r
        if "matmul" in r["kernel"] or "attention" in r["kernel"]:
            assert r["tensor_core"], f"{r['name']}: tl.dot did not lower to tensor-core mma"
