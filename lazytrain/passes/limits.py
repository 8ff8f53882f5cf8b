"""Pass `limits`: the decisions a stage can never take, and why, as a side table.

Needs: `Stages` (after `chunk`). Guarantees: one `Limits` per stage, each field empty when the
decision is open to the solver, else the reason it is closed, in words for people. `solve` closes
exactly these decisions (its other rules tie decisions of several stages together); the schedule's
header and `lazytrain inspect` print the same words, so the reasons live here alone.

    prologue  shared="p_wte_weight stays resident: shared with stage 4 (tied weights are never streamed)"
    epilogue  recompute="its forward runs inside its backward, in 2 chunks of the batch (--loss-chunk-bytes)"
"""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain.ir.stages import Stages


@dataclass(frozen=True, slots=True)
class Limits:
    stream: str = ""  # why its weights cannot be streamed
    recompute: str = ""  # why its internals cannot be recomputed
    drop: str = ""  # why its outputs cannot be dropped and recomputed
    offload: str = ""  # why its outputs cannot be offloaded
    shared: str = ""  # weights it reads that stay resident whatever the plan (tied), if any

    def notes(self) -> tuple[str, ...]:
        """What `inspect` and the schedule header say about the stage's weights and internals."""
        return tuple(note for note in (self.stream and f"not streamed: {self.stream}",
                                       self.recompute and f"not recomputed: {self.recompute}", self.shared) if note)


_TIED = "tied weights are never streamed"


def _stages(indices) -> str:
    indices = sorted(indices)
    return ("stage " if len(indices) == 1 else "stages ") + ", ".join(str(i) for i in indices)


def limits(stages: Stages) -> tuple[Limits, ...]:
    S = len(stages)
    readers: dict[str, set[int]] = {}
    for g in stages:
        for p in g.placeholders:
            if p in stages.shared_params:
                readers.setdefault(p, set()).add(g.index)
    out = []
    for g in stages:
        shared = [p for p in g.placeholders if p in stages.shared_params]
        others = sorted({i for p in shared for i in readers[p]} - {g.index})
        names = ", ".join(shared)
        tied = f"{names} stay{'s' if len(shared) == 1 else ''} resident: shared with {_stages(others)} ({_TIED})"
        stream = ""
        if g.param_bytes == 0:
            stream = f"its only weights ({names}) are shared with {_stages(others)} ({_TIED})" if shared else "it has no weights"
        recompute = f"its forward runs inside its backward, in {g.chunks} chunks of the batch (--loss-chunk-bytes)" if g.chunks > 1 else ""
        if not g.consumers:
            drop = offload = "no later stage reads its outputs"
        else:
            drop = "" if g.chain else f"its outputs are read by {_stages(g.consumers)}, not by the next stage alone"
            offload = ("the last stage reads its outputs: its backward follows its forward, with no window to reload in"
                       if g.consumers[-1] == S - 1 else "")
        out.append(Limits(stream, recompute, drop, offload, tied if shared and not stream else ""))
    return tuple(out)


def limits_text(stages: Stages, table: tuple[Limits, ...]) -> str:
    """The table for `--dump-ir`: one line per closed decision."""
    lines = []
    for g, lim in zip(stages, table):
        for field in ("stream", "recompute", "drop", "offload", "shared"):
            if why := getattr(lim, field):
                lines.append(f"{g.index} {g.name} {field}: {why}")
    return "".join(f"# {line}\n" for line in lines)
