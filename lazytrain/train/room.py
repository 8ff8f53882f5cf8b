"""Room for a run's checkpoints on their disk, so that a run whose checkpoints do not all fit still
keeps its final state.

NOTE: [Checkpoint room]
A checkpoint is written beside the newest one, which stays whole until the new one is named in
LATEST (checkpoint.py), so a save needs a checkpoint's bytes free on that disk. Leftovers of
interrupted saves and older checkpoints are removed first where that makes the room (the pruning
after the save would remove them anyway once there are more than `KEEP`); the newest never is.
While training, a periodic save is written only where it fits and, after it, the final state still
fits: the export where `--export-hf` goes to the same disk (it is written before the final
checkpoint, so the final weights are safe first), else the final checkpoint. A periodic save that
does not fit is skipped with one line: the newest checkpoint stays intact and training goes on.
A final checkpoint that does not fit beside the newest is skipped once the export holds the final
weights. Before the first step (`Room.check`) the run's saves are played through against the
disk's free space: a run whose final state fits nowhere is refused with the arithmetic and the
fixes, and one that will skip saves says so.

Sizes, known once the model and schedule exist: the weights as a checkpoint writes them (every
name, tied ones twice), the optimizer state the plan counts (its bytes a parameter per stage, as
the plan summary gives them) with a step count and torch.save's records per parameter, and the
metadata. A resumed run's newest checkpoint gives the size as written where that is larger.
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lazytrain import files
from lazytrain.errors import CheckpointError, ResourceError
from lazytrain.train import checkpoint as ckpt
from lazytrain.units import format_size

STATE_RECORD_BYTES = 4096  # a parameter's state beyond its moments: step count, torch.save records, 8-bit maps
META_BYTES = 1 << 16  # meta.json, rng.pt and LATEST, as save_checkpoint counts them
EXPORT_EXTRA_BYTES = 16 << 20  # an export's config, tokenizer files and shard index


def checkpoint_bytes(model: torch.nn.Module, schedule) -> int:
    """Bytes one checkpoint of `model` trained by `schedule` writes (NOTE: [Checkpoint room])."""
    weights = model.state_dict()
    per = {"32bit": 8.0, "8bit": getattr(schedule, "STATE_BYTES", 8.0)}
    states = sum(s.param_numel * per[s.states] for s in schedule.STAGES)
    states += sum(math.prod(schedule.PLACEHOLDERS[p][2]) for p in schedule.SHARED) * per[
        getattr(schedule, "OPTIMIZER_STATES", "32bit")]
    params = sum(len(s.params) for s in schedule.STAGES) + len(schedule.SHARED)
    header = 256 * len(weights)  # a safetensors header entry per tensor
    return int(sum(t.numel() * t.element_size() for t in weights.values()) + header + states
               + params * STATE_RECORD_BYTES + META_BYTES)


def export_bytes(model: torch.nn.Module) -> int:
    """Bytes `--export-hf` writes: each weight once, in its dtype, and the config and tokenizer."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors) + EXPORT_EXTRA_BYTES


# --------------------------------------------------------------------------- the disk


def _bytes(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _newest(root: Path) -> Path | None:
    """The checkpoint a resume continues from: the one LATEST names, else the newest directory."""
    try:
        name = ckpt._read_latest(root) if (root / ckpt.LATEST_FILE).exists() else None
    except CheckpointError:
        name = None
    if name is not None and (root / name).is_dir():
        return root / name
    dirs = ckpt._step_dirs(root) if root.is_dir() else []
    return dirs[-1][1] if dirs else None


def _removable(root: Path, newest: Path | None) -> list[Path]:
    """What a save may remove to make room, first to go first: leftovers of interrupted saves,
    then the checkpoints older than the newest, oldest first."""
    if not root.is_dir():
        return []
    leftovers = sorted(e for e in root.iterdir() if e.name.startswith(ckpt.TMP_PREFIX))
    return leftovers + [p for _, p in ckpt._step_dirs(root) if p != newest]


def make_room(root: Path, needed: int) -> None:
    """Remove leftovers, then older checkpoints (never the newest), until `needed` bytes are free;
    each is renamed to a temp name first, as the pruning does."""
    for victim in _removable(root, _newest(root)):
        free = files.free_bytes(root)
        if free is None or free >= needed:
            return
        doomed = victim
        if not victim.name.startswith(ckpt.TMP_PREFIX):  # never half deleted under a checkpoint's name
            doomed = root / f"{ckpt.TMP_PREFIX}pruned-{victim.name}-{uuid.uuid4().hex}"
            os.replace(victim, doomed)
        ckpt._remove(doomed)


@dataclass
class _Disk:
    """A checkpoint root's disk as its saves see it: bytes free, the checkpoints held (oldest
    first, the newest last) and the leftovers' bytes."""

    free: int
    held: list[int] = field(default_factory=list)
    leftovers: int = 0

    @property
    def newest(self) -> int:
        return self.held[-1] if self.held else 0

    @property
    def room(self) -> int:
        """What a save may use: the free bytes, and all it may remove (all but the newest)."""
        return self.free + self.leftovers + sum(self.held[:-1])

    def fits(self, size: int, reserve: int) -> bool:
        """A save of `size` fits, and leaves `reserve` (the old newest may go once it is written)."""
        return self.room >= size and self.room - size + self.newest >= reserve

    def _clear(self, size: int) -> None:
        self.free, self.leftovers = self.free + self.leftovers, 0
        while self.free < size and len(self.held) > 1:
            self.free += self.held.pop(0)

    def save(self, size: int) -> None:
        self._clear(size)
        self.free -= size
        self.held.append(size)
        while len(self.held) > ckpt.KEEP:
            self.free += self.held.pop(0)

    def take(self, size: int) -> None:
        """Something else written to this disk (the export)."""
        self._clear(size)
        self.free -= size


def _look(root: Path) -> tuple[_Disk | None, Path | None]:
    """The disk of `root` now (None where its free space cannot be read) and the newest checkpoint."""
    free = files.free_bytes(root)
    newest = _newest(root)
    if free is None:
        return None, newest
    removable = _removable(root, newest)
    older = [p for p in removable if not p.name.startswith(ckpt.TMP_PREFIX)]
    held = [_bytes(p) for p in older] + ([_bytes(newest)] if newest is not None else [])
    return _Disk(free, held, sum(_bytes(p) for p in removable if p not in older)), newest


def _same_disk(a: Path, b: Path) -> bool:
    def device(path: Path) -> int:
        path = path.absolute()
        while not path.exists() and path != path.parent:
            path = path.parent
        return path.stat().st_dev
    return device(a) == device(b)


# --------------------------------------------------------------------------- the run's saves


@dataclass(frozen=True)
class Room:
    """One run's checkpoint root and the sizes that decide where its saves fit."""

    root: Path
    checkpoint: int  # bytes of one checkpoint (NOTE: [Checkpoint room])
    export: Path | None  # --export-hf
    weights: int  # bytes an export writes (NOTE: [Checkpoint room])
    export_here: bool  # the export goes to the checkpoints' disk
    exportable: bool  # the model is a Hugging Face model (--export-hf is a fix)

    @property
    def export_bytes(self) -> int:
        return self.weights if self.export is not None else 0

    @classmethod
    def of(cls, root: Path, model: torch.nn.Module, schedule, export: str | None) -> Room:
        from transformers import PreTrainedModel

        out = Path(export) if export else None
        return cls(root, checkpoint_bytes(model, schedule), out, export_bytes(model),
                   out is not None and _same_disk(out, root), isinstance(model, PreTrainedModel))

    def _size(self, disk: _Disk) -> int:
        return max(self.checkpoint, disk.newest)

    def _reserve(self, size: int) -> int:
        """What a periodic save leaves for the final state: with an export, the export where it goes to
        this disk (nothing where it goes to another); without, the final checkpoint."""
        return (self.export_bytes if self.export_here else 0) if self.export else size

    def _export_room(self) -> int | None:
        free = files.free_bytes(self.export)
        if free is None:
            return None
        return free + sum(_bytes(p) for p in self.export.glob("*.safetensors"))  # replaced by the export

    def _where(self, disk: _Disk, newest: Path | None, size: int) -> str:
        """The arithmetic: a checkpoint's size, the free space, what the newest and the rest hold."""
        beside = f", beside {newest.name} ({format_size(disk.newest)})" if newest is not None else ""
        more = disk.room - disk.free
        older = f" and {format_size(more)} in older checkpoints and leftovers" if more else ""
        return (f"a checkpoint of this run takes about {format_size(size, round_up=True)}, and the disk of {self.root} "
                f"has {format_size(disk.free)} free{beside}{older}")

    def _play(self, disk: _Disk, size: int, saves: list[int], final: int, export_room: int | None):
        """The saves played through: (periodic steps skipped, whether the export fits, whether the
        final checkpoint does)."""
        disk = _Disk(disk.free, list(disk.held), disk.leftovers)
        skipped, export_fits, final_fits = [], True, True
        for step in saves:
            if step != final:
                if disk.fits(size, self._reserve(size)):
                    disk.save(size)
                else:
                    skipped.append(step)
                continue
            if self.export is not None:
                if self.export_here:
                    export_fits = disk.room >= self.export_bytes
                    if export_fits:
                        disk.take(self.export_bytes)
                else:
                    export_fits = export_room is None or export_room >= self.export_bytes
            final_fits = disk.fits(size, 0)
        return skipped, export_fits, final_fits

    def _short(self, disk: _Disk, size: int, saves: list[int], final: int, export_room: int | None) -> int:
        """The fewest bytes more free on this disk with which every save fits."""
        def fits(extra: int) -> bool:
            more = _Disk(disk.free + extra, disk.held, disk.leftovers)
            skipped, export_fits, final_fits = self._play(more, size, saves, final, export_room)
            return not skipped and export_fits and final_fits
        low, high = 0, (ckpt.KEEP + 2) * size + self.export_bytes
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if fits(mid) else (mid + 1, high)
        return low

    def check(self, saves: list[int], final: int) -> list[str]:
        """Before the first step: the warning line for saves that will be skipped; raises
        `ResourceError` where the final state fits nowhere. `saves`: the steps this run saves at,
        `final` among them where the run ends at it."""
        disk, newest = _look(self.root)
        if disk is None or not saves:
            return []
        size = self._size(disk)
        export_room = self._export_room() if self.export is not None and not self.export_here else None
        skipped, export_fits, final_fits = self._play(disk, size, saves, final, export_room)
        if not skipped and export_fits and final_fits:
            return []
        where = self._where(disk, newest, size)
        short = format_size(self._short(disk, size, saves, final, export_room), round_up=True)
        if not export_fits:
            room = export_room if export_room is not None else disk.room
            raise ResourceError(f"the export needs about {format_size(self.export_bytes, round_up=True)} on the disk of "
                                f"{self.export}, which has {format_size(room)} for it; free space there, or pass an "
                                "--export-hf directory on a disk with room")
        if final in saves and not final_fits and self.export is None:
            export = (f", or pass --export-hf DIR to save the final weights ({format_size(self.weights, round_up=True)}) "
                      "there first") if self.exportable else ""
            raise ResourceError(f"{where}: not even the final checkpoint (step {final}) fits; free {short} there, pass "
                                f"a --checkpoint-dir on a disk with room{export}")
        what = []
        periodic = [s for s in saves if s != final]
        if skipped:
            keeping = "export" if self.export is not None and self.export_here else "checkpoint"
            which = "all" if len(skipped) == len(periodic) else f"{len(skipped)} of the {len(periodic)}"
            what.append(f"{which} periodic checkpoints will be skipped, to keep room for the final {keeping}")
        if final in saves and not final_fits:
            what.append(f"the final checkpoint will not fit beside the newest, so the final weights go to {self.export} "
                        "first")
        return [f"warning: {where}: {'; '.join(what)}; free {short} more there, or pass another --checkpoint-dir"]

    def periodic(self, step: int) -> str | None:
        """While training: None where the save of `step` fits (room made for it), else the line
        saying it is skipped."""
        disk, newest = _look(self.root)
        if disk is None:
            return None
        size = self._size(disk)
        if disk.fits(size, self._reserve(size)):
            make_room(self.root, size)
            return None
        keeping = (f", keeping room for the final {'export' if self.export is not None else 'checkpoint'}"
                   if disk.room >= size else "")
        stays = f"; {newest.name} stays the newest checkpoint" if newest is not None else ""
        return f"warning: checkpoint step {step} skipped: {self._where(disk, newest, size)}{keeping}{stays}"

    def before_export(self) -> None:
        """Make room for the export where it goes to the checkpoints' disk."""
        if self.export is not None and self.export_here:
            make_room(self.root, self.export_bytes)

    def final(self, step: int) -> str | None:
        """At the end: None to write the final checkpoint (room made for it), or, after an export,
        the line saying it does not fit (the export holds the final weights)."""
        disk, newest = _look(self.root)
        if disk is not None and self.export is not None and not disk.fits(self._size(disk), 0):
            resumes = (f"{self.root.parent} resumes from {newest.name}" if newest is not None
                       else f"{self.root.parent} holds no checkpoint")
            return (f"warning: the final checkpoint (step {step}) skipped: {self._where(disk, newest, self._size(disk))}; "
                    f"the final weights are in {self.export}, and {resumes}")
        if disk is not None:
            make_room(self.root, self._size(disk))
        return None

