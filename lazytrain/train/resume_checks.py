"""A resumed run's checkpoint against the run, before any of it is applied (`check_fit`).

A checkpoint whose digests match can still belong to another model of the same fingerprint, or have
been written by other code or by hand (meta.json's digests are no seal: anyone can recompute them).
So every tensor and value that decides the next step is compared with what this run would have
saved at that step:

- weights: the model's names, shapes and the schedule's dtypes, and finite (NOTE: [Finite state] in
  finite.py);
- optimizer state: the groups as the trainer builds them (one per stage, then the shared
  parameters), every parameter's state at a step past 0 in its group's precision (AdamW's fp32
  `exp_avg` and `exp_avg_sq`; bitsandbytes' 8-bit `state1` and `state2` with their quantisation maps
  and block maxima, or fp32 ones below its 8-bit size), each shaped like its parameter and finite,
  step counts within the checkpoint's step, hyperparameters AdamW can step with;
- LR: the scheduler's peak and last LRs and every group's LR are what the run's LR schedule gives at
  the checkpoint's step;
- data position: inside its epoch, and exactly the rows that many global batches read.

The records' types were checked when the checkpoint was first read (`resume.check_records`).
"""

from __future__ import annotations

import math

import torch

from lazytrain.errors import CheckpointError
from lazytrain.runtime.optim import master_dtype
from lazytrain.train.checkpoint import LATEST_FILE, Checkpoint
from lazytrain.train.dist_checkpoint import SHARDED
from lazytrain.train.finite import diverged, first_nonfinite, labelled_state, param_names

_ADAMW = frozenset({"step", "exp_avg", "exp_avg_sq"})  # AdamW's state of a parameter (+ max_exp_avg_sq: amsgrad)
_BNB_NESTED = "__bnb_optimizer_quant_state__"  # bitsandbytes' state_dict() nests its 8-bit tensors under it
_BNB_MIN_8BIT = 4096  # bitsandbytes' min_8bit_size: smaller parameters keep fp32 state1 and state2
_BNB_BLOCK = 256  # elements per block maximum (absmax) of bitsandbytes' blockwise 8-bit state
_BNB_MAP = 256  # values of a quantisation map
_LR_REL = 1e-9  # the run computes each LR by one formula, so they agree to rounding


def check_fit(found: Checkpoint, prep, schedule, trained) -> None:
    """Raise `CheckpointError` unless `found` fits the model (`prep.meta_model`, built on any
    device; only names, shapes and dtypes are read), the optimizer groups of `schedule`, the LR
    schedule `trained` it was trained on, and the run's data and global batch (`prep`), in every
    tensor and value it restores."""
    where = f"checkpoint {found.path}"
    fix = "resume with the model and settings that wrote it, or use a fresh --checkpoint-dir"
    back = f"delete it (and {found.path.parent / LATEST_FILE} if it names it) to resume from the previous one"
    _check_weights(found, prep.meta_model, schedule, where, fix)
    groups = _check_optimizer(found, schedule, where, fix, back)
    _check_lr(found, groups, trained, where, fix, back)
    _check_data(found, prep.source.batch_shape[0], where, back)
    bad = first_nonfinite(labelled_state(found.model_state, found.optimizer_state, param_names(schedule)))
    if bad is not None:  # NOTE: [Finite state] in finite.py (the sharded layout's moments: when they are read)
        raise diverged(found.path, *bad)


def _check_weights(found: Checkpoint, model: torch.nn.Module, schedule, where: str, fix: str) -> None:
    own = model.state_dict()
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    missing = [k for k in own if k not in found.model_state]
    extra = [k for k in found.model_state if k not in own]
    if missing or extra:
        raise CheckpointError(f"{where} does not hold this model's weights: missing {_few(missing)}, "
                              f"unexpected {_few(extra)}; {fix}")
    for name, mine in own.items():
        saved = found.model_state[name]
        # NOTE: [Masters in the schedule's dtype] in runtime/optim.py
        want = master_dtype(schedule, mine.dtype) if name in params else mine.dtype
        if not isinstance(saved, torch.Tensor) or saved.shape != mine.shape:
            shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise CheckpointError(f"{where} holds {name} with shape {shape}, the model's is {tuple(mine.shape)}; {fix}")
        if saved.dtype != want:
            raise CheckpointError(f"{where} holds {name} as {_dtype(saved.dtype)}, the run keeps it in {_dtype(want)}; "
                                  f"{fix} (weights are never cast silently)")


def _check_optimizer(found: Checkpoint, schedule, where: str, fix: str, back: str) -> list[dict]:
    """The optimizer state in torch.optim's format (indices in the trainer's order) or the sharded
    layout; returns its parameter groups."""
    groups = [list(stage.params) for stage in schedule.STAGES] + [list(schedule.SHARED)]
    state = found.optimizer_state
    if isinstance(state, dict) and SHARDED in state:  # NOTE: [Distributed checkpoints] in dist_checkpoint.py
        return _check_sharded(found, state[SHARDED], schedule, groups, where, fix, back)
    saved = state.get("param_groups") if isinstance(state, dict) else None
    if not (isinstance(state, dict) and isinstance(state.get("state"), dict) and isinstance(saved, list)
            and all(isinstance(g, dict) for g in saved)):
        raise CheckpointError(f"{where} holds no optimizer state (state and param_groups); {fix}")
    indices = [g.get("params") for g in saved]
    if not all(isinstance(ix, list) and all(_is_int(i) for i in ix) for ix in indices):
        raise CheckpointError(f"{where} lists its optimizer parameters as something else than indices; {back}")
    if [len(ix) for ix in indices] != [len(g) for g in groups]:
        raise CheckpointError(f"{where} holds optimizer groups of {[len(ix) for ix in indices]} parameters, this "
                              f"schedule steps {[len(g) for g in groups]}; {fix}")
    kinds = [stage.states for stage in schedule.STAGES] + [getattr(schedule, "OPTIMIZER_STATES", "32bit")]
    names, kind, index = {}, {}, 0
    for ix, mine, k in zip(indices, groups, kinds):
        if ix != list(range(index, index + len(mine))):
            raise CheckpointError(f"{where} numbers its optimizer parameters out of order; {fix}")
        names.update(zip(ix, mine))
        kind.update(dict.fromkeys(ix, k))
        index += len(mine)
    for i, entry in state["state"].items():
        if i not in names or not isinstance(entry, dict):
            raise CheckpointError(f"{where} holds optimizer state for unknown parameter {i!r}; {fix}")
    missing = [i for i in names if i not in state["state"] or not state["state"][i]]
    if found.step > 0 and missing:
        first = schedule.PLACEHOLDERS[names[missing[0]]][1]
        raise CheckpointError(f"{where} is at step {found.step} but holds no optimizer state for {first} "
                              f"({len(missing)} of {len(names)} parameters): their moments would start again from "
                              f"zero; {back}")
    for i, entry in state["state"].items():
        placeholder = schedule.PLACEHOLDERS[names[i]]
        check = _check_8bit if kind[i] == "8bit" else _check_adamw
        check(found, entry, placeholder[1], tuple(placeholder[2]), where, back)
    for group in saved:
        _check_hyper(group, where, back)
    return saved


def _check_adamw(found: Checkpoint, entry: dict, name: str, shape: tuple, where: str, back: str) -> None:
    keys = set(entry)
    if not _ADAMW <= keys <= _ADAMW | {"max_exp_avg_sq"}:
        raise CheckpointError(f"{where} holds the optimizer state {sorted(keys)} for {name}, where AdamW keeps "
                              f"{sorted(_ADAMW)}; {back}")
    for key in sorted(keys - {"step"}):
        _check_tensor(entry[key], f"the optimizer's {key} of {name}", shape, torch.float32, where, back)
    _check_step(found, entry["step"], name, where, back)


def _check_8bit(found: Checkpoint, entry: dict, name: str, shape: tuple, where: str, back: str) -> None:
    """bitsandbytes' AdamW8bit state of one parameter (NOTE: [Shared quantisation maps] in runtime/optim8bit.py)."""
    nested = entry.get(_BNB_NESTED, {})
    flat = {**{k: v for k, v in entry.items() if k != _BNB_NESTED}, **(nested if isinstance(nested, dict) else {})}
    numel = math.prod(shape)
    small = numel < _BNB_MIN_8BIT
    need = {"step", "state1", "state2"} | (set() if small else {"qmap1", "qmap2", "absmax1", "absmax2"})
    if not isinstance(nested, dict) or not need <= set(flat) <= need | {"unorm_vec"}:
        raise CheckpointError(f"{where} holds the optimizer state {sorted(flat)} for {name}, where 8-bit AdamW keeps "
                              f"{sorted(need)}; {back}")
    for key in ("state1", "state2"):
        _check_tensor(flat[key], f"the optimizer's {key} of {name}", shape, torch.float32 if small else torch.uint8,
                      where, back)
    blocks = (-(-numel // _BNB_BLOCK),)
    for key, size in (("qmap1", (_BNB_MAP,)), ("qmap2", (_BNB_MAP,)), ("absmax1", blocks), ("absmax2", blocks),
                      ("unorm_vec", (1,))):
        if key in flat:
            _check_tensor(flat[key], f"the optimizer's {key} of {name}", size, torch.float32, where, back)
    _check_step(found, flat["step"], name, where, back)


def _check_tensor(t, what: str, shape: tuple, dtype: torch.dtype, where: str, back: str) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise CheckpointError(f"{where} holds {what} with shape {got}, the parameter's is {tuple(shape)}; {back}")
    if t.dtype != dtype:
        raise CheckpointError(f"{where} holds {what} as {_dtype(t.dtype)}, the optimizer keeps it in {_dtype(dtype)}; "
                              f"{back}")


def _check_hyper(group: dict, where: str, back: str) -> None:
    """AdamW's hyperparameters other than the LR (`_check_lr`): values it can step with."""
    for key in ("weight_decay", "eps"):
        if key in group and not _is_number(group[key], 0.0):
            raise CheckpointError(f"{where} holds the optimizer's {key} {group[key]!r}, not a finite number >= 0; "
                                  f"{back}")
    betas = group.get("betas", (0.9, 0.999))
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_number(b, 0.0) and b < 1 for b in betas)):
        raise CheckpointError(f"{where} holds the optimizer's betas {betas!r}, not two numbers in [0, 1); {back}")


def _check_sharded(found: Checkpoint, state: dict, schedule, groups: list, where: str, fix: str,
                   back: str) -> list[dict]:
    """The sharded layout: an entry per parameter by its name in the model, each flattened whole."""
    numel = {schedule.PLACEHOLDERS[p][1]: math.prod(schedule.PLACEHOLDERS[p][2]) for g in groups for p in g}
    entries = state.get("state") if isinstance(state, dict) and isinstance(state.get("state"), dict) else {}
    saved = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        saved = []
    if sorted(entries) != sorted(numel) or len(saved) != len(groups):
        raise CheckpointError(f"{where} holds optimizer state for {len(entries)} parameters in "
                              f"{len(saved)} groups, this schedule steps {len(numel)} in {len(groups)}; {fix}")
    for name, entry in entries.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            if key == "master" and isinstance(entry, dict) and key not in entry:
                continue  # the model's weights are the masters
            t = entry.get(key) if isinstance(entry, dict) else None
            if not isinstance(t, torch.Tensor) or t.numel() != numel[name]:
                raise CheckpointError(f"{where} holds no whole {key} of {name} ({numel[name]} elements); {fix}")
            if key != "master" and t.dtype != torch.float32:
                raise CheckpointError(f"{where} holds the optimizer's {key} of {name} as {_dtype(t.dtype)}, the "
                                      f"optimizer keeps it in float32; {back}")
        _check_step(found, entry.get("step"), name, where, back)
    for group in saved:
        _check_hyper(group, where, back)
    return saved


def _check_step(found: Checkpoint, step, who: str, where: str, fix: str) -> None:
    """An optimizer step count within the checkpoint's step."""
    value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if not _is_number(value) or not 0 <= value <= found.step:
        raise CheckpointError(f"{where} is at step {found.step} but the optimizer state of {who} at step {value!r}; "
                              f"{fix}")


def _check_lr(found: Checkpoint, groups: list[dict], trained, where: str, fix: str, back: str) -> None:
    """The scheduler's and every group's LR are `trained`'s at the checkpoint's step."""
    scheduler = found.extra["scheduler"]
    if scheduler["last_epoch"] != found.step:
        raise CheckpointError(f"{where} is at step {found.step} but its LR scheduler at step "
                              f"{scheduler['last_epoch']}; {fix}")
    peak, now = trained.lr, trained.lr_at(found.step)
    schedule = f"the run's LR schedule `{trained.describe()}`"
    if len(scheduler["base_lrs"]) != len(groups) or len(scheduler["_last_lr"]) != len(groups):
        raise CheckpointError(f"{where} holds an LR scheduler of {len(scheduler['base_lrs'])} groups, its optimizer "
                              f"has {len(groups)}; {back}")
    for lr in scheduler["base_lrs"]:
        if not _close(lr, peak):
            raise CheckpointError(f"{where} holds an LR scheduler peaking at {lr:g}, but {schedule} peaks at {peak:g}; "
                                  f"{back}")
    for lr in scheduler["_last_lr"]:
        if not _close(lr, now):
            raise CheckpointError(f"{where} holds an LR scheduler at LR {lr:g}, but {schedule} gives {now:g} at step "
                                  f"{found.step}; {back}")
    for g, group in enumerate(groups):
        for key, want in (("lr", now), ("initial_lr", peak)):
            if (key == "lr" or key in group) and not _close(group.get(key), want):
                raise CheckpointError(f"{where} holds optimizer group {g} at {key} {group.get(key)!r}, but {schedule} "
                                      f"gives {want:g} at step {found.step}; {back}")


def _check_data(found: Checkpoint, global_rows: int, where: str, back: str) -> None:
    """The data position lies inside its epoch, `found.step` global batches of `global_rows` rows in
    (the rows of each epoch are read through, into the next: data.py). Whether it was taken over this
    run's data is the data's own check (`PackedBatches.load_state_dict`)."""
    position = found.extra["data"]
    epoch, row, rows = position["epoch"], position["row"], position["rows_per_epoch"]
    if row >= rows:
        raise CheckpointError(f"{where} holds the data position row {row} of epoch {epoch}, past the {rows} rows of an "
                              f"epoch; {back}")
    read, want = epoch * rows + row, found.step * global_rows
    if read != want:
        raise CheckpointError(f"{where} is at step {found.step}, {want} rows in ({found.step} batches of "
                              f"{global_rows}), but its data position (epoch {epoch}, row {row} of {rows}) is {read} "
                              f"rows in; {back}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v, low: float = -math.inf) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= low


def _close(value, want: float) -> bool:
    return _is_number(value) and math.isclose(value, want, rel_tol=_LR_REL, abs_tol=0.0)


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
