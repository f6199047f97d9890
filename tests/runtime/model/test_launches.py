"""Kernel launches per decoder layer in an eager decode step on the GPU's placement (Triton kernels,
run here by the interpreter): the fused small ops keep a layer at <= 12 (the GEMMs, two add+norms,
the queries' and the keys' rotary, the KV store, the attention and the gated activation)."""
import pytest
import torch

from runtime.device import Placement
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.model.loader import load_model
from tests.runtime.kernels.launch_counter import LaunchCounter
from tests.tiny_models import make_tiny_checkpoint

MAX_LAUNCHES_PER_LAYER = 12


def _decode_step_launches(path, kv_dtype: str) -> LaunchCounter:
    model = load_model(path, "float32", use_cpu_kernels=False, placement=Placement.resolve("cpu", "triton"))
    engine = Engine(model, EngineConfig(kv_dtype=kv_dtype, block_size=8, max_num_batched_tokens=32, max_model_len=96,
                                        kv_cache_bytes=1 << 20))
    for prompt in ([5, 6, 7, 8, 9], list(range(10, 30))):
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # the prefill
    with torch.inference_mode(), LaunchCounter() as counter:
        engine.step()  # a pure decode step of two sequences
    return counter


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the kernels through the interpreter on the CPU")
@pytest.mark.parametrize("arch,kv_dtype", [("llama", "fp32"), ("llama", "int8"), ("qwen2", "fp32")])
def test_an_eager_decode_layer_launches_at_most_12_kernels(tmp_path, arch, kv_dtype):
    """The step's launches grow by <= 12 per layer (the difference between a 2- and a 4-layer model
    is the layers' own; embedding, final norm, LM head, sampling and cos/sin are the step's)."""
    counts = {n: _decode_step_launches(make_tiny_checkpoint(tmp_path / f"{arch}{n}", arch, num_hidden_layers=n),
                                       kv_dtype) for n in (2, 4)}
    per_layer = (counts[4].total - counts[2].total) / 2
    assert per_layer <= MAX_LAUNCHES_PER_LAYER, f"{per_layer} launches per layer: {counts[4].counts.most_common()}"
    triton = {k for k in counts[4].counts if k.startswith("triton.")}
    assert {"triton.add_rms_norm_kernel", "triton.rotary_kernel", "triton.gated_activation_kernel"} <= triton
