"""Forced plans for the compiler tests: decisions written as three letters a stage (`decisions`), made
valid by `repair`, and evaluated, lowered, verified and rendered as they are (`forced`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lazytrain.codegen.render import render
from lazytrain.ir.placement import Internals, Outputs, Placement, Step, Tier, Weights
from lazytrain.passes.lower import lower
from lazytrain.passes.verify import verify
from lazytrain.solver.footprint import can_put_outputs_on_disk
from lazytrain.solver.solve import evaluate


def builtin_schedule(tmp_path, spec, hw, compute: torch.dtype | None = None):
    """The built-in model's schedule (lazytrain/examples/tiny_qwen.py) with the disk tier on and
    clipping off, its decisions `spec(number of stages)`, written to `tmp_path / "s.py"`; `compute`:
    the dtype it is captured in."""
    from pathlib import Path

    import lazytrain.examples
    from lazytrain.ir.capture import check_batch
    from lazytrain.ir.model_file import build_on_meta, load_model_file
    from lazytrain.pipeline import analyse

    path = Path(lazytrain.examples.__file__).parent / "tiny_qwen.py"
    build, example = load_model_file(path)
    batch = check_batch(example())
    meta = build_on_meta(build)
    graph, stages = analyse(meta.to(compute) if compute else meta, batch, hw, str(path))
    stages = dataclasses.replace(stages, disk=True, clipping="off")
    schedule = tmp_path / "s.py"
    schedule.write_text(forced(graph, stages, batch, decisions(spec(len(stages))), hw).source_text)
    return schedule


# ---- forced plans --------------------------------------------------------------------------------

def producers(stages, s: int) -> set[int]:
    g = stages[s]
    return set(g.producers)


def repair(stages, raw) -> list[Placement]:
    """Turn any (stream, recompute, outputs[, gpu_step[, fetch ahead[, step in backward]]]) per stage into decisions
    that keep solve's rules:
    stream only with weights, and (but for the last stage) only when recomputing; chunked stages do
    not recompute; offload or drop only when the stage recomputes (a saving stage's autograd graph
    holds its outputs until its backward); offload only when every
    consumer recomputes and the last consumer is not the last stage; to disk only as offload, with
    the disk tier, and when the last consumer is stage S-3 or earlier; drop only for chain stages with
    resident weights whose next stage recomputes and none of whose producers offload."""
    S = len(stages)
    rec = [bool(r[1]) and stages[s].chunks == 1 for s, r in enumerate(raw)]
    # streamed stages recompute, but for the last (its weights stay from forward to backward)
    stream = [bool(r[0]) and stages[s].param_bytes > 0 and (rec[s] or s == S - 1) for s, r in enumerate(raw)]
    outs = [r[2] for r in raw]
    for s, g in enumerate(stages):
        if outs[s] is Outputs.DISK and not (stages.disk and can_put_outputs_on_disk(stages, s)):
            outs[s] = Outputs.OFFLOAD
        if outs[s] is not Outputs.KEEP and g.chunks == 1 and g.consumers and not rec[s]:
            outs[s] = Outputs.KEEP
        if outs[s].offloaded and (
                not g.consumers or g.consumers[-1] == S - 1 or not all(rec[c] for c in g.consumers)):
            outs[s] = Outputs.KEEP
        if outs[s] is Outputs.DROP and (not g.chain or stream[s] or not rec[s + 1]):
            outs[s] = Outputs.KEEP
    for s in range(S):
        if outs[s] is Outputs.DROP and any(outs[p].offloaded for p in producers(stages, s)):
            outs[s] = Outputs.KEEP
    gpu_step = [stream[s] and len(r) > 3 and bool(r[3]) for s, r in enumerate(raw)]
    ahead = [2 if gpu_step[s] and s >= 2 and len(r) > 4 and r[4] else 1 for s, r in enumerate(raw)]
    # a step in backward (NOTE: [Backward steps]): GPU-stepped, not ahead, not the first two or the last stage
    back = [gpu_step[s] and ahead[s] == 1 and 2 <= s < S - 1 and len(r) > 5 and bool(r[5]) for s, r in enumerate(raw)]
    internals = [Internals.RECOMPUTED if r else Internals.SAVED for r in rec]
    return [Placement(Weights(), internals[s], outs[s]) if not stream[s] else
            Placement(Weights(streamed=True, lookahead=ahead[s]), internals[s], outs[s],
                      Step.in_backward() if back[s] else Step.at_prefetch() if gpu_step[s] else Step.host())
            for s in range(S)]


# The first letter of a stage in `decisions`: its weights and its optimizer step's kind.
PLACES = {
    "-": (Weights(), Step.resident()),  # resident, stepped on the device as its backward ends
    "S": (Weights(streamed=True), Step.host()),  # streamed, stepped on the host
    "G": (Weights(streamed=True), Step.at_prefetch()),  # streamed, stepped on the device at its next prefetch
    "E": (Weights(streamed=True, lookahead=2), Step.at_prefetch()),  # G, fetched 2 windows ahead
    "B": (Weights(streamed=True), Step.in_backward()),  # streamed, stepped on the device right after its backward
    "D": (Weights(streamed=True), Step.host(Tier.DISK)),  # S, its states on disk
    "X": (Weights(streamed=True), Step.job()),  # streamed, stepped on the device by a job reading its states from disk
    "K": (Weights(streamed=True), Step.in_backward(Tier.DISK)),  # B, its states on disk
    "M": (Weights(streamed=True), Step.in_backward(Tier.DISK, Tier.DISK)),  # K, its fp32 master on disk too
}
INTERNALS = {"r": Internals.SAVED, "R": Internals.RECOMPUTED}
OUTPUTS = {"k": Outputs.KEEP, "o": Outputs.OFFLOAD, "d": Outputs.DROP, "f": Outputs.DISK}


def decisions(spec) -> list[Placement]:
    """Shorthand, three letters per stage -> its Placement: weights and step (`PLACES`: "-" resident,
    "S"/"G"/"E"/"B"/"D"/"X"/"K"/"M" streamed with the step kinds there), internals ("r" saved, "R"
    recomputed), outputs ("k" kept, "o" offloaded, "d" dropped, "f" offloaded on to the offload file).
    E.g. ["-Rd", "-Rd", "SRk"]: a dropped segment of two, then a streamed, recomputed stage. A
    combination no runtime path implements ("SRd": a streamed stage's outputs dropped) raises
    PlacementError here."""
    out = []
    for place, internals, outputs in spec:
        weights, step = PLACES[place]
        out.append(Placement(weights, INTERNALS[internals], OUTPUTS[outputs], step))
    return out


@dataclass(frozen=True)
class Forced:
    plan: object
    schedule: object
    trace: tuple[int, ...]
    source_text: str


def forced(graph, stages, batch, decs, hw, budget: int = 1 << 40, world_size: int = 1) -> Forced:
    """Evaluate fixed decisions, lower, verify at a budget of exactly the predicted peak, render
    (for `world_size` data-parallel ranks)."""
    plan = evaluate(stages, hw, budget, list(decs))
    schedule = lower(stages, plan, hw)
    trace = verify(dataclasses.replace(schedule, budget=plan.peak_bytes))
    text = render(graph, stages, plan, schedule, batch, hw.name, world_size=world_size)
    return Forced(plan, schedule, trace, text)
