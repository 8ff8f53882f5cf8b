"""Checkpoints that lose nothing, and survive a kill -9 at any moment.

Layout under a checkpoint root::

    root/LATEST                  the name of the newest complete checkpoint, e.g. "step-00000012"
    root/step-00000012/
        model.safetensors        model weights, written one tensor at a time (tensor_file.py)
        optimizer.pt             optimizer state (torch.save)
        rng.pt                   torch CPU, CUDA (if initialised) and python `random` states
        meta.json                step, fingerprint, `extra`, sha256 of every file, own digest
    root/step-00000024/          a run on several ranks (format 2, NOTE: [Distributed checkpoints]
        .metadata, __0_0.distcp, ...   in dist_checkpoint.py): weights and optimizer state through
        rng.pt, meta.json              torch.distributed.checkpoint, RNG states of every rank
    root/.tmp-*                  leftovers of an interrupted save: ignored, removed by the next save

Crash safety comes from ordering: a checkpoint is written and fsynced in a temp directory,
renamed into place in one ``os.replace``, and only then named in ``LATEST`` (itself replaced
atomically). Until that last rename, ``LATEST`` still names the previous checkpoint, which is
untouched. ``load_latest`` (checkpoint_load.py) validates everything before returning, so nothing is applied half way,
and it never silently substitutes another checkpoint for the one ``LATEST`` names.

One process writes to a root at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lazytrain.errors import CheckpointError
from lazytrain.files import free_bytes, fsync_dir, is_disk_full, no_space
from lazytrain.train import tensor_file

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
META_FILE = "meta.json"
LATEST_FILE = "LATEST"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1
KEEP = 3  # checkpoints a root keeps (save_checkpoint's and dist_checkpoint.save's default)
DCP_FORMAT = 2  # written by several ranks through torch.distributed.checkpoint (dist_checkpoint.py)
DCP_METADATA = ".metadata"  # the file DCP's coordinator writes

_DATA_FILES = (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE)
_STEP_DIR = re.compile(r"step-(\d{8,})")


@dataclass(frozen=True)
class Checkpoint:
    """A fully validated checkpoint, held in memory (tensors on the CPU)."""

    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    extra: dict
    rng: dict
    fingerprint: str = ""
    path: Path | None = None


# --------------------------------------------------------------------------- small helpers


def dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _parse_step(name: str) -> int | None:
    """The step of a checkpoint directory name, or None if it is not one (exactly)."""
    match = _STEP_DIR.fullmatch(name)
    if match is None or dir_name(int(match.group(1))) != name:
        return None
    return int(match.group(1))


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Checkpoint directories under ``root``, oldest first."""
    found = []
    for entry in root.iterdir():
        step = _parse_step(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, entry))
    return sorted(found)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _meta_digest(body: dict) -> str:
    return hashlib.sha256(_canonical(body).encode()).hexdigest()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- what gets saved


def _check_extra(extra: dict) -> None:
    """``extra`` must come back from JSON exactly as given, or the resume would differ."""
    if not isinstance(extra, dict):
        raise CheckpointError(f"extra must be a dict, got {type(extra).__name__}")
    try:
        text = json.dumps(extra, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint extra is not JSON-serialisable ({exc}); keep plain numbers, strings, "
            "lists and dicts there and put tensors into optimizer_state"
        ) from exc
    if json.loads(text) != extra:
        raise CheckpointError(
            "checkpoint extra changes in a JSON round trip (a tuple, a non-string dict key or a "
            "NaN); use lists and string keys so that it is restored exactly"
        )


def _check_model_state(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`model_state` as names to detached tensors, each written as it is (NOTE: [Streamed weights
    files] in tensor_file.py)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model_state.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"model_state entry {name!r} is a {type(tensor).__name__}; model_state must map "
                "names to tensors (pass model.state_dict())"
            )
        out[name] = tensor.detach()
    return out


def _capture_rng() -> dict[str, Any]:
    # CUDA is only read when already initialised: reading it otherwise would create a context
    # on every GPU of a run that does not use them, and an unused generator has nothing to save.
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()}


def capture_rng() -> dict[str, Any]:
    """This process's torch CPU, CUDA (if initialised) and python ``random`` states."""
    return _capture_rng()


def restore_rng(checkpoint: Checkpoint, rank: int = 0) -> None:
    """Set the torch CPU, CUDA and python ``random`` generators back to the saved states.

    CUDA states are restored for the devices both runs have. A checkpoint of several ranks holds
    each rank's states (``ranks``); ``rank`` takes its own, or rank 0's where the run had fewer
    ranks (every rank of a fresh run starts from the same seed too).
    """
    rng = checkpoint.rng
    ranks = rng.get("ranks") or []
    if rank < len(ranks):
        rng = ranks[rank]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    cuda = rng.get("cuda")
    if cuda and torch.cuda.is_available():
        for index in range(min(len(cuda), torch.cuda.device_count())):
            torch.cuda.set_rng_state(cuda[index], index)


# --------------------------------------------------------------------------- LATEST


def _read_latest(root: Path) -> str:
    latest = root / LATEST_FILE
    try:
        text = latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{latest} cannot be read ({exc}); delete it to resume from the newest checkpoint"
        ) from exc
    if _parse_step(text) is None:
        raise CheckpointError(
            f"{latest} is corrupt: it holds {text[:40]!r}, not a name like step-00000012; "
            "delete it to resume from the newest checkpoint"
        )
    return text


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f"{TMP_PREFIX}LATEST-{uuid.uuid4().hex}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / LATEST_FILE)
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(root)


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state: a lower bound of what saving it writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


# --------------------------------------------------------------------------- save


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict,
    extra: dict,
    fingerprint: str,
    keep: int = KEEP,
) -> Path:
    """Write ``root/step-{step:08d}/`` atomically, point ``LATEST`` at it, prune, return its path.

    ``extra`` must be JSON data (data position, LR scheduler state, ...); it is checked to
    survive the round trip before anything is written. RNG states are captured here. Only the
    ``keep`` newest checkpoints (by step) survive, and never fewer than the one just written.
    Saving a step that ``LATEST`` already names is refused: replacing the latest checkpoint in
    place cannot be made atomic.
    """
    _check_save(step, keep, extra)
    tensors = _check_model_state(model_state)
    # NOTE: [Full disk] in files.py. Refused before writing when the tensors alone do not fit.
    needed = state_bytes(tensors) + state_bytes(optimizer_state) + (1 << 16)
    root = Path(root)
    tmp = begin_save(root, step, keep, extra, needed)
    try:
        tensor_file.write(tensors, tmp / MODEL_FILE)  # NOTE: [Streamed weights files] in tensor_file.py
        torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        torch.save(_capture_rng(), tmp / RNG_FILE)
    except BaseException as exc:
        raise save_failed(exc, root, step, needed, tmp)
    return commit_save(root, tmp, step, keep, fingerprint=fingerprint, extra=extra, files=_DATA_FILES,
                       model_keys=list(tensors), needed=needed)


def _check_save(step: int, keep: int, extra: dict) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if keep < 1:
        raise CheckpointError(f"keep must be at least 1, got {keep}")
    _check_extra(extra)


def _no_space_fix(root: Path) -> str:
    return f"; the previous checkpoint ({root / LATEST_FILE}) is intact"


def begin_save(root: Path, step: int, keep: int, extra: dict, needed: int) -> Path:
    """The checks before a save of ``step`` (the arguments, the latest checkpoint not replaced in
    place, ``needed`` bytes free) and the temp directory its files go into, which ``commit_save``
    renames into place (or ``save_failed`` removes)."""
    _check_save(step, keep, extra)
    root.mkdir(parents=True, exist_ok=True)
    name = dir_name(step)
    final = root / name
    if final.exists() and (root / LATEST_FILE).exists():
        try:
            latest = _read_latest(root)
        except CheckpointError:
            latest = None  # a corrupt LATEST is repaired by this save
        if latest == name:
            raise CheckpointError(
                f"checkpoint {final} already exists and {root / LATEST_FILE} names it; "
                "replacing the latest checkpoint in place is not crash safe, so save each "
                "step once"
            )
    free = free_bytes(root)
    if free is not None and free < needed:
        raise no_space(final, needed, _no_space_fix(root))
    # Not mkdtemp: its 0700 mode would carry over to the finished checkpoint.
    tmp = root / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex}"
    try:
        tmp.mkdir()
    except BaseException as exc:
        raise save_failed(exc, root, step, needed, tmp)
    return tmp


def save_failed(exc: BaseException, root: Path, step: int, needed: int, tmp: Path) -> BaseException:
    """What to raise for ``exc``, raised while writing ``tmp``, which is removed here: a full disk
    as ``no_space``, anything else as it is."""
    _remove(tmp)
    left = free_bytes(root)  # torch.save reports a full disk as "unexpected pos", without errno
    if isinstance(exc, Exception) and (is_disk_full(exc) or (left is not None and left < needed)):
        err = no_space(root / dir_name(step), needed, _no_space_fix(root))
        err.__suppress_context__ = True
        return err
    return exc


def commit_save(root: Path, tmp: Path, step: int, keep: int, *, fingerprint: str, extra: dict, files: tuple[str, ...],
                model_keys: list[str], needed: int, fields: dict | None = None) -> Path:
    """Finish a save whose ``files`` are written in ``tmp``: fsync them and record their sha256 in
    meta.json (with the step, fingerprint, ``extra``, ``model_keys``, ``fields`` and its own digest),
    rename ``tmp`` into place, point ``LATEST`` at it and prune to ``keep``."""
    name = dir_name(step)
    final = root / name
    try:
        digests = {}
        for fname in files:
            _fsync_file(tmp / fname)
            digests[fname] = _sha256_file(tmp / fname)
        body = {
            "format": FORMAT_VERSION,
            "step": step,
            "fingerprint": fingerprint,
            "extra": extra,
            "files": digests,
            # safetensors sorts names; the caller's order (module order) is kept here.
            "model_keys": model_keys,
            **(fields or {}),
        }
        meta = dict(body, digest=_meta_digest(body))  # guards meta.json itself
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():
            # A complete checkpoint that LATEST does not name (a crash hit between its rename
            # and the LATEST update): LATEST's checkpoint stays valid while it is swapped out,
            # and _prune deletes the old copy.
            os.replace(final, root / f"{TMP_PREFIX}replaced-{name}-{uuid.uuid4().hex}")
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException as exc:
        raise save_failed(exc, root, step, needed, tmp)
    try:
        _write_latest(root, name)
    except Exception as exc:
        if is_disk_full(exc):
            raise no_space(root / LATEST_FILE, len(name) + 1, f"; {final} is complete, but "
                           f"{root / LATEST_FILE} still names the previous checkpoint") from None
        raise
    _prune(root, keep, name)
    return final


def _prune(root: Path, keep: int, current: str) -> None:
    """Drop all but the ``keep`` newest checkpoints (always keeping ``current``) and leftovers
    of interrupted saves. Each victim is renamed to a temp name first, so a crash mid-delete
    never leaves a half-deleted directory under a checkpoint name."""
    dirs = _step_dirs(root)
    survivors = {path.name for _, path in dirs[-keep:]} | {current}
    for _, path in dirs:
        if path.name not in survivors:
            doomed = root / f"{TMP_PREFIX}pruned-{path.name}-{uuid.uuid4().hex}"
            os.replace(path, doomed)
            _remove(doomed)
    for entry in root.iterdir():
        if entry.name.startswith(TMP_PREFIX):
            _remove(entry)
