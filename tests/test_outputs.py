"""What `lazytrain train` writes, and where: every output's place is probed before compiling (a
place that cannot be written is one line, not a traceback after the compile or after training),
an export replaces its directory whole (NOTE: [Directories replaced whole] in lazytrain/files.py)
and a full disk under it leaves the old export and the final checkpoint, and a new run never
erases a log it was not given leave to."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lazytrain import files
from lazytrain.cli import main
from lazytrain.errors import ResourceError
from lazytrain.train.export import EXPORT_MARKER, export_hf
from lazytrain.units import format_size

STEPS = ["--steps", "1", "--no-progress"]


def run(capsys, *argv):
    capsys.readouterr()  # what came before (save_pretrained's progress bar)
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f"{dest.name}.tmp-"))


@pytest.fixture(scope="module")
def qwen():
    """The default example model (a tiny Qwen2), as its model file builds it."""
    from lazytrain import examples
    from lazytrain.train.source import resolve

    torch.manual_seed(0)
    return resolve(examples.DEFAULT, None, None, None).materialize()[0]


# --------------------------------------------------------------------------- places that cannot be written


def test_checkpoint_dir_under_proc_is_refused_before_compiling(capsys):
    """/proc takes no new entries, although os.access says root may write there: the run directory
    used to fail with a FileNotFoundError traceback after the compile."""
    code, out, err = run(capsys, *STEPS, "--checkpoint-dir", "/proc/lazytrain-run")
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("lazytrain: error: --checkpoint-dir /proc/lazytrain-run cannot be written: making an entry "
                          "in /proc fails (")
    assert err.endswith("); pass a directory where you can write\n")
    assert "compiling" not in out


def test_checkpoint_dir_under_a_file_is_refused_before_compiling(tmp_path, capsys):
    """A parent that is a file: the OS's reason, Not a directory, in the line."""
    (tmp_path / "notes").write_text("a file")
    run_dir = tmp_path / "notes" / "run"
    code, out, err = run(capsys, *STEPS, "--checkpoint-dir", str(run_dir))
    assert code == 2 and err.count("\n") == 1, err
    assert (f"--checkpoint-dir {run_dir} cannot be written: making an entry in {tmp_path / 'notes'} fails (Not a "
            "directory); pass a directory where you can write") in err
    assert "compiling" not in out


def test_log_under_proc_is_refused_before_compiling(capsys):
    """--log /proc/FILE passed the old check (its parent is a directory) and failed as the log opened."""
    code, out, err = run(capsys, *STEPS, "--log", "/proc/lazytrain.log")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("lazytrain: error: --log /proc/lazytrain.log cannot be written: making an entry in /proc "
                          "fails (")
    assert err.endswith("); pass a file in a directory where you can write\n")
    assert "compiling" not in out


def test_export_under_proc_is_refused_before_compiling(capsys):
    """The export is written beside its directory, in its parent: /proc refuses it before the compile,
    not after training."""
    code, out, err = run(capsys, *STEPS, "--export-hf", "/proc/lazytrain-export")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("lazytrain: error: --export-hf /proc/lazytrain-export cannot be written: making an entry in "
                          "/proc fails (")
    assert err.endswith("); pass a directory where you can write\n")
    assert "compiling" not in out


# --------------------------------------------------------------------------- an export replaces its directory whole


def test_export_over_the_run_directory_is_refused_even_with_overwrite(tmp_path, capsys):
    """Replacing the export's directory would remove a run directory or log inside it."""
    out_dir = tmp_path / "out"
    for flags, named in ((["--checkpoint-dir", str(out_dir / "run")], f"--checkpoint-dir {out_dir / 'run'}"),
                         (["--log", str(out_dir / "log.jsonl")], f"--log {out_dir / 'log.jsonl'}")):
        out_dir.mkdir(exist_ok=True)
        code, out, err = run(capsys, *STEPS, "--export-hf", str(out_dir), "--overwrite-export", *flags)
        assert code == 2 and err.count("\n") == 1, err
        assert (f"--export-hf {out_dir} holds {named}, which replacing the export would remove; pass an --export-hf "
                "directory outside it") in err


def test_an_earlier_export_holding_other_files_is_refused(tmp_path, qwen, capsys):
    """An earlier export is replaced whole, so files it did not write (its marker lists what it did)
    are refused unless --overwrite-export."""
    out_dir = export_hf(qwen, tmp_path / "out", about={"step": 1})
    (out_dir / "notes.txt").write_text("keep me")
    code, out, err = run(capsys, *STEPS, "--export-hf", str(out_dir))
    assert code == 2 and err.count("\n") == 1, err
    assert (f"--export-hf {out_dir} is an earlier export that also holds notes.txt, which it did not write and "
            "replacing it would remove; move them out, or pass --overwrite-export to replace them too") in err
    assert (out_dir / "notes.txt").read_text() == "keep me"


def test_export_replaces_an_earlier_one_whole(tmp_path, qwen, capsys):
    """An earlier export (sharded here) and a leftover of a killed export beside it: the run's export
    takes the directory's place whole, with the marker listing its files, and the leftover is gone."""
    from transformers import AutoModelForCausalLM

    out_dir = export_hf(qwen, tmp_path / "out", max_shard_size="50KB", about={"step": 0})
    assert (out_dir / "model.safetensors.index.json").is_file()
    leftover = tmp_path / f"out.tmp-{'0' * 32}"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"torn")
    code, out, err = run(capsys, *STEPS, "--checkpoint-dir", str(tmp_path / "run"), "--export-hf", str(out_dir))
    assert code == 0, err
    marker = json.loads((out_dir / EXPORT_MARKER).read_text())
    assert marker["step"] == 1 and marker["checkpoint_dir"] == str(tmp_path / "run")
    assert sorted(marker["files"] + [EXPORT_MARKER]) == sorted(p.name for p in out_dir.iterdir())
    assert "model.safetensors" in marker["files"] and "model.safetensors.index.json" not in marker["files"]
    assert leftovers(out_dir) == []
    exported = AutoModelForCausalLM.from_pretrained(str(out_dir), local_files_only=True).state_dict()
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "step-00000001" / "model.safetensors"))
    assert all(torch.equal(exported[name], value) for name, value in trained.items())


def _disk_full(*args, **kwargs):
    """safetensors' own error for ENOSPC, after part of the file is written."""
    from safetensors import SafetensorError

    Path(args[1]).write_bytes(b"\0" * 100)
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                          'message: "No space left on device" })')


def test_export_onto_a_full_disk_keeps_the_old_export_and_the_final_checkpoint(tmp_path, qwen, capsys, monkeypatch):
    """save_pretrained runs out of space after training: one line naming the directory and the bytes
    the weights take (tied ones once); the earlier export stays as it was, no partial directory is
    left, the final checkpoint (written after the export) is still saved, and --resume exports from
    it. It used to be a SafetensorError traceback, and the final checkpoint was never written."""
    import transformers.modeling_utils

    out_dir = export_hf(qwen, tmp_path / "out", about={"step": 0})
    before = snapshot(out_dir)
    run_dir = tmp_path / "run"
    argv = ["--steps", "2", "--no-progress", "--checkpoint-dir", str(run_dir), "--export-hf", str(out_dir)]
    with monkeypatch.context() as patch:
        patch.setattr(transformers.modeling_utils, "safe_save_file", _disk_full)
        code, out, err = run(capsys, *argv)
    lines = err.splitlines()  # save_pretrained's progress bar, then lazytrain's one line
    assert code == 2 and "Traceback" not in err and [s for s in lines if s.startswith("lazytrain")] == lines[-1:], err
    weights = sum(p.numel() * p.element_size() for p in qwen.parameters())  # tied embeddings once
    assert lines[-1].startswith(f"lazytrain: error: no space left on the disk to write {out_dir}: it needs about "
                                f"{format_size(weights, round_up=True)}, ")
    final = run_dir / "checkpoints" / "step-00000002"
    assert lines[-1].endswith(f"free space on that disk, or pass an --export-hf directory on a disk with room; the "
                              f"trained state (step 2) is in the checkpoint {final}: rerun with --resume to export it "
                              "from there")
    assert snapshot(out_dir) == before and leftovers(out_dir) == []
    assert (run_dir / "checkpoints" / "LATEST").read_text().strip() == final.name

    code, out, err = run(capsys, *argv, "--resume")
    assert code == 0, err
    assert "(the run is complete)" in out and f"exported the weights of step 2 to {out_dir}" in out
    exported = load_file(str(out_dir / "model.safetensors"))
    assert all(torch.equal(exported[name], value) for name, value in load_file(str(final / "model.safetensors")).items()
               if name in exported)


def _full_disk_rank(rank: int, world: int, port: int, argv: list[str], out: str) -> None:
    import launch_worker
    import transformers.modeling_utils

    transformers.modeling_utils.safe_save_file = _disk_full
    launch_worker._rank(rank, world, port, argv, out, None)


def test_export_onto_a_full_disk_on_two_ranks_still_saves_the_final_checkpoint(tmp_path):
    """On two ranks the export (rank 0's) fails: both ranks still write the final checkpoint (a
    collective save), then rank 0 gives the one line and rank 1 stops without repeating it."""
    import launch_worker

    out, run_dir = tmp_path / "out", tmp_path / "run"
    argv = ["train", "--steps", "2", "--no-progress", "--checkpoint-dir", str(run_dir), "--export-hf", str(out)]
    ctx, port = multiprocessing.get_context("spawn"), launch_worker.free_port()
    (tmp_path / "logs").mkdir()
    ranks = [ctx.Process(target=_full_disk_rank, args=(r, 2, port, argv, str(tmp_path / "logs"))) for r in range(2)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(300)
    err = [(tmp_path / "logs" / f"err{r}.txt").read_text() for r in range(2)]
    assert [rank.exitcode for rank in ranks] == [2, 2], err
    lines = [line for line in err[0].splitlines() if line.startswith("lazytrain")]
    final = run_dir / "checkpoints" / "step-00000002"
    assert len(lines) == 1 and lines[0].startswith(f"lazytrain: error: no space left on the disk to write {out}"), err
    assert lines[0].endswith(f"the trained state (step 2) is in the checkpoint {final}: rerun with --resume to "
                             "export it from there"), err
    assert "lazytrain: error" not in err[1] and "Traceback" not in err[1], err
    assert (run_dir / "checkpoints" / "LATEST").read_text().strip() == final.name
    assert not out.exists() and leftovers(out) == []


def test_export_hf_on_a_full_disk_leaves_nothing_written(tmp_path, qwen, monkeypatch):
    """An OSError ENOSPC from the tokenizer's files (after the weights) is the same one error, and
    the directory that did not exist still does not."""
    from lazytrain.train.data import builtin_tokenizer

    tokenizer = builtin_tokenizer()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "tokenizer.json")
    monkeypatch.setattr(tokenizer, "save_pretrained", full)
    with pytest.raises(ResourceError, match=f"no space left on the disk to write {tmp_path / 'out'}: it needs about "):
        export_hf(qwen, tmp_path / "out", tokenizer=tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- killed at any moment


def _killed(dest: Path, where: str) -> None:
    """In a child process: replace `dest` with a new directory, killed `where`."""
    if where == "after the swap":
        files.shutil.rmtree = lambda *a, **k: os._exit(0)
    with files.replaced_whole(dest) as tmp:
        (tmp / "weights").write_text("new")
        if where == "while writing":
            os._exit(0)


@pytest.mark.parametrize("where,holds", [("while writing", "old"), ("after the swap", "new")])
def test_a_killed_export_leaves_one_whole_directory(tmp_path, where, holds):
    """A kill while the new directory is written leaves the old one; a kill after the swap, the new
    one; either way with one temp directory beside, which the next write removes."""
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "weights").write_text("old")
    child = multiprocessing.get_context("fork").Process(target=_killed, args=(dest, where))
    child.start()
    child.join()
    assert (dest / "weights").read_text() == holds
    assert len(leftovers(dest)) == 1
    with files.replaced_whole(dest) as tmp:
        (tmp / "weights").write_text("newer")
    assert snapshot(dest) == {"weights": b"newer"} and leftovers(dest) == []


def test_without_an_atomic_swap_the_old_directory_is_renamed_aside(tmp_path, monkeypatch):
    """Where the system cannot swap two directories, the old one is renamed aside, then removed; a
    failure in the block leaves it untouched."""
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "weights").write_text("old")
    with pytest.raises(RuntimeError):
        with files.replaced_whole(dest) as tmp:
            (tmp / "weights").write_text("torn")
            raise RuntimeError("stop")
    assert snapshot(dest) == {"weights": b"old"} and leftovers(dest) == []
    with files.replaced_whole(dest) as tmp:
        (tmp / "weights").write_text("new")
    assert snapshot(dest) == {"weights": b"new"} and leftovers(dest) == []


# --------------------------------------------------------------------------- --log


def test_a_new_run_refuses_an_existing_log(tmp_path, capsys):
    """A new run writes its log from step 1, which erased an existing --log file: refused before
    compiling, unless --overwrite-log."""
    log = tmp_path / "notes.txt"
    log.write_text("my notes\n")
    code, out, err = run(capsys, *STEPS, "--log", str(log))
    assert code == 2 and err.count("\n") == 1, err
    assert (f"--log {log} already holds 9 B, which a new run would erase (it writes its log from step 1); pass a new "
            "--log file, --overwrite-log to replace it, or --resume to continue the run it logs") in err
    assert "compiling" not in out and log.read_text() == "my notes\n"
    code, out, err = run(capsys, *STEPS, "--log", str(log), "--overwrite-log")
    assert code == 0, err
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1]


def test_a_new_run_rewrites_its_run_directorys_own_log(tmp_path, capsys):
    """A run directory's log.jsonl, named by --log, is the new run's own (a run killed before its
    first checkpoint left it): rewritten without a flag."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "log.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    code, out, err = run(capsys, *STEPS, "--checkpoint-dir", str(run_dir), "--log", str(run_dir / "." / "log.jsonl"))
    assert code == 0, err
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] and records[0]["loss"] != 9.0


def test_a_diverged_model_is_never_exported(tmp_path, capsys, monkeypatch):
    """NOTE: [Finite state]: weights gone non-finite by the end of the run are not exported (the
    export's directory is not even made), as they are not checkpointed."""
    from lazytrain.runtime.trainer import Trainer

    real = Trainer.sync_model

    def diverged(self):
        real(self)
        with torch.no_grad():
            next(self.model.parameters()).fill_(float("nan"))

    monkeypatch.setattr(Trainer, "sync_model", diverged)
    out_dir = tmp_path / "out"
    code, _, err = run(capsys, *STEPS, "--export-hf", str(out_dir))
    assert code == 2 and "training diverged, so no export of step 1 is written" in err
    assert len(err.strip().splitlines()) == 1
    assert not out_dir.exists() and leftovers(out_dir) == []
