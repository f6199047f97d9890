import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from foundation.atomic import atomic_output_dir
from foundation.checkpoint import Checkpoint, ShardWriter, write_config
from foundation.errors import CheckpointError, KvslimError


def _write_ckpt(d, tensors):
    d.mkdir(parents=True, exist_ok=True)
    write_config(d, {"model_type": "llama"})
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_open_reads_headers_lazily(tmp_path):
    d = _write_ckpt(tmp_path / "c", {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)})
    ck = Checkpoint.open(d)
    assert ck.headers["a"] == ("F32", (2, 3)) and ck.headers["b"] == ("BF16", (4,))
    assert torch.equal(ck.get("b"), torch.ones(4, dtype=torch.bfloat16))
    assert dict(ck.iter_tensors()).keys() == {"a", "b"}
    with pytest.raises(CheckpointError, match="missing tensor c"):
        ck.get("c")


def test_open_rejects_non_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        Checkpoint.open(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        Checkpoint.open(tmp_path / "f")
    (tmp_path / "d").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        Checkpoint.open(tmp_path / "d")


def test_open_rejects_bad_config_and_pickles(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        Checkpoint.open(d)
    (d / "config.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(CheckpointError, match="safetensors only"):
        Checkpoint.open(d)


@pytest.mark.parametrize("keep", [4, 20, -10])
def test_truncated_safetensors_is_detected(tmp_path, keep):
    d = _write_ckpt(tmp_path / "t", {"w": torch.randn(64, 64)})
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(CheckpointError, match="truncated|corrupt"):
        Checkpoint.open(d)


def test_shard_writer_splits_and_indexes(tmp_path):
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(5)}
    w = ShardWriter(tmp_path, max_shard_bytes=2 * 1024)
    for k, v in tensors.items():
        w.add(k, v)
    total = w.close()
    assert total == 5 * 1024
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    write_config(tmp_path, {"model_type": "llama"})
    ck = Checkpoint.open(tmp_path)
    for k, v in tensors.items():
        assert torch.equal(ck.get(k), v)


def test_atomic_output_dir_cleans_up_and_refuses_overwrite(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out) as tmp:
            (tmp / "x").write_text("partial")
            raise RuntimeError("boom")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with atomic_output_dir(out) as tmp:
        (tmp / "x").write_text("done")
    assert (out / "x").read_text() == "done"
    with pytest.raises(KvslimError, match="already exists"):
        with atomic_output_dir(out):
            pass
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "y").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["y"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _writer_in_progress(out):
    """A process inside ``atomic_output_dir(out)``, holding its temp dir, until killed."""
    import subprocess
    import sys

    code = ("import sys, time; from foundation.atomic import atomic_output_dir\n"
            "with atomic_output_dir(sys.argv[1]) as tmp:\n"
            "    (tmp / 'part').write_text('x'); print(tmp, flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_writers_temp_dir_is_swept_by_the_next_write(tmp_path):
    import signal

    out = tmp_path / "out"
    killed, killed_tmp = _writer_in_progress(out)
    running, running_tmp = _writer_in_progress(out)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert killed_tmp.is_dir()  # SIGKILL cannot clean up
        with atomic_output_dir(out) as tmp:
            (tmp / "x").write_text("done")
        assert not killed_tmp.exists()
        assert running_tmp.is_dir()  # another process's write in progress is left alone
    finally:
        running.kill()
        running.wait()
    assert (out / "x").read_text() == "done"


def test_side_files_carry_the_kv_plan_unless_the_attention_is_rewritten(tmp_path):
    """quantize and heal keep the layout, so the plan still holds; convert rewrites it, so the plan stays behind."""
    src = tmp_path / "src"
    _write_ckpt(src, {"w": torch.zeros(2)})
    (src / "tokenizer.json").write_text("{}")
    (src / "plan.json").write_text('{"kv_cache_dtype": "int4"}')
    ckpt = Checkpoint.open(src)
    for kv_plan in (True, False):
        out = tmp_path / f"out-{kv_plan}"
        out.mkdir()
        ckpt.copy_side_files(out, kv_plan=kv_plan)
        assert (out / "tokenizer.json").is_file() and (out / "plan.json").is_file() == kv_plan
