"""`lazytrain train --resume` and the run directory: refusals before anything is written, the run's
LR schedule kept across resumes, checkpoint structure checked before it is applied, one log record
per step, and a full disk reported in one line with nothing half-written."""

from __future__ import annotations

import builtins
import errno
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lazytrain.cli import main
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.checkpoint_load import load_latest
from lazytrain.train.lock import LOCK_FILE
from lazytrain.train.loop import lr_lambda

SMALL = '''
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

def build_model():
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers={layers}, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, use_cache=False, tie_word_embeddings=False,
        attn_implementation="sdpa"))

def example_batch():
    ids = torch.zeros(2, 32, dtype=torch.long)
    return {{"input_ids": ids, "labels": ids.clone()}}
'''


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *texts):
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("lazytrain: error: "), err
    for text in texts:
        assert text in err, err


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    for layers in (2, 1):
        (folder / f"small{layers}.py").write_text(SMALL.format(layers=layers))
    return folder / "small2.py"


def train_args(model, run_dir, *extra):
    return ["train", "--model", model, "--checkpoint-dir", run_dir, "--no-progress", "--print-every", "1", *extra]


@pytest.fixture(scope="module")
def finished(small_model, tmp_path_factory):
    """A run of 4 steps with checkpoints at steps 2 and 4 (a fresh copy per test: `run_copy`)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert main([str(a) for a in train_args(small_model, run_dir, "--steps", 4, "--checkpoint-every", 2)]) == 0
    return run_dir


@pytest.fixture
def run_copy(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def back_to_step_2(run_dir: Path) -> None:
    """What a kill after step 4 was logged, but before its checkpoint was named, leaves behind."""
    root = run_dir / "checkpoints"
    shutil.rmtree(root / "step-00000004")
    (root / "LATEST").write_text("step-00000002\n")


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """The run directory's files, but its lock (NOTE: [Run lock] in train/lock.py: each run that looks
    at the directory holds it, and says who it is there)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


# ---- nothing to resume, another model, a directory without LATEST --------------------------------

def test_resume_with_nothing_to_resume_from_is_refused(small_model, tmp_path, capsys):
    code, out, err = run(capsys, *train_args(small_model, tmp_path / "run", "--steps", 2, "--resume"))
    one_line_error(code, err, "holds no checkpoint to resume from", "drop --resume")
    assert "compiling" not in out and not (tmp_path / "run").exists()


def test_resume_with_another_model_writes_nothing(small_model, run_copy, capsys):
    before = snapshot(run_copy)
    code, out, err = run(capsys, *train_args(small_model.with_name("small1.py"), run_copy, "--resume"))
    one_line_error(code, err, "was written for model fingerprint", "fresh checkpoint directory")
    assert snapshot(run_copy) == before  # schedule.py and log.jsonl untouched


def test_checkpoints_without_latest_need_resume(small_model, run_copy, capsys):
    """A kill between a checkpoint's rename and the LATEST write leaves step directories without LATEST."""
    (run_copy / "checkpoints" / "LATEST").unlink()
    before = snapshot(run_copy)
    code, out, err = run(capsys, *train_args(small_model, run_copy, "--steps", 4))
    one_line_error(code, err, "already holds checkpoints", "--resume")
    assert "compiling" not in out and snapshot(run_copy) == before
    code, out, err = run(capsys, *train_args(small_model, run_copy, "--resume"))
    assert code == 0, err
    assert f"resumed from {run_copy / 'checkpoints' / 'step-00000004'} at step 4" in out


# ---- the LR schedule and the log across resumes --------------------------------------------------

def test_resume_keeps_the_runs_lr_schedule(small_model, run_copy, capsys):
    back_to_step_2(run_copy)
    code, out, err = run(capsys, *train_args(small_model, run_copy, "--steps", 8, "--resume"))
    one_line_error(code, err, "trained on the LR schedule `--lr 0.003 --warmup-steps 1 --steps 4 --min-lr-ratio 0.1`",
                   "--steps 8 would change it", "--new-lr-schedule")
    # Flags left out take the recorded values: the run ends at its own step 4.
    code, out, err = run(capsys, *train_args(small_model, run_copy, "--resume"))
    assert code == 0, err
    assert "step     4  loss" in out and "step     5" not in out


def test_new_lr_schedule_applies_from_the_checkpoints_step(small_model, run_copy, capsys):
    code, out, err = run(capsys, *train_args(small_model, run_copy, "--steps", 8, "--lr", "0.001", "--resume",
                                             "--new-lr-schedule"))
    assert code == 0, err
    assert ("new LR schedule from step 4: `--lr 0.001 --warmup-steps 1 --steps 8 --min-lr-ratio 0.1` "
            "(was `--lr 0.003 --warmup-steps 1 --steps 4 --min-lr-ratio 0.1`)") in out
    records = [json.loads(line) for line in (run_copy / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    factor = lr_lambda(1, 8, 0.1)
    for r in records[4:]:
        assert r["lr"] == pytest.approx(0.001 * factor(r["step"]), rel=1e-12)
    meta = json.loads((run_copy / "checkpoints" / "step-00000008" / "meta.json").read_text())
    assert meta["extra"]["lr_schedule"] == {"lr": 0.001, "warmup_steps": 1, "steps": 8, "min_lr_ratio": 0.1}


def test_log_has_one_record_per_step_across_resumes(small_model, finished, run_copy, capsys):
    """Steps 3 and 4 were logged before the kill and run again after the resume: logged once. A line
    torn by the kill is dropped. The resumed weights equal the uninterrupted run's."""
    back_to_step_2(run_copy)
    with open(run_copy / "log.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    code, out, err = run(capsys, *train_args(small_model, run_copy, "--steps", 4, "--resume"))
    assert code == 0, err
    records = [json.loads(line) for line in (run_copy / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    weights = "checkpoints/step-00000004/model.safetensors"
    a, b = load_file(str(finished / weights)), load_file(str(run_copy / weights))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- checkpoint structure ------------------------------------------------------------------------

def _edit_weights(state):
    name = "model.layers.0.mlp.up_proj.weight"
    return {
        "missing": lambda s: {k: v for k, v in s.items() if k != name},
        "shape": lambda s: {**s, name: s[name][:-1]},
        "fp16": lambda s: {**s, name: s[name].half()},
    }[state]


@pytest.mark.parametrize("edit, message", [
    ("missing", "does not hold this model's weights: missing model.layers.0.mlp.up_proj.weight"),
    ("shape", "holds model.layers.0.mlp.up_proj.weight with shape (127, 64), the model's is (128, 64)"),
    ("fp16", "holds model.layers.0.mlp.up_proj.weight as float16, the run keeps it in float32"),
    ("moment", "holds the optimizer's exp_avg of model.embed_tokens.weight with shape (3,), the parameter's is (512, 64)"),
    ("scheduler", "is at step 4 but its LR scheduler at step 3"),
])
def test_checkpoint_structure_is_checked_before_it_is_applied(small_model, run_copy, capsys, edit, message):
    """Each checkpoint below has valid digests and this run's fingerprint; what it holds does not fit."""
    root = run_copy / "checkpoints"
    found = load_latest(root, None)
    model_state, optimizer_state, extra = dict(found.model_state), found.optimizer_state, dict(found.extra)
    if edit in ("missing", "shape", "fp16"):
        model_state = _edit_weights(edit)(model_state)
    elif edit == "moment":
        optimizer_state["state"][0]["exp_avg"] = torch.zeros(3)
    else:
        extra["scheduler"] = {**extra["scheduler"], "last_epoch": 3}
    shutil.rmtree(root)
    ckpt.save_checkpoint(root, 4, model_state=model_state, optimizer_state=optimizer_state, extra=extra,
                         fingerprint=found.fingerprint)
    code, out, err = run(capsys, *train_args(small_model, run_copy, "--steps", 6, "--resume", "--new-lr-schedule"))
    one_line_error(code, err, f"checkpoint {root / 'step-00000004'} {message}")
    assert "resumed from" not in out


# ---- a full disk ---------------------------------------------------------------------------------

def fill_disk_for(monkeypatch, marker: str):
    """Files whose name contains `marker` open, and every write into them fails with ENOSPC."""
    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fake_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Full(f) if ("w" in mode or "a" in mode) and marker in str(file) else f

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)


def test_full_disk_while_compiling_on_the_fly(small_model, tmp_path, capsys, monkeypatch):
    fill_disk_for(monkeypatch, "schedule.py")
    run_dir = tmp_path / "run"
    code, out, err = run(capsys, *train_args(small_model, run_dir, "--steps", 2))
    one_line_error(code, err, f"no space left on the disk to write {run_dir / 'schedule.py'}: it needs about")
    assert [p.name for p in run_dir.iterdir()] == [LOCK_FILE]  # no 0-byte schedule.py, no temp file


def test_full_disk_during_a_checkpoint(small_model, tmp_path, capsys, monkeypatch):
    """The weights' file meets ENOSPC: one line, the previous checkpoint intact."""
    import errno

    real = ckpt.tensor_file.write

    def write(tensors, path):
        if "step-00000002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(tensors, path)

    monkeypatch.setattr(ckpt.tensor_file, "write", write)
    run_dir = tmp_path / "run"
    code, out, err = run(capsys, *train_args(small_model, run_dir, "--steps", 3, "--checkpoint-every", 1))
    one_line_error(code, err, f"no space left on the disk to write {run_dir / 'checkpoints' / 'step-00000002'}",
                   "the previous checkpoint", "is intact")
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-00000001"]
    assert load_latest(root, None).step == 1
