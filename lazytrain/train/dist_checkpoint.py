"""Checkpoints of a run on several ranks, through torch.distributed.checkpoint (DCP).

NOTE: [Distributed checkpoints]
A run on several ranks saves its weights and optimizer state with `dcp.save`: every rank hands DCP
the entries it holds (`distributed_state`), and DCP's planner writes each entry once. With the
state replicated, every rank holds all of it: DCP keeps one copy of each tensor and spreads the
writing over the ranks. With sharded state (NOTE: [Sharded checkpoints] in runtime/sharded_state.py)
the masters and moments are `Shard(0)` DTensors and each rank writes its own pieces. Loading
(`read_state`) builds the tensors from the checkpoint's metadata, whole, so a checkpoint of any
number of ranks loads into a run of any number, one process included; the sharded layout's masters
and moments wait on the meta device until the trainer is bound, when each rank of a sharded run
reads only its pieces into its own tensors and one process reads them whole (`restore_optimizer`). Those functions are the only places that
know the layouts.

The keys are flattened: `model/<name>` (`model.state_dict()`), then either torch.optim's format
(`trainer.state_dict()`: `optimizer/state/<index>/<key>`, `optimizer/param_groups/<group>/<key>`)
or, with sharded state, `trainer.sharded_state_dict()`'s, by parameter name:
`sharded/state/<name>/<key>`, `sharded/param_groups/<group>/<key>`, without the masters where the
model's weights are them (its dtype: always in `lazytrain train`). A resumed run reads either
(`restore_optimizer` in loop.py): a sharded run turns torch.optim's format into whole entries by
name (`whole_state`); a replicated one reads the sharded layout through `load_sharded_state_dict`.

Everything around the tensors is as for one process (checkpoint.py): rank 0 makes the temp
directory and tells the others its name, every rank writes its DCP files into it, and after all
have written (a collective) rank 0 alone writes rng.pt (every rank's generator states), meta.json
(format 2, the sha256 of every file), renames the directory into place, writes LATEST and prunes.
The other ranks wait for the outcome, so a save that failed anywhere stops every rank with one
error. The checkpoint directory must be one filesystem all ranks see (one host; a shared
filesystem across hosts).
With sharded host weights (NOTE: [Sharded host weights] in runtime/host_weights.py) the `model/`
entries come from `sync_model()`, which gathers every streamed block's weights whole into the
model's parameters on every rank: for the save's duration (until the next step) each rank's host
holds them whole again, beside its pieces, in memory the plan does not count.
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
SHARDED_STATE = "sharded/state/"
SHARDED_GROUPS = "sharded/param_groups/"
SHARDED = "sharded"  # the key of `from_flat`'s optimizer state in the sharded layout
DEFERRED = "deferred"  # its key naming the checkpoint whose masters and moments are still to read


def distributed_state(trainer, model: torch.nn.Module) -> dict[str, Any]:
    """This rank's entries of a checkpoint, flat (NOTE: [Distributed checkpoints]): the model's
    weights after every pending update has landed, and the optimizer state."""
    trainer.sync_model()
    flat: dict[str, Any] = {MODEL + name: t.detach() for name, t in model.state_dict().items()}
    if trainer.sharded:
        optimizer = trainer.sharded_state_dict()
        prefix, groups = SHARDED_STATE, SHARDED_GROUPS
        for name, entry in optimizer["state"].items():  # the model's weights are the masters: not twice
            if flat[MODEL + name].dtype == entry["master"].dtype:
                del entry["master"]
    else:
        optimizer = trainer.state_dict()
        prefix, groups = STATE, GROUPS
    for index, entry in optimizer["state"].items():
        for key, value in entry.items():
            flat[f"{prefix}{index}/{key}"] = value
    for g, group in enumerate(optimizer["param_groups"]):
        for key, value in group.items():
            flat[f"{groups}{g}/{key}"] = value
    return flat


def from_flat(flat: dict[str, Any], model_keys: list[str] | None = None) -> tuple[dict, dict]:
    """`distributed_state`'s entries back as `(model_state, optimizer_state)` in torch's formats;
    `model_keys` orders the weights (module order)."""
    model, state, groups, sharded, sharded_groups = {}, {}, {}, {}, {}
    for key, value in flat.items():
        if key.startswith(MODEL):
            model[key[len(MODEL):]] = value
        elif key.startswith(STATE):
            index, name = key[len(STATE):].split("/", 1)
            state.setdefault(int(index), {})[name] = value
        elif key.startswith(GROUPS):
            g, name = key[len(GROUPS):].split("/", 1)
            groups.setdefault(int(g), {})[name] = value
        elif key.startswith(SHARDED_STATE):  # a parameter's name has no "/"; its entry's key none either
            name, k = key[len(SHARDED_STATE):].rsplit("/", 1)
            sharded.setdefault(name, {})[k] = value
        elif key.startswith(SHARDED_GROUPS):
            g, name = key[len(SHARDED_GROUPS):].split("/", 1)
            sharded_groups.setdefault(int(g), {})[name] = value
        else:
            raise CheckpointError(f"unexpected entry {key!r} in a distributed checkpoint")
    if model_keys is not None and sorted(model_keys) == sorted(model):
        model = {k: model[k] for k in model_keys}
    if sharded:
        return model, {SHARDED: {"state": sharded, "param_groups": [sharded_groups[g] for g in sorted(sharded_groups)]}}
    return model, {"state": dict(sorted(state.items())), "param_groups": [groups[g] for g in sorted(groups)]}


def read_state(path: Path, model_keys: list[str] | None = None) -> tuple[dict, dict]:
    """The weights and optimizer state of the DCP checkpoint at `path`, in this process alone (no
    collective; NOTE: [Distributed checkpoints]), whole, on the CPU, as saved. The sharded layout's
    large entries (masters and moments) stay on the meta device, shaped as saved, until
    `restore_optimizer` reads them, each rank only its pieces where the trainer shards its state;
    the optimizer state then names the checkpoint (`DEFERRED`)."""
    import torch.distributed.checkpoint as dcp

    from lazytrain.train.dcp_metadata import SafeReader

    reader = SafeReader(str(path))  # NOTE: [Untrusted DCP files] in dcp_metadata.py
    template, deferred = {}, {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if isinstance(meta, dcp.TensorStorageMetadata):
            large = key.startswith(SHARDED_STATE) and not key.endswith("/step")
            (deferred if large else template)[key] = torch.empty(meta.size, dtype=meta.properties.dtype,
                                                                 device="meta" if large else "cpu")
        else:
            template[key] = None  # a plain value (a hyperparameter), read as saved
    _load(template, path)
    model, optimizer = from_flat({**template, **deferred}, model_keys)
    if deferred:
        optimizer[SHARDED][DEFERRED] = str(path)
    return model, optimizer


def _load(template: dict[str, Any], path: Path | str) -> None:
    """`template`'s entries read from the checkpoint at `path`, in this process alone."""
    import torch.distributed.checkpoint as dcp

    from lazytrain.train.dcp_metadata import SafePlanner, SafeReader

    with warnings.catch_warnings():  # no_dist says it: DCP's notice that it loads in one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, storage_reader=SafeReader(str(path)), planner=SafePlanner(path), no_dist=True)


def save(root: str | Path, step: int, ranks: Ranks, *, trainer, model: torch.nn.Module, extra: dict,
         fingerprint: str, keep: int = 3, fields: dict | None = None) -> Path:
    """Save `step` from every rank (call it on all of them): `root/step-{step:08d}/` written and
    named in LATEST as `checkpoint.save_checkpoint` does (atomic, pruned to `keep`), with the
    weights and optimizer state through DCP (NOTE: [Distributed checkpoints])."""
    import torch.distributed.checkpoint as dcp

    from lazytrain.train.finite import labelled_state, param_names, refuse_nonfinite

    root = Path(root)
    state = distributed_state(trainer, model)
    with together(ranks, f"checking checkpoint step {step}"):  # NOTE: [Finite state] in finite.py: each rank its pieces
        refuse_nonfinite(step, labelled_state(*from_flat(state), param_names(trainer.m)))
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


def restore_optimizer(trainer, optimizer_state: dict, model_state: dict) -> None:
    """A checkpoint's optimizer state into `trainer`, whichever layout it was saved in and whether
    or not the trainer shards its state (NOTE: [Distributed checkpoints]): a collective when sharded."""
    if SHARDED in optimizer_state:
        sd = dict(optimizer_state[SHARDED])
        path = sd.pop(DEFERRED, None)
        if path is not None:
            sd["state"] = _read_deferred(trainer, sd["state"], path)
        for name, entry in sd["state"].items():  # saved once, as the model's weights
            entry.setdefault("master", model_state[name].reshape(-1))
        trainer.load_sharded_state_dict(sd)
    elif trainer.sharded:
        try:
            whole = trainer.whole_state(optimizer_state, model_state)
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"the checkpoint's optimizer state does not match this schedule's stages ({exc}); "
                                  "resume with the model and settings that wrote it") from None
        trainer.load_sharded_state_dict(whole)
    else:
        trainer.load_state_dict(optimizer_state)


def _read_deferred(trainer, state: dict, path: str) -> dict:
    """The masters and moments `read_state` left on the meta device: with sharded state, each rank
    reads only its pieces, straight into the trainer's own tensors (`dcp.load` into the DTensors of
    `sharded_state_dict()`: a collective); else whole, in this process."""
    if not trainer.sharded:
        return whole_sharded(state, path)
    import torch.distributed.checkpoint as dcp

    from lazytrain.train.dcp_metadata import SafePlanner, SafeReader

    wanted = _deferred(state)
    own = trainer.sharded_state_dict()["state"]
    template = {key: own[name][k] for key, (name, k) in wanted.items()}
    dcp.load(template, storage_reader=SafeReader(path), planner=SafePlanner(path))
    return _filled(state, wanted, template)


def whole_sharded(state: dict, path: str) -> dict:
    """The sharded layout's entries with the masters and moments `read_state` deferred read whole."""
    wanted = _deferred(state)
    template = {key: torch.empty(state[name][k].shape, dtype=state[name][k].dtype) for key, (name, k) in wanted.items()}
    _load(template, path)
    return _filled(state, wanted, template)


def _deferred(state: dict) -> dict[str, tuple[str, str]]:
    """Checkpoint key -> (parameter name, entry key) of every entry still on the meta device."""
    return {f"{SHARDED_STATE}{name}/{k}": (name, k) for name, entry in state.items()
            for k, t in entry.items() if torch.is_tensor(t) and t.is_meta}


def _filled(state: dict, wanted: dict, template: dict) -> dict:
    out = {name: dict(entry) for name, entry in state.items()}
    for key, (name, k) in wanted.items():
        out[name][k] = template[key]
    return out


def _finish(root: Path, tmp: Path, step: int, keep: int, rngs: list, needed: int, fingerprint: str, extra: dict,
            model_keys: list[str], world: int, fields: dict | None) -> Path:
    torch.save({**rngs[0], "ranks": rngs}, tmp / ckpt.RNG_FILE)
    files = tuple(sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != ckpt.META_FILE))
    return ckpt.commit_save(root, tmp, step, keep, fingerprint=fingerprint, extra=extra, files=files,
                            model_keys=model_keys, needed=needed,
                            fields={"format": ckpt.DCP_FORMAT, "world_size": world, **(fields or {})})
