"""Checkpoints: exact round trips, corruption and mismatch detection, crash safety, export."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lazytrain.errors import CheckpointError, ResourceError
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.checkpoint import restore_rng, save_checkpoint
from lazytrain.train.checkpoint_load import holds_checkpoints, load_latest
from lazytrain.train.export import export_hf

FP = "fp-model-a"


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so -0.0 vs 0.0 and NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def trained_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save(root: Path, step: int, fingerprint: str = FP, **kw) -> Path:
    kw.setdefault("model_state", {"w": torch.full((2, 2), float(step))})
    kw.setdefault("optimizer_state", {"state": {}, "param_groups": []})
    kw.setdefault("extra", {"data": {"epoch": 0, "row": step}})
    return save_checkpoint(root, step, fingerprint=fingerprint, **kw)


# --------------------------------------------------------------------------- round trip


def test_round_trip_is_bit_identical(tmp_path):
    base = torch.randn(6, 4)
    base[0, 0] = -0.0
    base[0, 1] = float("nan")
    model_state = {
        "embed.weight": base,
        "head.weight": base,  # tied: the same storage under two names
        "proj.weight": base.t(),  # a non-contiguous view of it
        "half": torch.randn(3, 5).to(torch.bfloat16),
        "count": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
    }
    _, opt = trained_optimizer()
    extra = {"data": {"epoch": 1, "row": 17}, "scheduler": {"last_epoch": 9, "lr": [0.5]}}
    path = save_checkpoint(
        tmp_path, 12, model_state=model_state, optimizer_state=opt.state_dict(), extra=extra,
        fingerprint=FP,
    )
    assert path == tmp_path / "step-00000012"
    assert (tmp_path / "LATEST").read_text() == "step-00000012\n"
    assert sorted(p.name for p in path.iterdir()) == [
        "meta.json", "model.safetensors", "optimizer.pt", "rng.pt",
    ]

    got = load_latest(tmp_path, FP)
    assert got.step == 12 and got.extra == extra and got.path == path
    assert list(got.model_state) == list(model_state)  # meaningful order for load_state_dict
    for name, tensor in model_state.items():
        assert bits_equal(got.model_state[name], tensor), name
    assert base.data_ptr() == model_state["head.weight"].data_ptr()  # caller's dict untouched

    want = opt.state_dict()
    assert got.optimizer_state["param_groups"] == want["param_groups"]
    for index, state in want["state"].items():
        for key, value in state.items():
            assert bits_equal(got.optimizer_state["state"][index][key], value)
    _, fresh = trained_optimizer()
    fresh.load_state_dict(got.optimizer_state)  # it is a valid optimizer state


def test_tied_weights_of_a_transformers_model_round_trip(tmp_path, qwen):
    state = qwen.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    save(tmp_path, 1, model_state=state)
    got = load_latest(tmp_path, FP).model_state
    assert all(bits_equal(got[k], v) for k, v in state.items())


def test_rng_states_are_restored(tmp_path):
    torch.manual_seed(123)
    random.seed(456)
    save(tmp_path, 3)
    want = (torch.rand(4), random.random())
    torch.manual_seed(999)
    random.seed(999)
    restore_rng(load_latest(tmp_path, FP))
    got = (torch.rand(4), random.random())
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_no_checkpoint_yields_none(tmp_path):
    assert load_latest(tmp_path / "absent", FP) is None
    assert load_latest(tmp_path, FP) is None
    (tmp_path / ".tmp-step-00000001-abc").mkdir()  # only an interrupted first save
    assert load_latest(tmp_path, FP) is None


def test_extra_must_survive_json(tmp_path):
    with pytest.raises(CheckpointError, match="extra is not JSON-serialisable"):
        save(tmp_path, 1, extra={"t": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="extra changes in a JSON round trip"):
        save(tmp_path, 1, extra={"betas": (0.9, 0.95)})
    with pytest.raises(CheckpointError, match="extra changes in a JSON round trip"):
        save(tmp_path, 1, extra={1: "int key"})
    assert not any(tmp_path.iterdir())  # refused before touching the disk


# --------------------------------------------------------------------------- corruption


def test_corrupt_weights_are_detected(tmp_path):
    save(tmp_path, 1)
    path = save(tmp_path, 12)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (path / "model.safetensors").write_bytes(bytes(data))
    message = (
        r"checkpoint .*step-00000012 is corrupt: model\.safetensors sha256 mismatch; "
        r"delete it .*to resume from the previous one"
    )
    with pytest.raises(CheckpointError, match=message):
        load_latest(tmp_path, FP)
    # Following the advice resumes from the previous checkpoint.
    shutil.rmtree(path)
    (tmp_path / "LATEST").unlink()
    assert load_latest(tmp_path, FP).step == 1


def test_missing_file_and_tampered_meta_are_detected(tmp_path):
    path = save(tmp_path, 2)
    (path / "optimizer.pt").unlink()
    missing = r"step-00000002 is corrupt: optimizer\.pt is missing"
    with pytest.raises(CheckpointError, match=missing):
        load_latest(tmp_path, FP)

    path = save(tmp_path / "b", 2)
    meta = json.loads((path / "meta.json").read_text())
    meta["extra"]["data"]["row"] = 99
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"is corrupt: meta\.json digest mismatch"):
        load_latest(tmp_path / "b", FP)

    path = save(tmp_path / "c", 2)
    (path / "meta.json").write_text('{"step": 2, "fin')
    with pytest.raises(CheckpointError, match=r"is corrupt: meta\.json cannot be read"):
        load_latest(tmp_path / "c", FP)


def test_step_must_match_directory_name(tmp_path):
    path = save(tmp_path, 2)
    path.rename(tmp_path / "step-00000003")
    (tmp_path / "LATEST").write_text("step-00000003\n")
    with pytest.raises(CheckpointError, match="meta.json says step 2 but the directory is step 3"):
        load_latest(tmp_path, FP)


def test_fingerprint_mismatch(tmp_path):
    save(tmp_path, 5, fingerprint="abc123")
    message = r"step-00000005 was written for model fingerprint abc123, this run is def456"
    with pytest.raises(CheckpointError, match=message):
        load_latest(tmp_path, "def456")


def test_latest_naming_a_missing_or_corrupt_dir_is_reported_not_skipped(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / "LATEST").write_text("step-00000007\n")
    with pytest.raises(CheckpointError, match=r"LATEST names step-00000007, but .* does not exist"):
        load_latest(tmp_path, FP)
    (tmp_path / "LATEST").write_text("garbage\n")
    with pytest.raises(CheckpointError, match=r"LATEST is corrupt: it holds 'garbage'"):
        load_latest(tmp_path, FP)
    (tmp_path / "LATEST").unlink()  # no LATEST at all: the newest complete directory
    assert load_latest(tmp_path, FP).step == 2


# --------------------------------------------------------------------------- crash safety


def test_leftover_temp_dir_is_ignored_and_cleaned(tmp_path):
    save(tmp_path, 1)
    leftover = tmp_path / ".tmp-step-00000002-x1y2"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half a file")
    got = load_latest(tmp_path, FP)
    assert got.step == 1
    save(tmp_path, 2)
    assert not leftover.exists()
    assert load_latest(tmp_path, FP).step == 2


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    save(tmp_path, 1)

    def boom():
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_capture_rng", boom)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000001"]
    assert load_latest(tmp_path, FP).step == 1


def test_enospc_in_a_save_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """An OSError(ENOSPC) from the writer: a ResourceError naming the checkpoint and the space it
    needs; the temp directory is gone and the previous checkpoint stays the latest."""
    save(tmp_path, 1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(ResourceError, match=re.escape(f"no space left on the disk to write {tmp_path / 'step-00000002'}: "
                                                      "it needs about ")) as info:
        save(tmp_path, 2)
    assert f"the previous checkpoint ({tmp_path / 'LATEST'}) is intact" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000001"]
    assert load_latest(tmp_path, FP).step == 1


def test_torch_save_unexpected_pos_on_a_full_disk(tmp_path, monkeypatch):
    """torch.save loses the errno ("unexpected pos"): the free space after the failure decides."""
    left = {"bytes": 1 << 40}

    def full(*args, **kwargs):
        left["bytes"] = 10
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")

    monkeypatch.setattr(ckpt, "free_bytes", lambda path: left["bytes"])
    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(ResourceError, match="no space left on the disk"):
        save(tmp_path, 1)
    assert list(tmp_path.iterdir()) == []


def test_a_save_that_cannot_fit_writes_nothing(tmp_path, monkeypatch):
    save(tmp_path, 1)
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 100)
    with pytest.raises(ResourceError, match="it needs about 64.1 KiB"):
        save(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000001"]


def test_a_failed_latest_write_leaves_no_temp_file(tmp_path, monkeypatch):
    save(tmp_path, 1)
    real = os.replace

    def replace(src, dst):
        if "LATEST" in str(src):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)
    with pytest.raises(ResourceError, match="still names the previous checkpoint"):
        save(tmp_path, 2)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert load_latest(tmp_path, FP).step == 1


def test_holds_checkpoints_without_latest(tmp_path):
    assert not holds_checkpoints(tmp_path) and not holds_checkpoints(tmp_path / "nope")
    save(tmp_path, 3)
    (tmp_path / "LATEST").unlink()
    assert holds_checkpoints(tmp_path)
    assert load_latest(tmp_path, FP).step == 3


def test_a_complete_dir_not_yet_in_latest_is_replaced(tmp_path):
    # A kill between the directory rename and the LATEST update leaves step 2 on disk while
    # LATEST names step 1; the resumed run redoes step 2 and must be able to save it.
    save(tmp_path, 1)
    save(tmp_path, 2, extra={"data": {"old": True}})
    (tmp_path / "LATEST").write_text("step-00000001\n")
    assert load_latest(tmp_path, FP).step == 1
    save(tmp_path, 2, extra={"data": {"old": False}})
    assert load_latest(tmp_path, FP).extra == {"data": {"old": False}}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_resaving_the_latest_step_is_refused(tmp_path):
    save(tmp_path, 4)
    with pytest.raises(CheckpointError, match="step-00000004 already exists and .*LATEST names it"):
        save(tmp_path, 4)
    assert load_latest(tmp_path, FP).step == 4


def test_kill_9_during_saves_leaves_a_valid_checkpoint(tmp_path):
    child = textwrap.dedent(
        f"""
        import torch
        from lazytrain.train.checkpoint import save_checkpoint
        step = 0
        while True:
            step += 1
            state = {{"w": torch.full((256, 256), float(step)), "b": torch.arange(step)}}
            save_checkpoint({str(tmp_path)!r}, step, model_state=state,
                            optimizer_state={{"step": step}}, extra={{"step": step}},
                            fingerprint={FP!r}, keep=2)
        """
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=root, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while load_step_count(tmp_path) < 3:  # let it get well into its save loop
            assert proc.poll() is None, "the saving process died on its own"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(random.uniform(0.0, 0.05))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    got = load_latest(tmp_path, FP)
    assert got.step >= 3
    assert torch.equal(got.model_state["w"], torch.full((256, 256), float(got.step)))
    assert got.optimizer_state == {"step": got.step} and got.extra == {"step": got.step}
    save(tmp_path, got.step + 1)  # and training continues from there
    assert load_latest(tmp_path, FP).step == got.step + 1


def load_step_count(root: Path) -> int:
    latest = root / "LATEST"
    return int(latest.read_text().strip()[5:]) if latest.exists() else 0


# --------------------------------------------------------------------------- pruning


def test_pruning_keeps_the_newest(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["LATEST", "step-00000004", "step-00000005"]
    for step in range(6, 10):
        save(tmp_path, step)  # default keep=3
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["LATEST", "step-00000007", "step-00000008", "step-00000009"]
    with pytest.raises(CheckpointError, match="keep must be at least 1"):
        save(tmp_path, 10, keep=0)


# --------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def test_export_hf_reloads_identical_weights(tmp_path, qwen):
    from transformers import Qwen2ForCausalLM

    out = export_hf(qwen, tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    reloaded = Qwen2ForCausalLM.from_pretrained(out, local_files_only=True)
    want, got = qwen.state_dict(), reloaded.state_dict()
    assert set(got) == set(want)
    assert all(bits_equal(got[k], v) for k, v in want.items())
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(qwen(ids).logits, reloaded.eval()(ids).logits)


def test_export_hf_refuses_other_models(tmp_path):
    message = r"only Hugging Face models .* got Linear; use model\.safetensors"
    with pytest.raises(CheckpointError, match=message):
        export_hf(torch.nn.Linear(2, 2), tmp_path / "out")


def test_the_weights_file_is_written_one_tensor_at_a_time(tmp_path, monkeypatch):
    """NOTE: [Streamed weights files] in train/tensor_file.py: what safetensors itself reads, with every
    dtype it holds, and each copy a tensor needs (here: non-contiguous ones) gone before the next."""
    import gc
    import weakref

    from safetensors import safe_open
    from safetensors.torch import save_file

    from lazytrain.train import tensor_file

    tensors = {f"{dtype}".removeprefix("torch."): torch.randn(5, 3).to(dtype) for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)}
    tensors |= {"int": torch.arange(-6, 6, dtype=torch.int8).view(3, 4), "flag": torch.tensor([True, False]),
                "scalar": torch.tensor(3, dtype=torch.int64), "none": torch.empty(0, 2, dtype=torch.int16)}
    tensors |= {f"t{i}": torch.randn(16, 8).t() for i in range(4)}  # non-contiguous: copied to write
    alive = []
    real = tensor_file._host_bytes

    def host_bytes(t):
        gc.collect()
        assert sum(r() is not None for r in alive) == 0  # the last tensor's copy is gone
        view = real(t)
        if not t.is_contiguous():
            alive.append(weakref.ref(view.obj.base))  # numpy array over the copy
        return view
    monkeypatch.setattr(tensor_file, "_host_bytes", host_bytes)
    tensor_file.write(tensors, tmp_path / "ours.safetensors")
    assert len(alive) == 4
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "theirs.safetensors"))
    with safe_open(str(tmp_path / "ours.safetensors"), "pt") as ours, \
            safe_open(str(tmp_path / "theirs.safetensors"), "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys()) == sorted(tensors)
        for k in tensors:
            a, b = ours.get_tensor(k), theirs.get_tensor(k)
            assert a.dtype == b.dtype == tensors[k].dtype and a.shape == b.shape and bits_equal(a, b), k
