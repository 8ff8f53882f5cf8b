"""Flags and files the command line refuses in one line (exit status 2) instead of a traceback, a
silent overwrite, or a run that trains on nonsense."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from lazytrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = ROOT / "lazytrain/examples/tiny_gpt.py"


def refused(capsys, *argv) -> str:
    """The one error line of a refused command."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lazytrain"), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv,message", [
    (("--seed", str(2**64)), "--seed: 18446744073709551616 is above"),
    (("--seed", "-1"), "--seed: -1 is below 0"),
    (("--lr", "1e23"), "--lr: 1e23 is out of range; pass a number > 0 and <= 1"),
    (("--weight-decay", "1e23"), "--weight-decay: 1e23 is out of range"),
    (("--warmup-steps", str(10**18)), "--warmup-steps: 1000000000000000000 is above"),
    (("--warmup-steps", "300", "--steps", "200"), "--warmup-steps 300 is longer than the run's 200 steps"),
    (("--warmup-steps", "300"), "--warmup-steps 300 is longer than the run's 200 steps"),
    (("--checkpoint-dir", ""), "--checkpoint-dir: the path is empty"),
    (("--export-hf", " "), "--export-hf: the path is empty"),
    (("--clipping", "previous-norm"), "--clipping previous-norm chooses how --max-grad-norm clips"),
])
def test_train_flags_out_of_range(capsys, argv, message):
    assert message in refused(capsys, "train", *argv)


def test_compile_flags_out_of_range(tmp_path, capsys):
    out = tmp_path / "s.py"
    assert "'1.5' has no unit" in refused(capsys, "compile", TINY_GPT, "-o", out, "--loss-chunk-bytes", "1.5")
    line = refused(capsys, "compile", TINY_GPT, "-o", out, "--budget", "1000000TiB", "--hardware", "cpu")
    assert "is more than a plan can have on hardware profile 'cpu'" in line
    line = refused(capsys, "train", "--budget", "1000000TiB", "--hardware", "cpu", "--steps", "1", "--no-progress")
    assert "is more than a plan can have on hardware profile 'cpu'" in line
    assert not out.exists()


def test_a_bad_hardware_profile(tmp_path, capsys):
    text = tmp_path / "hw.json"
    text.write_text("not json at all")
    assert "cannot be read as JSON" in refused(capsys, "compile", TINY_GPT, "-o", tmp_path / "s.py", "--hardware", text)
    profile = json.loads((ROOT / "lazytrain/hardware/cpu.json").read_text())
    profile["h2d_bandwidth"] = -1e9
    negative = tmp_path / "negative.json"
    negative.write_text(json.dumps(profile))
    line = refused(capsys, "compile", TINY_GPT, "-o", tmp_path / "s.py", "--hardware", negative)
    assert "h2d_bandwidth is -1000000000.0; it must be above zero" in line
    assert "cannot be read as JSON" in refused(capsys, "train", "--hardware", text, "--steps", "1")


def test_compile_never_writes_over_what_it_did_not_write(tmp_path, capsys):
    model = tmp_path / "m.py"
    shutil.copy(TINY_GPT, model)
    before = model.read_text()
    assert "is the model file" in refused(capsys, "compile", model, "-o", model, "--hardware", "cpu")
    assert model.read_text() == before
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert "exists and is not a schedule lazytrain wrote" in refused(capsys, "compile", model, "-o", notes)
    assert notes.read_text() == "my notes\n"
    assert "is a directory" in refused(capsys, "compile", model, "-o", tmp_path)
    missing = tmp_path / "nowhere" / "s.py"
    assert "does not exist; create it first" in refused(capsys, "compile", model, "-o", missing)
    assert not missing.parent.exists()
    dump = tmp_path / "dump.txt"
    dump.write_text("")
    assert "--dump-ir" in refused(capsys, "compile", model, "-o", tmp_path / "s.py", "--hardware", "cpu", "--dump-ir", dump)


def test_recompiling_replaces_a_schedule(tmp_path, capsys):
    out = tmp_path / "s.py"
    for _ in range(2):
        assert main(["compile", str(TINY_GPT), "-o", str(out), "--hardware", "cpu", "--budget", "420KiB"]) == 0
    capsys.readouterr()


def test_a_binary_schedule(tmp_path, capsys):
    schedule = tmp_path / "s.py"
    schedule.write_bytes(bytes(range(256)) * 4)
    assert "cannot be read as a schedule" in refused(capsys, "inspect", schedule)


@pytest.mark.parametrize("command", ["compile", "train"])
def test_a_model_file_that_is_no_python_model(tmp_path, capsys, command):
    notes = tmp_path / "notes.txt"
    notes.write_text("def build_model(): pass\n")
    exits = tmp_path / "script.py"
    exits.write_text("import sys\nsys.exit(0)\n")
    out = tmp_path / "s.py"
    for model, message in ((notes, "is not a Python file (.py)"), (Path("/etc/passwd"), "is not a Python file (.py)"),
                           (exits, "called sys.exit(0)")):
        argv = ("compile", model, "-o", out, "--hardware", "cpu") if command == "compile" else \
            ("train", "--model", model, "--hardware", "cpu", "--steps", "1")
        assert message in refused(capsys, *argv)
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU refuses a cuda schedule")
def test_a_gpu_schedule_on_the_cpu_names_the_schedule_file(tmp_path, capsys):
    """The refusal names the schedule by its file, and the model it was compiled from as such."""
    schedule, model = tmp_path / "h200.py", ROOT / "lazytrain/examples/tiny_qwen.py"
    assert main(["compile", str(model), "-o", str(schedule), "--budget", "24GiB"]) == 0
    capsys.readouterr()
    line = refused(capsys, "train", "--model", model, "--schedule", schedule, "--steps", "1", "--no-progress")
    assert f"schedule {schedule} (of {model}) was compiled for cuda (hardware h200)" in line
