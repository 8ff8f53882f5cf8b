"""The plan summary: per-stage decisions, predicted memory over the step, and the time split.

Built from a loaded schedule module alone, so `lazytrain inspect` needs neither the model nor the
solver. Deterministic (no timings of the compile itself), so golden tests can pin it.
"""

from __future__ import annotations

import math
from types import ModuleType

from lazytrain.ir.placement import Placement, describe
from lazytrain.units import format_size

_WIDTH = 40  # characters of the memory bar at the peak window
# NOTE: [Gradient clipping] in runtime/stepping.py
CLIPPING_TEXT = {
    "exact": "max_grad_norm clips by this step's global norm; host optimizer steps wait for the end of backward",
    "previous-norm": "max_grad_norm clips by the previous step's global norm; optimizer steps run during backward",
    "off": "no gradient clipping: bind refuses max_grad_norm",
}


def memory_name(device: str) -> str:
    """What the memory a plan budgets is called: the GPU's on CUDA; on the CPU, where one processor
    plays both the device and the host, the device's."""
    return "GPU" if device == "cuda" else "device"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _disk_text(predicted: dict) -> str:
    """The disk tier's bytes: held there, and read and written each step (NOTE: [Disk-resident states])."""
    nbytes = predicted.get("disk_bytes", 0)
    if not nbytes:
        return ""
    seconds = predicted.get("disk_s", 0.0)
    took = f"{seconds:.2f} s" if seconds >= 1 else _ms(seconds)
    return f"; disk {format_size(nbytes)} (read and written each step: {took} of the disk's time)"


def summary(schedule: ModuleType) -> str:
    m = schedule
    p = m.PREDICTED
    lines = [
        f"schedule for {m.SOURCE or '<in-memory model>'} (fingerprint {m.FINGERPRINT}), hardware {m.HARDWARE}",
        f"batch: {', '.join(f'{k}={d}{list(s)}' for k, (s, d) in m.BATCH.items())}",
        f"budget {format_size(m.BUDGET, round_up=True)}; predicted peak {format_size(m.PREDICTED_PEAK)} "
        f"({m.PREDICTED_PEAK / m.BUDGET:.0%} of budget); host {format_size(p['host_bytes'])}" + _disk_text(p),
        f"predicted step {_ms(m.PREDICTED_STEP_S)} = compute {_ms(p['compute_s'])} + recompute {_ms(p['recompute_s'])}"
        f" + exposed transfer {_ms(p['exposed_s'])} + optimizer {_ms(p['optimizer_s'])}",
        f"solver: {m.SOLVER['status']}, gap {m.SOLVER['gap']:.2%}" + (f" ({m.SOLVER['message']})" if m.SOLVER["message"] else ""),
        _states_line(m),
        f"gradient clipping: {m.CLIPPING} ({CLIPPING_TEXT[m.CLIPPING]})",
        *_ranks_line(m),
        "",
        "decisions per stage:",
    ]
    chosen = m.OPTIMIZER_STATES
    lines += [decision_line(s, s.placement, m.DEVICE, chosen, s.from_master) for s in m.STAGES]
    limited = [s for s in m.STAGES if s.limits]
    if limited:  # pass `limits`: decisions a stage can never take
        lines.append("what no plan can change:")
        for s in limited:
            lines += [f"{f'{s.index:>3} {s.name}' if i == 0 else '':<28}{note}" for i, note in enumerate(s.limits)]
    skipping = [s for s in m.STAGES if s.placement.recomputed and s.skips]
    if skipping:  # NOTE: [Skipped recompute] in analysis/remat.py
        lines.append(f"recompute before backward leaves out the linears no backward reads: stages "
                     f"{ranges([s.index for s in skipping])} ({', '.join(skipping[0].skips)} in stage {skipping[0].index})")
    counts = {}
    for e in m.EVENTS:
        counts[e.kind.value] = counts.get(e.kind.value, 0) + 1
    lines += ["", "events: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), "",
              f"predicted {memory_name(m.DEVICE)} memory per window (time order):"]
    top = max((b for _, b, _ in m.WINDOWS), default=1) or 1
    for label, nbytes, secs in m.WINDOWS:
        bar = "#" * round(_WIDTH * nbytes / top)
        lines.append(f"  {label:>5} {format_size(nbytes):>10} {_ms(secs):>12}  {bar}")
    return "\n".join(lines) + "\n"


def _ranks_line(m: ModuleType) -> list[str]:
    """With data parallel, one line: the plan above is each rank's (NOTE: [Data parallel] in runtime/data_parallel.py)."""
    n = getattr(m, "WORLD_SIZE", 1)
    if n == 1:
        return []
    if getattr(m, "SHARDED", False):  # NOTE: [Sharded state] in runtime/sharding.py
        return [f"data parallel over {n} ranks, state sharded: each runs this plan on its own batch, keeps 1/{n} of the "
                "master weights and optimizer states (the host and state figures above are one rank's), reduce-scatters "
                "the gradients and all-gathers the weights (in the predicted step)"
                + (f"; its host keeps 1/{n} of the streamed weights, all-gathered at every prefetch"
                   if getattr(m, "SHARDED_WEIGHTS", False) else "")]  # NOTE: [Sharded host weights]
    return [f"data parallel over {n} ranks: each runs this plan on its own batch; gradients are all-reduced over the "
            "ranks as each stage's backward ends (in the predicted step, where the profile has a link_bandwidth)"]


def chunk_text(stage) -> str:
    """How a chunked stage (an IR or a schedule's `Stage`) is cut, in words."""
    if stage.chunk_len:
        return f"{stage.chunks} chunks along tokens ({stage.chunk_len} positions of one row each)"
    return f"{stage.chunks} chunks along rows"


def decision_line(stage, placement: Placement, device: str, states: str, from_master: bool) -> str:
    """A stage's decisions in one line, which the schedule's header (codegen) and this summary both
    print; `stage` is the IR's or the schedule's (`describe` in ir/placement.py words the placement)."""
    return (f"{stage.index:>3} {stage.name:<24} kind {stage.kind}  weights {format_size(stage.param_bytes):>10} "
            + describe(placement, device, states, from_master, stage.chunks)
            + (f"; forward and backward in {chunk_text(stage)}" if stage.chunks > 1 else ""))


def _states_line(m: ModuleType) -> str:
    """AdamW state bytes by tier: resident stages (and shared weights) keep theirs on the GPU,
    streamed stages on the host; host-stepped stages' states are fp32 whatever was chosen."""
    per = {"32bit": 8.0, "8bit": getattr(m, "STATE_BYTES", 8.0)}
    gpu = sum(s.param_numel * per[s.states] for s in m.STAGES if not s.placement.streamed) + sum(
        math.prod(m.PLACEHOLDERS[p][2]) for p in m.SHARED) * per[getattr(m, "OPTIMIZER_STATES", "32bit")]
    host = sum(s.param_numel * per[s.states] for s in m.STAGES if s.placement.streamed)
    if getattr(m, "SHARDED", False):  # a rank's 1/N (NOTE: [Sharded state] in runtime/sharding.py)
        gpu, host = gpu / m.WORLD_SIZE, host / m.WORLD_SIZE
    fp32 = [s.index for s in m.STAGES if s.states == "32bit"]
    mixed = (f"; 32-bit on the host-stepped stages ({ranges(fp32)})"
             if getattr(m, "OPTIMIZER_STATES", "32bit") != "32bit" and fp32 else "")
    return (f"optimizer states ({getattr(m, 'OPTIMIZER_STATES', '32bit')} AdamW{mixed}): {memory_name(m.DEVICE)} "
            f"{format_size(gpu)}, "
            f"host {format_size(host)}")


def ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, k in enumerate(indices):
        if start is None:
            start = k
        if i + 1 == len(indices) or indices[i + 1] != k + 1:
            out.append(f"{start}-{k}" if k > start else f"{k}")
            start = None
    return ", ".join(out)
