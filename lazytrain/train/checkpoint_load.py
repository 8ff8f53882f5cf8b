"""Reading the checkpoints `checkpoint.py` writes: the one ``LATEST`` names, every file checked
against its sha256 before anything is returned (the layout and the crash-safety argument are in
checkpoint.py's docstring).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file

from lazytrain.errors import CheckpointError, one_line
from lazytrain.train.checkpoint import (
    _DATA_FILES,
    DCP_FORMAT,
    DCP_METADATA,
    FORMAT_VERSION,
    LATEST_FILE,
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    Checkpoint,
    _meta_digest,
    _parse_step,
    _read_latest,
    _sha256_file,
    _step_dirs,
)


def holds_checkpoints(root: str | Path) -> bool:
    """Whether ``root`` holds a ``LATEST`` file or a checkpoint directory (even without ``LATEST``:
    a kill between a checkpoint's rename and the ``LATEST`` write leaves that)."""
    root = Path(root)
    return root.is_dir() and ((root / LATEST_FILE).exists() or bool(_step_dirs(root)))


def check_fingerprint(checkpoint: Checkpoint, fingerprint: str) -> None:
    """Raise ``CheckpointError`` unless ``checkpoint`` was written for ``fingerprint``."""
    if checkpoint.fingerprint != fingerprint:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} was written for model fingerprint {checkpoint.fingerprint}, "
            f"this run is {fingerprint}; resume with the same model and settings, or use a fresh "
            "checkpoint directory"
        )


def load_latest(root: str | Path, fingerprint: str | None) -> Checkpoint | None:
    """The checkpoint ``LATEST`` names, fully validated, or None if ``root`` holds none.

    ``fingerprint=None`` skips the fingerprint check, for a caller that knows the fingerprint only
    later (``check_fingerprint``).

    Without a ``LATEST`` file (a crash during the very first save, or a deleted one) the newest
    ``step-*`` directory is used: those only ever appear complete. Raises ``CheckpointError`` if
    ``LATEST`` is unreadable or names a missing directory, if a file is missing or its sha256
    does not match, if a field of meta.json or a generator state is not as a save writes it (checked
    before anything is returned, so nothing fails half way on resume), if the step in meta.json
    disagrees with the directory name, if a DCP checkpoint holds what lazytrain never writes (NOTE:
    [Untrusted DCP files] in dcp_metadata.py), or if the checkpoint was written for another fingerprint.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    if (root / LATEST_FILE).exists():
        name = _read_latest(root)
        path = root / name
        if not path.is_dir():
            raise CheckpointError(
                f"{root / LATEST_FILE} names {name}, but {path} does not exist; restore it, or "
                f"delete {root / LATEST_FILE} to resume from the newest remaining checkpoint"
            )
    else:
        dirs = _step_dirs(root)
        if not dirs:
            return None
        path = dirs[-1][1]
    return _load(path, fingerprint)


def _load(path: Path, fingerprint: str | None) -> Checkpoint:
    latest = path.parent / LATEST_FILE

    def corrupt(reason: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {path} is corrupt: {reason}; delete it (and {latest} if it names it) "
            "to resume from the previous one"
        )

    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise corrupt(f"{META_FILE} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise corrupt(f"{META_FILE} cannot be read ({exc})") from exc
    if not isinstance(meta, dict) or "digest" not in meta:
        raise corrupt(f"{META_FILE} has no digest")
    body = {k: v for k, v in meta.items() if k != "digest"}
    if _meta_digest(body) != meta["digest"]:
        raise corrupt(f"{META_FILE} digest mismatch")
    layout = body.get("format")
    if layout not in (FORMAT_VERSION, DCP_FORMAT):
        raise CheckpointError(
            f"checkpoint {path} has format {layout}, this lazytrain reads formats "
            f"{FORMAT_VERSION} and {DCP_FORMAT}; resume with the lazytrain that wrote it"
        )
    problem = _meta_problem(body)
    if problem is not None:
        raise corrupt(f"{META_FILE} {problem}")
    dir_step = _parse_step(path.name)
    if body["step"] != dir_step:
        raise corrupt(f"{META_FILE} says step {body['step']} but the directory is step {dir_step}")
    found = Checkpoint(step=dir_step, model_state={}, optimizer_state={}, extra={}, rng={},
                       fingerprint=body["fingerprint"], path=path)
    if fingerprint is not None:
        check_fingerprint(found, fingerprint)

    files = body["files"]
    # A DCP checkpoint's shard files are whatever its ranks wrote; all are listed with their sha256.
    needed = _DATA_FILES if layout == FORMAT_VERSION else (DCP_METADATA, RNG_FILE, *files)
    for fname in needed:
        if fname not in files:
            raise corrupt(f"{META_FILE} lists no sha256 for {fname}")
        if not (path / fname).is_file():
            raise corrupt(f"{fname} is missing")
        if _sha256_file(path / fname) != files[fname]:
            raise corrupt(f"{fname} sha256 mismatch")
    try:
        if layout == FORMAT_VERSION:
            model_state = load_file(str(path / MODEL_FILE))
            # weights_only: state dicts need nothing else, and it refuses arbitrary pickled code. mmap:
            # the tensors stay in the file's pages until read, so a rank of a sharded run that resumes
            # a whole-state checkpoint reads only its pieces (NOTE: [Sharded checkpoints] in
            # runtime/sharded_state.py), not the whole state; writes to them copy (a private mapping).
            optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True, mmap=True)
        else:
            from lazytrain.train import dcp_metadata
            from lazytrain.train.dist_checkpoint import read_state

            dcp_metadata.read_metadata(path, files)  # before torch reads a byte (NOTE: [Untrusted DCP files])
            with dcp_metadata.first_failure():
                model_state, optimizer_state = read_state(path, body.get("model_keys"))
        rng = torch.load(path / RNG_FILE, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:  # checksums matched, so the writer stored something unloadable
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded although its checksums match "
            f"({one_line(exc)}); keep only tensors and plain Python values in the optimizer state"
        ) from exc
    problem = _rng_problem(rng)
    if problem is not None:
        raise corrupt(f"{RNG_FILE} {problem}")
    keys = body.get("model_keys", [])
    if sorted(keys) != sorted(model_state):
        raise corrupt(f"{MODEL_FILE} does not hold the tensors {META_FILE} lists")
    return Checkpoint(
        step=dir_step,
        model_state={key: model_state[key] for key in keys},
        optimizer_state=optimizer_state,
        extra=body["extra"],
        rng=rng,
        fingerprint=body["fingerprint"],
        path=path,
    )


def _meta_problem(body: dict) -> str | None:
    """What in meta.json's fields is not as `commit_save` writes them, or None."""
    missing = [field for field in ("step", "fingerprint", "files", "extra") if field not in body]
    if missing:
        return f"has no {missing[0]}"
    step, files, keys = body["step"], body["files"], body.get("model_keys", [])
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"holds step {step!r}, not a step number"
    if not isinstance(body["fingerprint"], str):
        return f"holds the fingerprint {body['fingerprint']!r}, not a string"
    if not isinstance(files, dict):
        return f"lists its files' sha256 as a {type(files).__name__}, not a mapping of file names to sha256"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        return "lists its files' sha256 with names or digests that are not strings"
    outside = [name for name in files if Path(name).name != name or name in ("", ".", "..")]
    if outside:
        return f"lists the file {outside[0]!r}, outside the checkpoint directory"
    if not isinstance(body["extra"], dict):
        return f"holds extra as a {type(body['extra']).__name__}, not a dict"
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        return "lists the model's tensors as something else than names"
    return None


def _rng_problem(rng) -> str | None:
    """What in the saved generator states (this process's, and each rank's) would not restore, or
    None: each is set on a scratch generator here, so `restore_rng` cannot fail half way."""
    if not isinstance(rng, dict):
        return f"holds a {type(rng).__name__}, not generator states"
    ranks = rng.get("ranks")
    if ranks is not None and not isinstance(ranks, (list, tuple)):
        return f"holds the ranks' states as a {type(ranks).__name__}"
    for i, state in enumerate([rng, *(ranks or ())]):
        whose = "" if i == 0 else f" of rank {i - 1}"
        if not isinstance(state, dict):
            return f"holds the states{whose} as a {type(state).__name__}"
        try:
            torch.Generator().set_state(state["torch"])
        except (KeyError, TypeError, RuntimeError, ValueError) as exc:
            return f"holds no torch CPU generator state{whose} ({one_line(exc)})"
        try:
            random.Random().setstate(state["python"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            return f"holds no python random state{whose} ({one_line(exc)})"
        cuda = state.get("cuda")
        if cuda is not None and not (isinstance(cuda, (list, tuple)) and all(
                isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda)):
            return f"holds CUDA generator states{whose} that are not byte tensors"
    return None


