"""Room for checkpoints on their disk (NOTE: [Checkpoint room] in lazytrain/train/room.py): a run
whose checkpoints do not all fit skips periodic ones with a line and keeps its final state, and one
whose final state fits nowhere is refused before its first step. Disks are faked: free space is a
capacity less the bytes under a folder."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from lazytrain.cli import main
from lazytrain.errors import ResourceError
from lazytrain.train import room as room_mod
from lazytrain.train.checkpoint import LATEST_FILE
from lazytrain.train.room import Room, make_room

Usage = namedtuple("Usage", "total used free")


class FakeDisk:
    """`shutil.disk_usage` for paths under `folder`: a disk of `capacity` bytes holding only what is
    under `folder`."""

    def __init__(self, monkeypatch, folder: Path, capacity: int = 0):
        self.folder, self.capacity, real = folder.resolve(), capacity, shutil.disk_usage
        folder.mkdir(parents=True, exist_ok=True)

        def usage(path):
            if not Path(path).resolve().is_relative_to(self.folder):
                return real(path)
            used = self.used()
            return Usage(self.capacity, used, max(0, self.capacity - used))
        monkeypatch.setattr(shutil, "disk_usage", usage)

    def used(self) -> int:
        return sum(f.stat().st_size for f in self.folder.rglob("*") if f.is_file())


def checkpoint(root: Path, step: int, nbytes: int, latest: bool = True) -> Path:
    path = root / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"\0" * nbytes)
    if latest:
        (root / LATEST_FILE).write_text(path.name + "\n")
    return path


def a_room(root: Path, size: int, export: Path | None = None, weights: int = 0, here: bool = True) -> Room:
    return Room(root, checkpoint=size, export=export, weights=weights, export_here=here, exportable=True)


# --------------------------------------------------------------------------- the arithmetic


def test_one_checkpoint_of_room_keeps_the_final_one(tmp_path, monkeypatch):
    """A fresh run whose disk holds one checkpoint but not two skips every periodic save (each would
    leave no room for the final one), says so before the first step, and writes the final one."""
    FakeDisk(monkeypatch, tmp_path / "disk", capacity=1500)
    root = tmp_path / "disk" / "run" / "checkpoints"
    room = a_room(root, 1000)
    lines = room.check([1, 2, 3], 3)
    assert len(lines) == 1 and lines[0].startswith("warning: a checkpoint of this run takes about 1000 B, and the disk of")
    assert "has 1.5 KiB free: all periodic checkpoints will be skipped, to keep room for the final checkpoint" in lines[0]
    assert "free 500 B more there, or pass another --checkpoint-dir" in lines[0]
    assert room.periodic(1).startswith("warning: checkpoint step 1 skipped: a checkpoint of this run takes about 1000 B")
    assert room.final(3) is None  # written: it fits


def test_room_for_two_saves_every_checkpoint_in_turn(tmp_path, monkeypatch):
    """With room for the next checkpoint beside the newest, nothing is said and every save goes
    ahead; the checkpoints older than the newest are removed to make that room (never the newest)."""
    FakeDisk(monkeypatch, tmp_path / "disk", capacity=3000)
    root = tmp_path / "disk" / "checkpoints"
    room = a_room(root, 1000)
    assert room.check([1, 2, 3, 4], 4) == []
    checkpoint(root, 1, 1000)
    assert room.periodic(2) is None
    checkpoint(root, 2, 1000)
    (root / ".tmp-step-00000003-dead").mkdir()
    (root / ".tmp-step-00000003-dead" / "model.safetensors").write_bytes(b"\0" * 500)  # an interrupted save
    assert room.periodic(3) is None  # 500 free: the leftover and step 1 go, step 2 (the newest) stays
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-00000002"]


def test_a_resumed_run_counts_what_the_newest_checkpoint_holds(tmp_path, monkeypatch):
    """Resumed beside a newest checkpoint that is larger than estimated, the size as written is the
    size of the next; a final checkpoint that cannot fit beside it is refused before the first step
    with the arithmetic and every fix."""
    FakeDisk(monkeypatch, tmp_path / "disk", capacity=2000 + len("step-00000050\n"))  # and LATEST
    root = tmp_path / "disk" / "checkpoints"
    checkpoint(root, 50, 1200)
    room = a_room(root, 1000, weights=300)
    with pytest.raises(ResourceError) as info:
        room.check([60], 60)
    message = str(info.value)
    assert message.startswith("a checkpoint of this run takes about 1.2 KiB, and the disk of ")
    assert "has 800 B free, beside step-00000050 (1.2 KiB): not even the final checkpoint (step 60) fits" in message
    assert message.endswith("free 400 B there, pass a --checkpoint-dir on a disk with room, or pass --export-hf DIR "
                            "to save the final weights (300 B) there first")


def test_with_an_export_the_final_weights_go_there_first(tmp_path, monkeypatch):
    """With --export-hf on the same disk, periodic saves keep room for the export; the final
    checkpoint that cannot fit beside the newest is skipped, saying where the final weights are."""
    FakeDisk(monkeypatch, tmp_path / "disk", capacity=1000 + 400 + 100)
    root, export = tmp_path / "disk" / "checkpoints", tmp_path / "disk" / "hf"
    room = a_room(root, 1000, export, weights=400)
    [line] = room.check([1, 2, 3], 3)
    assert line.endswith(": 1 of the 2 periodic checkpoints will be skipped, to keep room for the final export; the "
                         f"final checkpoint will not fit beside the newest, so the final weights go to {export} first; "
                         "free 900 B more there, or pass another --checkpoint-dir")
    assert room.periodic(1) is None
    checkpoint(root, 1, 1000)
    assert "checkpoint step 2 skipped" in room.periodic(2)
    room.before_export()
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"\0" * 400)
    line = room.final(3)
    assert line.startswith("warning: the final checkpoint (step 3) skipped:")
    assert line.endswith(f"the final weights are in {export}, and {root.parent} resumes from step-00000001")


def test_an_export_that_fits_nowhere_is_refused(tmp_path, monkeypatch):
    FakeDisk(monkeypatch, tmp_path / "disk", capacity=300)
    room = a_room(tmp_path / "disk" / "checkpoints", 100, tmp_path / "disk" / "hf", weights=400)
    with pytest.raises(ResourceError, match=r"the export needs about 400 B on the disk of .*hf, which has 300 B"):
        room.check([1], 1)


def test_make_room_never_removes_the_newest(tmp_path, monkeypatch):
    FakeDisk(monkeypatch, tmp_path / "disk", capacity=1000)
    root = tmp_path / "disk" / "checkpoints"
    checkpoint(root, 1, 400)
    checkpoint(root, 2, 400)
    make_room(root, 10_000)
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-00000002"]


def test_the_size_estimate_bounds_the_checkpoint_written(tmp_path, capsys):
    """The size the run is checked with, from the model and the plan before any optimizer state
    exists, is at least what the checkpoint takes, and within a few percent of it."""
    seen = {}
    of = Room.of.__func__

    def spy(cls, *args, **kwargs):
        seen["room"] = of(cls, *args, **kwargs)
        return seen["room"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Room, "of", classmethod(spy))
        code = main(["train", "--steps", "1", "--checkpoint-dir", str(tmp_path / "run"), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    written = sum(f.stat().st_size for f in (tmp_path / "run" / "checkpoints" / "step-00000001").iterdir())
    assert written <= seen["room"].checkpoint <= 1.05 * written


# --------------------------------------------------------------------------- lazytrain train


@pytest.fixture
def sized(monkeypatch, tmp_path):
    """A fake disk for a run, sized when the run knows its checkpoint size: `free(room)` bytes."""
    disk = FakeDisk(monkeypatch, tmp_path / "disk")
    monkeypatch.setattr(room_mod, "EXPORT_EXTRA_BYTES", 1 << 20)
    of = Room.of.__func__

    def sizing(free):
        def spy(cls, *args, **kwargs):
            room = of(cls, *args, **kwargs)
            disk.capacity = disk.used() + free(room)
            return room
        monkeypatch.setattr(Room, "of", classmethod(spy))
        return tmp_path / "disk"
    return sizing


def train(capsys, run: Path, *flags):
    code = main(["train", "--steps", "3", "--checkpoint-every", "1", "--checkpoint-dir", str(run), "--no-progress",
                 *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_train_on_a_disk_of_one_checkpoint_keeps_the_final_state(sized, capsys):
    """One checkpoint fits, not two: the run says so before its first step, skips the periodic
    saves and ends with the final checkpoint (it used to write step 1 and then fail at step 2,
    losing the rest of the run)."""
    disk = sized(lambda room: room.checkpoint * 3 // 2)
    code, out, err = train(capsys, disk / "run")
    assert code == 0, err
    warning = out.index("all periodic checkpoints will be skipped, to keep room for the final checkpoint")
    assert warning < out.index("step     1  loss")
    assert out.count("skipped: a checkpoint of this run takes about") == 2  # steps 1 and 2, one line each
    assert sorted(p.name for p in (disk / "run" / "checkpoints").iterdir()) == ["LATEST", "step-00000003"]


def test_train_whose_final_checkpoint_fits_nowhere_is_refused_before_the_first_step(sized, capsys):
    disk = sized(lambda room: room.checkpoint // 2)
    code, out, err = train(capsys, disk / "run")
    assert code == 2 and err.count("\n") == 1, err
    assert "not even the final checkpoint (step 3) fits; free " in err
    assert "pass a --checkpoint-dir on a disk with room, or pass --export-hf DIR to save the final weights" in err
    assert "step     1" not in out


def test_train_with_an_export_saves_the_final_weights_first(sized, capsys):
    """The disk holds one checkpoint and the export: step 1 is saved, step 2 skipped, the export is
    written and the final checkpoint, which no longer fits, is skipped with a line naming the export."""
    disk = sized(lambda room: room.checkpoint + room.weights + (64 << 10))
    code, out, err = train(capsys, disk / "run", "--export-hf", str(disk / "hf"))
    assert code == 0, err
    assert "1 of the 2 periodic checkpoints will be skipped, to keep room for the final export" in out
    assert "warning: checkpoint step 2 skipped" in out
    assert out.index(f"exported the weights of step 3 to {disk / 'hf'}") < out.index("the final checkpoint (step 3) skipped")
    assert f"the final weights are in {disk / 'hf'}, and {disk / 'run'} resumes from step-00000001" in out
    assert (disk / "hf" / "lazytrain-export.json").is_file()
    assert sorted(p.name for p in (disk / "run" / "checkpoints").iterdir()) == ["LATEST", "step-00000001"]
