"""What a resumed run takes from its checkpoint, checked before any of it is applied.

- `check_structure`: a checkpoint whose digests match can still belong to another model of the same
  fingerprint or have been written by other code; its weights (names, shapes, dtypes), optimizer
  state (groups, moments, step counts), LR-scheduler position and RNG states are compared with the
  model and schedule before anything is copied, so a mismatch is one `CheckpointError`.
- `LrSchedule` / `settle`: the run's LR schedule is recorded in every checkpoint and kept on resume;
  a flag that would change it is refused unless `--new-lr-schedule` asks for the change.
- `trim_log`: the step log holds one record per step across resumes.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from lazytrain.errors import CheckpointError
from lazytrain.files import write_atomic
from lazytrain.runtime.optim import master_dtype
from lazytrain.train.checkpoint import Checkpoint
from lazytrain.train.dist_checkpoint import SHARDED

DEFAULT_STEPS = 200
DEFAULT_LR = 3e-3
DEFAULT_MIN_LR_RATIO = 0.1
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # AdamW's per-parameter state tensors


# --------------------------------------------------------------------------- LR schedule


@dataclass(frozen=True)
class LrSchedule:
    """Linear warm-up to `lr`, then cosine decay to `min_lr_ratio * lr` at step `steps`. Field names
    are the `lazytrain train` flags that set them."""

    lr: float
    warmup_steps: int
    steps: int
    min_lr_ratio: float

    def record(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """As the flags that give it: `--lr 0.003 --warmup-steps 2 --steps 24 --min-lr-ratio 0.1`."""
        return " ".join(f"{_flag(f)} {getattr(self, f):g}" for f in ("lr", "warmup_steps", "steps", "min_lr_ratio"))


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _requested(args) -> LrSchedule:
    """A fresh run's schedule: the flags given, else their defaults."""
    steps = args.steps if args.steps is not None else DEFAULT_STEPS
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, steps // 10)
    return LrSchedule(lr=args.lr if args.lr is not None else DEFAULT_LR, warmup_steps=warmup, steps=steps,
                      min_lr_ratio=args.min_lr_ratio if args.min_lr_ratio is not None else DEFAULT_MIN_LR_RATIO)


def settle(args, found: Checkpoint | None) -> tuple[LrSchedule, str | None]:
    """The LR schedule this run follows, and a notice when a resume changes it.

    A resumed run keeps the schedule its checkpoint records; flags left out take the recorded
    values. A flag that differs is refused, unless `--new-lr-schedule` is given: then the recorded
    schedule with the given flags replaced applies from the checkpoint's step on. Checkpoints
    written before schedules were recorded follow the flags, as they always did.
    """
    recorded = found.extra.get("lr_schedule") if found is not None else None
    if recorded is None:
        return _requested(args), None
    try:
        old = LrSchedule(**recorded)
    except TypeError as exc:
        raise CheckpointError(f"checkpoint {found.path} records the LR schedule {recorded!r}, which this "
                              "lazytrain cannot read; resume with the lazytrain that wrote it") from exc
    given = {f: getattr(args, f) for f in ("lr", "warmup_steps", "steps", "min_lr_ratio")}
    changed = {f: v for f, v in given.items() if v is not None and v != getattr(old, f)}
    if not changed:
        return old, None
    flags = " ".join(f"{_flag(f)} {v:g}" for f, v in changed.items())
    if not args.new_lr_schedule:
        raise CheckpointError(
            f"{found.path.parent.parent} was trained on the LR schedule `{old.describe()}`; {flags} would "
            f"change it. Drop {', '.join(_flag(f) for f in changed)} to keep it, or pass --new-lr-schedule "
            f"to follow the new schedule from step {found.step}")
    new = replace(old, **changed)
    if new.steps < found.step:
        raise CheckpointError(f"--steps {new.steps} ends before the checkpoint's step {found.step}; pass "
                              f"--steps of at least {found.step}")
    return new, f"new LR schedule from step {found.step}: `{new.describe()}` (was `{old.describe()}`)"


# --------------------------------------------------------------------------- structure


def check_structure(found: Checkpoint, model: torch.nn.Module, schedule) -> None:
    """Raise `CheckpointError` unless `found` fits `model` (built on any device; only names, shapes and
    dtypes are read) and the optimizer groups of `schedule`, in every tensor it will restore."""
    where = f"checkpoint {found.path}"
    fix = "resume with the model and settings that wrote it, or use a fresh --checkpoint-dir"
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
    _check_optimizer(found, schedule, where, fix)
    scheduler = found.extra.get("scheduler")
    if not isinstance(scheduler, dict) or scheduler.get("last_epoch") != found.step:
        last = scheduler.get("last_epoch") if isinstance(scheduler, dict) else None
        raise CheckpointError(f"{where} is at step {found.step} but its LR scheduler at step {last}; {fix}")
    if not isinstance(found.extra.get("data"), dict):
        raise CheckpointError(f"{where} holds no data position; {fix}")
    rng = found.rng
    if not (isinstance(rng, dict) and isinstance(rng.get("torch"), torch.Tensor) and rng["torch"].dtype == torch.uint8
            and isinstance(rng.get("python"), (tuple, list))):
        raise CheckpointError(f"{where} holds no torch and python RNG states; {fix}")


def _check_optimizer(found: Checkpoint, schedule, where: str, fix: str) -> None:
    """Groups as the trainer builds them (one per stage, then the shared parameters), indices in that
    order, moments shaped like their parameters, step counts within the checkpoint's step."""
    groups = [list(stage.params) for stage in schedule.STAGES] + [list(schedule.SHARED)]
    state = found.optimizer_state
    if isinstance(state, dict) and SHARDED in state:  # NOTE: [Distributed checkpoints] in dist_checkpoint.py
        _check_sharded(found, state[SHARDED], schedule, groups, where, fix)
        return
    if not (isinstance(state, dict) and isinstance(state.get("state"), dict)
            and isinstance(state.get("param_groups"), list)):
        raise CheckpointError(f"{where} holds no optimizer state (state and param_groups); {fix}")
    saved = state["param_groups"]
    sizes = [len(g.get("params", ())) if isinstance(g, dict) else None for g in saved]
    if sizes != [len(g) for g in groups]:
        raise CheckpointError(f"{where} holds optimizer groups of {sizes} parameters, this schedule steps "
                              f"{[len(g) for g in groups]}; {fix}")
    names, index = {}, 0
    for group, mine in zip(saved, groups):
        if list(group["params"]) != list(range(index, index + len(mine))):
            raise CheckpointError(f"{where} numbers its optimizer parameters out of order; {fix}")
        names.update(zip(group["params"], mine))
        index += len(mine)
    for i, entry in state["state"].items():
        if i not in names or not isinstance(entry, dict):
            raise CheckpointError(f"{where} holds optimizer state for unknown parameter {i!r}; {fix}")
        shape = tuple(schedule.PLACEHOLDERS[names[i]][2])
        path = schedule.PLACEHOLDERS[names[i]][1]
        for key in _MOMENTS:
            if key in entry and (not isinstance(entry[key], torch.Tensor) or tuple(entry[key].shape) != shape):
                got = tuple(entry[key].shape) if isinstance(entry[key], torch.Tensor) else type(entry[key]).__name__
                raise CheckpointError(f"{where} holds the optimizer's {key} of {path} with shape {got}, "
                                      f"the parameter's is {shape}; {fix}")
        if "step" in entry:
            _check_step(found, entry["step"], path, where, fix)


def _check_sharded(found: Checkpoint, state: dict, schedule, groups: list, where: str, fix: str) -> None:
    """The sharded layout: an entry per parameter by its name in the model, each flattened whole."""
    numel = {schedule.PLACEHOLDERS[p][1]: math.prod(schedule.PLACEHOLDERS[p][2]) for g in groups for p in g}
    entries = state.get("state") if isinstance(state.get("state"), dict) else {}
    if sorted(entries) != sorted(numel) or len(state.get("param_groups", ())) != len(groups):
        raise CheckpointError(f"{where} holds optimizer state for {len(entries)} parameters in "
                              f"{len(state.get('param_groups', ()))} groups, this schedule steps {len(numel)} in "
                              f"{len(groups)}; {fix}")
    for name, entry in entries.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            if key == "master" and isinstance(entry, dict) and key not in entry:
                continue  # the model's weights are the masters
            t = entry.get(key) if isinstance(entry, dict) else None
            if not isinstance(t, torch.Tensor) or t.numel() != numel[name]:
                raise CheckpointError(f"{where} holds no whole {key} of {name} ({numel[name]} elements); {fix}")
        _check_step(found, entry.get("step"), name, where, fix)


def _check_step(found: Checkpoint, step, who: str, where: str, fix: str) -> None:
    """An optimizer step count within the checkpoint's step."""
    value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if not isinstance(value, (int, float)) or not 0 <= value <= found.step:
        raise CheckpointError(f"{where} is at step {found.step} but the optimizer state of {who} at step {value!r}; {fix}")


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- log


def trim_log(path: Path, step: int) -> None:
    """Keep one record per step, for steps 1..`step`, in a JSONL step log (the last record of a step
    wins; a line torn by a kill is dropped). Rewritten atomically; anything but a regular file (a
    terminal, a pipe) is left alone. A run resumed from step N then appends N+1, N+2, ..."""
    path = Path(path).resolve()
    if not path.is_file():
        return
    records: dict[int, str] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                n = json.loads(line).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(n, int) and 1 <= n <= step:
                records[n] = line.rstrip("\n") + "\n"
    text = "".join(records[n] for n in sorted(records))
    if text.encode("utf-8") != path.read_bytes():
        write_atomic(path, text)
