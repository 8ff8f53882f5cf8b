"""Checkpoints of a run on several ranks, through torch.distributed.checkpoint (DCP).

NOTE: [Distributed checkpoints]
A run on several ranks saves its weights and optimizer state with `dcp.save`: every rank hands DCP
the entries it holds (`distributed_state`), and DCP's planner writes each entry once. Today every
rank holds the whole replicated state, so DCP keeps one copy of each tensor and spreads the writing
over the ranks; a sharded optimizer returns its shards from `distributed_state` (DTensors under the
same keys) and each rank writes its own. Loading (`read_state`) builds the tensors from the
checkpoint's metadata, whole, so a checkpoint of any number of ranks loads into a run of any number,
one process included; a sharded layout would pass its DTensor shards as `template` and DCP reads
just those slices. Those two functions are the only places that know the layout.

The keys are those of `model.state_dict()` and `trainer.state_dict()` (torch.optim's format),
flattened: `model/<name>`, `optimizer/state/<index>/<key>`, `optimizer/param_groups/<group>/<key>`.

Everything around the tensors is as for one process (checkpoint.py): rank 0 makes the temp
directory and tells the others its name, every rank writes its DCP files into it, and after all
have written (a collective) rank 0 alone writes rng.pt (every rank's generator states), meta.json
(format 2, the sha256 of every file), renames the directory into place, writes LATEST and prunes.
The other ranks wait for the outcome, so a save that failed anywhere stops every rank with one
error. The checkpoint directory must be one filesystem all ranks see (one host; a shared
filesystem across hosts).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from lazytrain.errors import CheckpointError
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.distributed import Ranks, from_rank0, gather_to_rank0, together

MODEL = "model/"
STATE = "optimizer/state/"
GROUPS = "optimizer/param_groups/"


def distributed_state(trainer, model: torch.nn.Module) -> dict[str, Any]:
    """This rank's entries of a checkpoint, flat (NOTE: [Distributed checkpoints]): the model's
    weights after every pending update has landed, and the optimizer state."""
    trainer.sync_model()
    flat: dict[str, Any] = {MODEL + name: t.detach() for name, t in model.state_dict().items()}
    optimizer = trainer.state_dict()
    for index, entry in optimizer["state"].items():
        for key, value in entry.items():
            flat[f"{STATE}{index}/{key}"] = value
    for g, group in enumerate(optimizer["param_groups"]):
        for key, value in group.items():
            flat[f"{GROUPS}{g}/{key}"] = value
    return flat


def from_flat(flat: dict[str, Any], model_keys: list[str] | None = None) -> tuple[dict, dict]:
    """`distributed_state`'s entries back as `(model_state, optimizer_state)` in torch's formats;
    `model_keys` orders the weights (module order)."""
    model, state, groups = {}, {}, {}
    for key, value in flat.items():
        if key.startswith(MODEL):
            model[key[len(MODEL):]] = value
        elif key.startswith(STATE):
            index, name = key[len(STATE):].split("/", 1)
            state.setdefault(int(index), {})[name] = value
        elif key.startswith(GROUPS):
            g, name = key[len(GROUPS):].split("/", 1)
            groups.setdefault(int(g), {})[name] = value
        else:
            raise CheckpointError(f"unexpected entry {key!r} in a distributed checkpoint")
    if model_keys is not None and sorted(model_keys) == sorted(model):
        model = {k: model[k] for k in model_keys}
    return model, {"state": dict(sorted(state.items())), "param_groups": [groups[g] for g in sorted(groups)]}


def read_state(path: Path, model_keys: list[str] | None = None, template: dict[str, Any] | None = None) -> tuple[dict, dict]:
    """The weights and optimizer state of the DCP checkpoint at `path`, in this process alone (no
    collective; NOTE: [Distributed checkpoints]). `template` (flat keys, as `distributed_state`)
    says what to read into; by default every entry whole, on the CPU, as saved."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(path))
    if template is None:
        template = {}
        for key, meta in reader.read_metadata().state_dict_metadata.items():
            if isinstance(meta, dcp.TensorStorageMetadata):
                template[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
            else:
                template[key] = None  # a plain value (a hyperparameter), read as saved
    with warnings.catch_warnings():  # no_dist says it: DCP's notice that it loads in one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, storage_reader=reader, no_dist=True)
    return from_flat(template, model_keys)


def save(root: str | Path, step: int, ranks: Ranks, *, trainer, model: torch.nn.Module, extra: dict,
         fingerprint: str, keep: int = 3, fields: dict | None = None) -> Path:
    """Save `step` from every rank (call it on all of them): `root/step-{step:08d}/` written and
    named in LATEST as `checkpoint.save_checkpoint` does (atomic, pruned to `keep`), with the
    weights and optimizer state through DCP (NOTE: [Distributed checkpoints])."""
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    state = distributed_state(trainer, model)
    # NOTE: [Full disk] in files.py: the whole state, as DCP writes one copy of each replicated entry
    needed = ckpt.state_bytes(state) + (1 << 16)
    tmp = Path(from_rank0(ranks, lambda: str(ckpt.begin_save(root, step, keep, extra, needed)),
                          f"preparing checkpoint step {step}"))
    try:
        with together(ranks, f"writing checkpoint step {step}"):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)))
        rngs = gather_to_rank0(ranks, ckpt.capture_rng(), f"gathering RNG states for checkpoint step {step}")
        with together(ranks, f"finishing checkpoint step {step}"):
            if ranks.main:
                final = _finish(root, tmp, step, keep, rngs, needed, fingerprint, extra, list(model.state_dict()),
                                ranks.world, fields)
    except BaseException as exc:
        if ranks.main:
            raise ckpt.save_failed(exc, root, step, needed, tmp) from None
        raise
    return root / ckpt.dir_name(step) if not ranks.main else final


def _finish(root: Path, tmp: Path, step: int, keep: int, rngs: list, needed: int, fingerprint: str, extra: dict,
            model_keys: list[str], world: int, fields: dict | None) -> Path:
    torch.save({**rngs[0], "ranks": rngs}, tmp / ckpt.RNG_FILE)
    files = tuple(sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != ckpt.META_FILE))
    return ckpt.commit_save(root, tmp, step, keep, fingerprint=fingerprint, extra=extra, files=files,
                            model_keys=model_keys, needed=needed,
                            fields={"format": ckpt.DCP_FORMAT, "world_size": world, **(fields or {})})
