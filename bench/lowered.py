"""Forced plans of tiny models, lowered and rendered, and the solver's models, written to a directory:
a refactoring of the planner or of `lower` keeps every byte of them.

    python -m bench.lowered OUT_DIR [SETTINGS,...] [--ordered]   # 1-2 minutes on 2 cores, no GPU
    diff -r BEFORE_DIR AFTER_DIR             # run once on the code before, once after

For each case (a tiny model, its analysis settings and the decisions it forces, covering every
optimizer-step kind and tier: resident with gradients freed and weights cast on use, host with
states in memory and on disk, at the prefetch with 1 and 2 windows of lookahead, a job from disk,
in backward with states and masters on host or disk; outputs kept, offloaded, dropped and on disk,
whole and split by the tile;
fp32, bf16 compute with fp32 masters, bf16 masters, 8-bit states; clipping exact, previous-norm
and off; a chunked loss; tied weights; sharded and replicated data parallel over 2 and 4 ranks), it
writes:
  CASE.py     the schedule's full source (`tests/plans.forced`: evaluate, lower, verify at the
              predicted peak, render): every event, buffer, window and predicted time
  CASE.mip    the fixed plan's MIP as `evaluate` builds it: variables, rows and objective, and the
              step model's expressions the plan reads, each with its terms by variable (with
              `--ordered`, in the order they were added: the solver's answer does not depend on it,
              but the order of a sum's terms can move its last bit)
  CASE.err    instead of both, where the decisions are refused: the error's type and message
Per model it also writes the MIPs `solve` searches (`_build` with and without steps in backward)
and `smallest_budget` minimises, SETTINGS.search*.mip. Seeded draws add random decisions
(tests/plans.py `repair`, then disk kinds where the settings allow them): most valid, some refused.

It imports the tests' helpers (tests/models.py, tests/plans.py), so it runs from the repository root.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from pathlib import Path

import mip
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from lazytrain import hardware  # noqa: E402
from lazytrain.errors import LazytrainError  # noqa: E402
from lazytrain.ir.placement import Outputs, Step, Tier, Weights  # noqa: E402
from lazytrain.pipeline import analyse  # noqa: E402
from lazytrain.solver import boundary, formulation  # noqa: E402

TILE_BYTES = boundary.TILE_BYTES

HW = hardware.load("cpu")
# the optimizer stream beside compute, so resident gradients may be freed at their step
# (tests/test_resident_grads_freed.py)
HW_STREAM = dataclasses.replace(HW, gpu_step_lost=0.25, gpu_step_pace=0.35, gpu_adamw_params_per_s=1e15)


def _gpt(hw=HW, compute=None, layers=None, **settings):
    from lazytrain.examples import tiny_gpt
    from models import model_pair, token_batch

    build = tiny_gpt.build_model if layers is None else (lambda: tiny_gpt.TinyGPT(dim=tiny_gpt.DIM, layers=layers))
    meta, _ = model_pair(build)
    batch = token_batch(tiny_gpt.BATCH, tiny_gpt.SEQ, tiny_gpt.VOCAB)
    return meta.to(compute) if compute else meta, batch, hw, settings


def _blocks(tied: bool):
    from models import BlockSpec, ModelSpec, random_block_model

    spec = ModelSpec((BlockSpec("mlp", 24, "gelu"), BlockSpec("norm", 16, "relu"), BlockSpec("linear", 12, "tanh"),
                      BlockSpec("mlp", 16, "silu"), BlockSpec("linear", 16, "relu")), width=16, tied=tied, table="grad")
    meta, _, batch = random_block_model(spec)
    return meta, batch, HW, {}


def _cast(spec, stages=(1, 2)):
    from plans import decisions

    return [dataclasses.replace(d, weights=Weights(cast_on_use=True)) if s in stages else d
            for s, d in enumerate(decisions(spec))]


def _freeing(spec, stages=(2, 3, 4)):
    from plans import decisions

    return [dataclasses.replace(d, step=Step.resident(frees_grads=True)) if s in stages else d
            for s, d in enumerate(decisions(spec))]


def _split(spec, splits: dict):
    """`spec`'s decisions with the given stages' outputs split by the tile: {stage: (device, disk)}
    of 4 tiles (NOTE: [Boundary tiles] in lazytrain/solver/boundary.py; the setting's `boundary_tile`
    cuts each output in 4)."""
    from lazytrain.ir.placement import Split
    from plans import decisions

    return [dataclasses.replace(d, outputs=Outputs.DISK if splits[s][1] else Outputs.OFFLOAD, split=Split(*splits[s], 4))
            if s in splits else d for s, d in enumerate(decisions(spec))]


BASE = ["-rk", "GRk", "SRk", "GRk", "Srk"]
# name -> (model builder, stage settings, [(case name, decisions spec or callable)])
SETTINGS = {
    "gpt_exact": (lambda: _gpt(), {}, [
        ("mixed", BASE), ("resident", ["-rk"] * 5), ("host", ["-rk", "SRk", "SRk", "SRk", "Srk"]),
        ("prefetch", ["-rk", "GRk", "GRk", "GRk", "Grk"]), ("ahead", ["-rk", "GRk", "ERk", "ERk", "-rk"]),
        ("drop_segments", ["-Rd", "-Rd", "-Rk", "-Rd", "-Rk"]), ("offload", ["SRo", "SRo", "SRo", "SRk", "SRk"]),
        ("offload_drop", ["-Ro", "-Rk", "-Rd", "-Rd", "-Rk"]), ("drop_then_streamed", ["-Rd", "-Rd", "-Ro", "SRk", "-Rk"]),
        ("first_streamed", ["GRk", "SRk", "ERk", "-Rk", "-rk"]), ("backward_refused", ["-rk", "GRk", "BRk", "BRk", "-rk"])]),
    "gpt_off": (lambda: _gpt(), {"clipping": "off"}, [
        ("backward", ["-rk", "GRk", "BRk", "BRk", "-rk"]), ("mixed", BASE),
        ("all_kinds", ["SRk", "GRk", "BRk", "ERk", "-rk"]), ("ahead_backward", ["-rk", "SRk", "ERk", "BRk", "Grk"])]),
    "gpt_prev": (lambda: _gpt(), {"clipping": "previous-norm"}, [
        ("backward", ["-rk", "GRk", "BRk", "BRk", "-rk"]), ("mixed", BASE)]),
    "gpt_disk": (lambda: _gpt(), {"clipping": "off", "disk": True}, [
        ("job", ["-rk", "XRk", "SRk", "XRk", "-rk"]), ("host_disk", ["-rk", "DRk", "SRk", "DRk", "-rk"]),
        ("job_and_host_disk", ["XRk", "DRk", "XRk", "BRk", "Srk"]), ("in_memory", ["-rk", "GRk", "SRk", "GRk", "-rk"])]),
    "gpt_disk_exact": (lambda: _gpt(), {"disk": True}, [
        ("job", ["-rk", "XRk", "SRk", "XRk", "-rk"]), ("host_disk", ["-rk", "DRk", "SRk", "DRk", "-rk"])]),
    "gpt_disk_8bit": (lambda: _gpt(optimizer_states="8bit"), {"clipping": "off", "disk": True}, [
        ("job", ["-rk", "XRk", "SRk", "XRk", "-rk"]), ("prefetch", ["-rk", "GRk", "SRk", "GRk", "-rk"])]),
    "gpt6_disk": (lambda: _gpt(layers=6), {"clipping": "off", "disk": True}, [
        ("backward_disk", ["-rk", "GRk"] + ["KRk"] * 5 + ["-rk"]), ("backward", ["-rk", "GRk"] + ["BRk"] * 5 + ["-rk"]),
        ("acts_disk", ["-Rf"] * 5 + ["-Rk", "-Rk", "-rk"]), ("acts_offload", ["-Ro"] * 5 + ["-Rk", "-Rk", "-rk"]),
        ("mixed_disk", ["-rk", "XRk", "KRf", "DRk", "BRf", "ERk", "SRk", "-rk"])]),
    # each stage's outputs in 4 tiles: kept and host; kept, host and disk; host and disk; kept and disk
    "gpt6_tiles": (lambda: _gpt(layers=6), {"clipping": "off", "disk": True, "boundary_tile": 1024}, [
        ("split", lambda: _split(["-Ro"] * 5 + ["-Rk", "-Rk", "-rk"], {1: (1, 0), 2: (1, 2), 3: (0, 1), 4: (3, 1)})),
        ("split_streamed", lambda: _split(["-Ro", "SRo", "GRo", "BRo", "-Ro", "-Rk", "-Rk", "-rk"], {1: (2, 0), 3: (1, 1)}))]),
    "gpt6_disk_8bit": (lambda: _gpt(layers=6, optimizer_states="8bit"), {"clipping": "off", "disk": True}, [
        ("backward_disk", ["-rk", "GRk"] + ["KRk"] * 5 + ["-rk"]), ("jobs", ["-rk", "GRk"] + ["XRk"] * 5 + ["-rk"])]),
    "gpt6_bf16_disk": (lambda: _gpt(layers=6, compute=torch.bfloat16), {"clipping": "off", "disk": True}, [
        ("masters_disk", ["-rk", "GRk"] + ["MRk"] * 5 + ["-rk"]), ("states_disk", ["-rk", "GRk"] + ["KRk"] * 5 + ["-rk"]),
        ("mixed", ["-rk", "XRk", "MRk", "KRk", "BRk", "ERk", "DRk", "-rk"])]),
    "gpt_bf16": (lambda: _gpt(compute=torch.bfloat16), {"clipping": "off", "disk": True}, [
        ("cast", lambda: _cast(["-rk", "-Rk", "-Rk", "SRk", "-rk"])), ("kept", ["-rk", "-Rk", "-Rk", "SRk", "-rk"]),
        ("from_master_prefetch", ["-rk", "GRk", "GRk", "GRk", "-rk"]), ("from_master_ahead", ["-rk", "GRk", "GRk", "ERk", "-rk"]),
        ("from_master_backward", ["-rk", "GRk", "BRk", "BRk", "-rk"]), ("from_master_job", ["-rk", "XRk", "GRk", "XRk", "-rk"])]),
    "gpt_bf16_masters": (lambda: _gpt(compute=torch.bfloat16, master_weights="bf16"), {"clipping": "off"}, [
        ("prefetch", ["-rk", "GRk", "GRk", "GRk", "-rk"]), ("backward", ["-rk", "GRk", "BRk", "BRk", "-rk"]),
        ("host", ["-rk", "SRk", "SRk", "GRk", "Srk"])]),
    "gpt_bf16_masters_8bit": (lambda: _gpt(compute=torch.bfloat16, master_weights="bf16", optimizer_states="8bit"),
                              {"clipping": "off"}, [
        ("backward", ["-rk", "GRk", "BRk", "BRk", "-rk"]), ("host", ["-rk", "SRk", "ERk", "GRk", "Srk"])]),
    "gpt_freed": (lambda: _gpt(HW_STREAM), {"clipping": "off"}, [
        ("freed", lambda: _freeing(["-rk", "-rk", "-Rk", "-rk", "-rk"])), ("kept", ["-rk", "-rk", "-Rk", "-rk", "-rk"]),
        ("freed_mixed", lambda: _freeing(["-rk", "SRk", "-Rk", "-rk", "-rk"], (2, 3))),
        ("stream_mixed", ["-rk", "GRk", "BRk", "-Rk", "-rk"])]),
    "gpt_freed_prev": (lambda: _gpt(HW_STREAM), {"clipping": "previous-norm"}, [
        ("freed", lambda: _freeing(["-rk", "-rk", "-Rk", "-rk", "-rk"]))]),
    "gpt_chunked": (lambda: _gpt(loss_chunk_bytes=1), {}, [
        ("streamed_loss", ["-Rk", "SRk", "SRk", "-Rk", "Srk"]), ("gpu_loss", ["-Rk", "GRk", "ERk", "-Rk", "Grk"])]),
    "gpt_dp2": (lambda: _gpt(loss_chunk_bytes=1), {"world_size": 2, "sharded": True}, [
        ("mixed", BASE), ("resident", ["-rk"] * 5), ("ahead", ["-rk", "GRk", "ERk", "SRk", "Srk"]),
        ("host", ["SRk", "SRk", "SRk", "SRk", "Srk"]), ("prefetch", ["GRk", "GRk", "GRk", "GRk", "Grk"])]),
    "gpt_dp4": (lambda: _gpt(loss_chunk_bytes=1), {"world_size": 4, "sharded": True}, [("mixed", BASE)]),
    "gpt_dp2_replicated": (lambda: _gpt(loss_chunk_bytes=1), {"world_size": 2, "sharded": False, "clipping": "off"}, [
        ("mixed", BASE), ("backward", ["-rk", "GRk", "BRk", "BRk", "Srk"]), ("resident", ["-rk"] * 5)]),
    "blocks_tied": (lambda: _blocks(True), {"clipping": "off"}, [
        ("mixed", ["-Rk", "GRk", "SRk", "BRk", "ERk", "-rk", "-rk"])]),
    "blocks_tied_dp2": (lambda: _blocks(True), {"world_size": 2, "sharded": True}, [
        ("mixed", ["-Rk", "GRk", "SRk", "GRk", "ERk", "-rk", "-rk"])]),
}
RANDOM = 12  # seeded random decisions per setting


def _random_decisions(name: str, stages) -> list:
    """`RANDOM` seeded draws: tests/plans.py `repair` makes the axes valid (resident, host, at the
    prefetch, ahead, in backward), then some streamed stages take a disk kind their settings allow."""
    from plans import repair

    rng = random.Random(f"bench.lowered {name}")
    S, n = len(stages), stages.world_size if stages.sharded else 1
    disk_kinds = [] if not stages.disk or n > 1 else [Step.host(Tier.DISK), Step.job()]
    back_disk = [Step.in_backward(Tier.DISK), Step.in_backward(Tier.DISK, Tier.DISK)] if disk_kinds else []
    draws = []
    for _ in range(RANDOM):
        raw = [(rng.random() < 0.6, rng.random() < 0.8, rng.choice([Outputs.KEEP, Outputs.OFFLOAD, Outputs.DROP, Outputs.DISK]),
                rng.random() < 0.5, rng.random() < 0.3, rng.random() < 0.5) for _ in range(S)]
        decs = repair(stages, raw)
        for s, d in enumerate(decs):
            if d.streamed and d.weights.lookahead == 1 and rng.random() < 0.4:
                kinds = disk_kinds + (back_disk if d.kind == "backward" else [])
                if kinds:
                    decs[s] = dataclasses.replace(d, step=rng.choice(kinds))
        draws.append(decs)
    return draws


ORDERED = False  # `--ordered`: a MIP's terms in construction order, not by variable


def _terms(e) -> str:
    if isinstance(e, mip.Var):
        return e.name
    if isinstance(e, mip.LinExpr):
        terms = e.expr.items() if ORDERED else sorted(e.expr.items(), key=lambda t: t[0].idx)
        return f"{e.const!r} " + " ".join(f"{c!r}*{v.name}" for v, c in terms)
    return repr(e)


def _model_text(m: mip.Model, model) -> str:
    """The MIP (variables, rows, objective), then the step model's expressions a plan reads."""
    lines = [f"var {v.idx} {v.name} {v.var_type} [{v.lb!r}, {v.ub!r}]" for v in m.vars]
    lines += [f"row {i} {c.expr.sense} {_terms(c.expr)}" for i, c in enumerate(m.constrs)]
    lines.append(f"objective {_terms(m.objective)}")
    for key in ("mem", "cap", "lag", "h2d", "d2h", "cpu", "comm", "beside", "disk_io"):
        lines += [f"{key}[{t}] {_terms(e)}" for t, e in enumerate(getattr(model, key))]
    for key in ("tail", "host", "disk", "serial", "recompute", "compute"):
        lines.append(f"{key} {_terms(getattr(model, key))}")
    lines += [f"host_job {r} {d} {_terms(w)} | {_terms(j)}" for r, d, w, j in model.host_jobs]
    return "\n".join(lines) + "\n"


def _write_model(out: Path, stem: str, stages, hw, decs=None, **build) -> None:
    try:
        m, _, model, _ = formulation._build(stages, hw, 1 << 40, fixed=decs, **build)
    except LazytrainError as e:
        (out / f"{stem}.mip.err").write_text(f"{type(e).__name__}: {e}\n")
        return
    (out / f"{stem}.mip").write_text(_model_text(m, model))


def run(out: Path, only: str | None = None) -> None:
    from plans import decisions, forced

    out.mkdir(parents=True, exist_ok=True)
    for name, (build, settings, cases) in SETTINGS.items():
        if only and name not in only.split(","):
            continue
        meta, batch, hw, analysis = build()
        graph, stages = analyse(meta, batch, hw, **analysis)
        settings = dict(settings)
        boundary.TILE_BYTES = settings.pop("boundary_tile", TILE_BYTES)  # NOTE: [Boundary tiles]
        stages = dataclasses.replace(stages, **settings)
        world = stages.world_size
        for tag, build_kw in (("search", dict(minimise_memory=False)),
                              ("search_backward", dict(minimise_memory=False, backward_steps=True)),
                              ("search_memory", dict(minimise_memory=True, backward_steps=True))):
            _write_model(out, f"{name}.{tag}", stages, hw, **build_kw)
        all_cases = list(cases) + [(f"random{i:02d}", d) for i, d in enumerate(_random_decisions(name, stages))]
        for case, spec in all_cases:
            stem = f"{name}.{case}"
            try:
                decs = spec() if callable(spec) else decisions(spec) if isinstance(spec[0], str) else spec
                f = forced(graph, stages, batch, decs, hw, world_size=world)
            except LazytrainError as e:
                (out / f"{stem}.err").write_text(f"{type(e).__name__}: {e}\n")
                continue
            (out / f"{stem}.py").write_text(f.source_text)
            _write_model(out, stem, stages, hw, decs, minimise_memory=False)
        print(f"{name}: {len(all_cases)} cases", flush=True)
    boundary.TILE_BYTES = TILE_BYTES


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--ordered"]
    ORDERED = len(args) < len(sys.argv) - 1
    if not args:
        sys.exit(__doc__)
    os.environ.setdefault("LAZYTRAIN_NO_CACHE", "1")
    run(Path(args[0]), args[1] if len(args) > 1 else None)
