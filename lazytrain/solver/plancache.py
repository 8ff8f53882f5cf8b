"""Plans solved before, on disk: `solve` once per (stages, hardware, budget, gap).

The key is a SHA-256 of everything `solve` reads, written out canonically: every field of the
`Stages` (sizes, times, consumers, names: the graph's fingerprint, which the batch and the
optimizer options shape; `fused`, whether stage bodies are priced compiled), every field of the `Hardware` profile (the states' GPU rate included),
the budget, the gap, `FORMAT` and a hash of the step model's code (`code_digest`). Only plans the solver finished (status "optimal": within the gap)
are stored: a plan cut short by the time limit is solved again next time. The directory is
`$XDG_CACHE_HOME/lazytrain/plans` (else `~/.cache/lazytrain/plans`); `LAZYTRAIN_NO_CACHE=1` turns
the cache off. A file that cannot be read or written is ignored: the cache never fails a compile.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from lazytrain.errors import PlanError
from lazytrain.files import cache_dir, caching
from lazytrain.hardware import Hardware
from lazytrain.ir.placement import NAMESPACE, Placement
from lazytrain.ir.plan import Plan, SolverInfo
from lazytrain.ir.stages import Stages
from lazytrain.solver.solve import GAP, solve

FORMAT = 2  # bump when the plan's fields change meaning (2: each decision a placement's constructor call)


def code_digest() -> str:
    """A hash of the step model's code: every pass, the solver with its step rules, the analyses, the
    stages' IR, the hardware module (its reserves) and the runtime's sizes (the twins' piece size, the rings). A plan
    cached by other code may count memory another way (the bf16 rounding noise, say, added after
    plans were cached without it), so a change anywhere there is a new key: no hand bump to forget."""
    if _DIGEST:
        return _DIGEST[0]
    root = Path(__file__).resolve().parents[1]
    files = [f for folder in ("passes", "solver", "analysis") for f in sorted((root / folder).rglob("*.py"))]
    files += [root / "ir" / "stages.py", root / "hardware" / "__init__.py", root / "sizes.py"]
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    _DIGEST.append(h.hexdigest())
    return _DIGEST[0]


_DIGEST: list[str] = []


def enabled() -> bool:
    return caching()


def directory() -> Path:
    return cache_dir("plans")


def _canon(x):
    """A deterministic text form: fields by name, sets sorted, floats exact."""
    if dataclasses.is_dataclass(x):
        return [type(x).__name__] + [[f.name, _canon(getattr(x, f.name))] for f in dataclasses.fields(x)]
    if isinstance(x, (set, frozenset)):
        return sorted(_canon(v) for v in x)
    if isinstance(x, dict):
        return sorted([str(k), _canon(v)] for k, v in x.items())
    if isinstance(x, (tuple, list)):
        return [_canon(v) for v in x]
    if isinstance(x, float):
        return x.hex()
    if isinstance(x, enum.Enum):
        return x.value
    return x


def key(stages: Stages, hw: Hardware, budget: int, gap: float = GAP) -> str:
    text = json.dumps([FORMAT, code_digest(), _canon(stages), _canon(hw), int(budget), float(gap).hex()],
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _to_json(plan: Plan) -> dict:
    data = dataclasses.asdict(plan)
    data["decisions"] = [repr(p) for p in plan.decisions]  # as a schedule writes them: `Placement(...)`
    return data


def _placement(text) -> Placement:
    """A placement its `repr` wrote, evaluated back with only the placement types in scope. An entry
    written before placements had a type holds a dict of flags there: a miss (ValueError), as is any
    text that names no valid placement (PlacementError, from its constructors)."""
    if not isinstance(text, str) or not text.startswith("Placement("):
        raise ValueError(f"not a placement: {text!r}")
    p = eval(text, {"__builtins__": {}}, dict(NAMESPACE))  # no builtins: only the placement types are named
    if not isinstance(p, Placement):
        raise ValueError(f"not a placement: {text!r}")
    return p


def _from_json(data: dict) -> Plan:
    info = data["solver"]
    return Plan(
        decisions=tuple(_placement(d) for d in data["decisions"]),
        budget=data["budget"], peak_bytes=data["peak_bytes"], host_bytes=data["host_bytes"], step_s=data["step_s"],
        compute_s=data["compute_s"], recompute_s=data["recompute_s"], exposed_s=data["exposed_s"],
        optimizer_s=data["optimizer_s"], windows=tuple(tuple(w) for w in data["windows"]),
        solver=SolverInfo(**dict(info, times=tuple(tuple(t) for t in info["times"]))),
        disk_bytes=data.get("disk_bytes", 0), disk_s=data.get("disk_s", 0.0),
    )


def load(k: str) -> Plan | None:
    try:
        data = json.loads((directory() / f"{k}.json").read_text())
        if data.get("key") != k:  # a file renamed or written for other inputs
            return None
        return _from_json(data["plan"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, NameError, SyntaxError, PlanError):
        return None


def store(k: str, plan: Plan) -> None:
    d = directory()
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=d, suffix=".tmp", delete=False) as f:
            json.dump({"key": k, "plan": _to_json(plan)}, f)
        os.replace(f.name, d / f"{k}.json")  # atomic: a reader sees the old file or the new one
    except OSError:
        pass


def cached_solve(stages: Stages, hw: Hardware, budget: int, time_limit: float = 60.0, gap: float = GAP) -> Plan:
    """`solve`, or the plan it returned before for the same inputs."""
    if not enabled():
        return solve(stages, hw, budget, time_limit, gap)
    start = time.perf_counter()
    k = key(stages, hw, budget, gap)
    plan = load(k)
    if plan is not None:
        took = time.perf_counter() - start
        return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, seconds=took, times=(("plan cache", took),)))
    plan = solve(stages, hw, budget, time_limit, gap)
    if plan.solver.status == "optimal":
        store(k, plan)
    return plan
