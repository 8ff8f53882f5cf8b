"""Reading the checkpoints `checkpoint.py` writes: the one ``LATEST`` names, every file checked
against its sha256 before anything is returned (the layout and the crash-safety argument are in
checkpoint.py's docstring).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from lazytrain.errors import CheckpointError
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
    does not match, if the step in meta.json disagrees with the directory name, or if the
    checkpoint was written for another fingerprint.
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
            from lazytrain.train.dist_checkpoint import read_state

            model_state, optimizer_state = read_state(path, body.get("model_keys"))
        rng = torch.load(path / RNG_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # checksums matched, so the writer stored something unloadable
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded although its checksums match "
            f"({type(exc).__name__}: {exc}); keep only tensors and plain Python values in the "
            "optimizer state"
        ) from exc
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


