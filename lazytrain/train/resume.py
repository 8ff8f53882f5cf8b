"""What a resumed run takes from its checkpoint, checked before any of it is applied.

- `check_records`: the records `lazytrain train` keeps in a checkpoint's `extra` (its LR schedule and
  scheduler, data position, world size and batch) have the types and ranges a save writes, before
  anything reads them (`settle` runs it first).
- `check_structure`: a checkpoint whose digests match can still belong to another model of the same
  fingerprint, or have been written by other code or by hand; every tensor and value it restores is
  compared with the model, the schedule, the data and the run's LR schedule before anything is
  copied, so a mismatch is one `CheckpointError` (resume_checks.py).
- `LrSchedule` / `settle`: the run's LR schedule is recorded in every checkpoint and kept on resume;
  a flag that would change it is refused unless `--new-lr-schedule` asks for the change.
- `trim_log`: the step log holds one record per step across resumes.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from lazytrain.errors import CheckpointError
from lazytrain.files import write_atomic
from lazytrain.train.checkpoint import LATEST_FILE, Checkpoint
from lazytrain.train.resume_checks import check_fit

DEFAULT_STEPS = 200
DEFAULT_LR = 3e-3
DEFAULT_MIN_LR_RATIO = 0.1


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

    def lr_at(self, step: int) -> float:
        """The learning rate after `step` steps, as the run's LambdaLR gives it."""
        return self.lr * lr_lambda(self.warmup_steps, self.steps, self.min_lr_ratio)(step)

    def describe(self) -> str:
        """As the flags that give it: `--lr 0.003 --warmup-steps 2 --steps 24 --min-lr-ratio 0.1`."""
        return " ".join(f"{_flag(f)} {getattr(self, f):g}" for f in ("lr", "warmup_steps", "steps", "min_lr_ratio"))


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warm-up to the peak LR, then cosine decay to `min_ratio` of it."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


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
    if found is not None:
        check_records(found)
    recorded = found.extra.get("lr_schedule") if found is not None else None
    if recorded is None:
        return _requested(args), None
    old = LrSchedule(**recorded)
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


# --------------------------------------------------------------------------- records


def _int(v, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _number(v, low: float = -math.inf, high: float = math.inf) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and low <= v <= high


def _bool(v) -> bool:
    return isinstance(v, bool)


def _rates(v) -> bool:
    return isinstance(v, list) and bool(v) and all(_number(x, 0.0) for x in v)


# Each record's entries: (check, what it must be), and the entries a save always writes.
_LR_RECORD = {"lr": (lambda v: _number(v, 0.0, 1.0) and v > 0, "a learning rate in (0, 1]"),
              "warmup_steps": (_int, "a number of steps"), "steps": (lambda v: _int(v, 1), "a number of steps"),
              "min_lr_ratio": (lambda v: _number(v, 0.0, 1.0), "a ratio in [0, 1]")}
# LambdaLR.state_dict()'s entries (`verbose`: torch before 2.7). load_state_dict sets each on the scheduler.
_SCHEDULER = {"base_lrs": (_rates, "a list of learning rates"), "_last_lr": (_rates, "a list of learning rates"),
              "last_epoch": (_int, "a step"), "_step_count": (_int, "a count"),
              "lr_lambdas": (lambda v: isinstance(v, list) and all(x is None for x in v), "a list of nulls"),
              "_get_lr_called_within_step": (_bool, "true or false"), "_is_initial": (_bool, "true or false"),
              "verbose": (_bool, "true or false")}
_DATA = {"version": (_int, "a version"), "epoch": (_int, "an epoch"), "row": (_int, "a row"),
         "seed": (_int, "a seed"), "shuffle_from": (lambda v: v in (0, 1, None) and not _bool(v), "0, 1 or null"),
         "seq_len": (lambda v: _int(v, 1), "a length"), "rows_per_epoch": (lambda v: _int(v, 1), "a number of rows"),
         "data_digest": (lambda v: isinstance(v, str), "a digest"),
         "packing": (_bool, "true or false"), "document_mask": (_bool, "true or false")}
_NEEDED = {"lr_schedule": tuple(_LR_RECORD), "scheduler": ("base_lrs", "_last_lr", "last_epoch"),
           "data": ("version", "epoch", "row", "seed", "seq_len", "rows_per_epoch", "data_digest")}


def check_records(found: Checkpoint) -> None:
    """Raise `CheckpointError` unless `found.extra` holds the records `lazytrain train` saves (its
    `_save`), each entry of the type and range a save writes: the LR schedule (absent in checkpoints
    written before it was recorded), the LR scheduler's state, the data position, the world size and
    one rank's batch."""
    extra = found.extra

    def refuse(what: str, value, want: str, missing: bool = False) -> CheckpointError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        said = f"no {what} ({want})" if missing else f"{what} = {shown}, not {want}"
        return CheckpointError(f"checkpoint {found.path} records {said}; delete it (and "
                               f"{found.path.parent / LATEST_FILE} if it names it) to resume from the previous one")

    for record, spec in (("lr_schedule", _LR_RECORD), ("scheduler", _SCHEDULER), ("data", _DATA)):
        if record == "lr_schedule" and extra.get(record) is None:
            continue
        value = extra.get(record)
        if not isinstance(value, dict):
            raise refuse(record, value, "a JSON object", missing=value is None)
        for key in _NEEDED[record]:
            if key not in value:
                raise refuse(f"{record}.{key}", None, spec[key][1], missing=True)
        for key, entry in value.items():
            if key not in spec:
                raise CheckpointError(f"checkpoint {found.path} records {record}.{key}, which this lazytrain does not "
                                      "know; resume with the lazytrain that wrote it")
            ok, want = spec[key]
            if not ok(entry):
                raise refuse(f"{record}.{key}", entry, want)
    if not _int(extra.get("world_size", 1), 1):
        raise refuse("world_size", extra.get("world_size"), "a number of ranks")
    batch = extra.get("rank_batch", [1, 1])
    if not (isinstance(batch, list) and len(batch) == 2 and all(_int(n, 1) for n in batch)):
        raise refuse("rank_batch", batch, "a batch shape [rows, positions]")


def check_structure(found: Checkpoint, prep, schedule) -> None:
    """Raise `CheckpointError` unless `found` fits this run (`prep`: preflight's `Prepared`) and
    `schedule` in every tensor and value it restores (resume_checks.py). Its LR state is checked
    against the schedule the checkpoint records (with --new-lr-schedule, the old one: the new one is
    applied after this check), or, for a checkpoint without one, the run's."""
    recorded = found.extra.get("lr_schedule")
    check_fit(found, prep, schedule, LrSchedule(**recorded) if recorded is not None else prep.lr)


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
