"""The MIP of pass `solve`: its binaries per stage, the step model's windows priced and bounded, and a
solution read back as a `Plan`.

NOTE: [The step model]
Windows are the stages' compute phases in time order: F0..F(S-1), B(S-1)..B0, plus `pre` (before
F0) and `tail` (after B0), which hide nothing. Per stage s:
  stream[s]     weights on the host, prefetched one window ahead (F(s-1), B(s+1)); grads offloaded
                during B(s-1); AdamW runs on the CPU, spread over the windows after that
  recompute[s]  internals recomputed at B(s) (else autograd keeps them from F(s) to B(s)); costs
                `remat_s`, less than `fwd_s` where backward reads nothing of some linears (NOTE: [Skipped recompute])
  off[s]        outputs offloaded during F(s+1)..F(cmax), reloaded during B(cmax+1)
  drop[s]       outputs freed after F(s+1) and recomputed at the top of their drop segment
  moved[s], dtiles[s]  integers, where the outputs are more than one tile: the tiles offloaded and,
                of those, the tiles on disk; the rest stay on the device (NOTE: [Boundary tiles] in boundary.py)
A chunked last stage (`chunks` > 1, pass `chunk`) runs forward and backward together, chunk by
chunk, at B(s): its compute moves there, it saves nothing from F(s) (saved_bytes 0, recompute 0)
and its working set at B(s) is one chunk's (its peak_bytes); the full-size gradient of its input is
its producers' grad_out, already counted from B(s) on.
An operator's own workspace beyond graph values (`internal_bytes`: cross-entropy's log-probabilities,
NOTE: [Operator workspace] in analysis/memory.py) is live at F(s) beside what the stage saves, and at B(s)
as their gradient; a chunked stage's one-chunk working set already holds its share.
Transfers are continuous volumes per window; a window's exposed time is the most its H2D, D2H, both
directions together, or CPU work overruns its compute (DESIGN.md). Memory per window is the sum of
the buffers `lower` keeps live there, so `verify` can check the plan event by event.
A fixed plan (the heuristic fallback) is evaluated by the same model with its binaries pinned.

NOTE: [GPU-stepped streamed stages]
gstep[s] (only with stream[s]) moves a streamed stage's AdamW step from the CPU to the GPU. Its
gradients still go to the host during B(s-1); the update itself waits for the next step's prefetch
at F(s-1): the fp32 master, the optimizer states and the gradient come in (instead of the bf16
weights), the GPU steps them and writes the new compute-dtype weights into the stage's slot, and
the master, states and new weights go back out during F(s). With ahead[s] the prefetch starts at
F(s-2) instead (the weights' and optimizer's slots are live a window longer). Gradient clipping's global norm is
known by then, and nothing waits for the host. Cost: (master + states) more bytes each way, an
`opt:S` buffer (`gpu_step_bytes`) at F(s-1) and F(s), and the GPU's step rate instead of the CPU's.

NOTE: [GPU-step lag]
A GPU-stepped stage's forward needs its step done, and the step needs its fetch landed: the two
run one after the other. With the fetch one window ahead (F(s-1)) both must fit in that window, so
the step's time is charged there after the window's transfers (`lag`). Measured on the 7B bench at
24 GiB: the forward waited about 10 ms per block for this chain when the window model alone saw
the transfers hidden. Fetched two windows ahead (`ahead`), the fetch has landed when the step runs.
Either way the step runs on the compute stream, before its forward, in F(s-1): it counts once, in
series (`serial`), and it is compute-stream time of that window (`cap`), beside which the window's
transfers run, so the window lasts max(compute + step, transfers + lag). Charged beside the window's
transfers as well, a window bound by its transfers paid the step twice: the 14B at 24 GiB (8-bit,
bf16 masters, 45 GPU-stepped blocks) was predicted at 3.37 s and ran in 3.04 (H200, 2026-12-01);
its events' own timeline said 3.02.
The step also waits for the window's write-backs (`dlag`): the compute stream frees the previous
stage's optimizer slot, after its forward, once D2H has copied the master and states out of it
(NOTE: [Slots] in runtime/store.py), and D2H runs its copies in order. So the window lasts at
least D2H + step as well, in either mode. The 14B at 24 GiB (fused, 8a9c84f, H200, 2026-12-04)
ran each forward window in 33.9 ms, its events' timeline said 34.3 (a 12.6 ms step, then 21.6 ms
of write-back and outputs on D2H), and the window model, which saw 30.0 ms of H2D bind, predicted
the step 11 % short.

NOTE: [State precision per stage]
With `--optimizer-states 8bit` a stage's states are 8-bit wherever its step runs on the GPU
(resident, or GPU-stepped streamed), and 32-bit where it runs on the CPU: bitsandbytes' 8-bit step
has no fast host path (0.09 G params/s on the H200 machine's 16 cores, against 4.5 G for torch's
fused fp32 AdamW). So choosing where a stage steps also chooses its states' precision: `stream`
without `gstep` is a 32-bit host stage, with the CPU's fp32 rate and 8 bytes of host states per
parameter (`CPU_STATE_BYTES`); everything else uses `Stages.state_bytes` and the GPU's rate for the
chosen precision. Such a host stage moves only its weights and gradient, not its states, which is
what a link-bound forward needs.
"""

from __future__ import annotations

import mip
from mip import cbc as _cbc

# NOTE: [CBC deadlock guard] python-mip calls CBC through cffi's ABI mode, which resolves a C
# function on first use under cffi's non-reentrant lock. `mip.Model` objects sit in reference
# cycles; if the garbage collector first frees one while that lock is held, `__del__` asks for
# `Cbc_deleteModel` and the process hangs. Resolving it once here makes `__del__` lock-free.
if getattr(_cbc, "has_cbc", False):
    _cbc.cbclib.Cbc_deleteModel  # noqa: B018

from lazytrain.hardware import Hardware
from lazytrain.ir.placement import Internals, Outputs, Placement, Split, Step, Tier, Weights
from lazytrain.ir.plan import Plan, SolverInfo
from lazytrain.ir.stages import Stages
from lazytrain.passes.limits import limits
from lazytrain.solver import boundary
from lazytrain.solver import cuts as cuts_
from lazytrain.solver import milp
from lazytrain.solver.backlog import job_intervals
from lazytrain.solver.footprint import (
    can_put_outputs_on_disk,
    deferred_step_bytes,
    disk_gpu_state_bytes,
    disk_io_s,
    disk_master_bytes,
    can_cast,
    can_free_grads,
    disk_step_slot_bytes,
    disk_state_bytes,
    fixed_bytes,
    flush_bytes,
    resident_bytes,
    resident_grad_bytes,
    shared_grad_bytes,
    weights_from_master,
)
from lazytrain.solver.shards import sharded_deferred_bytes, sharded_tail, sharding
from lazytrain.solver.step_model import StepModel, byte_unit


# NOTE: [Disk steps not searched]
# The solver does not choose disk-stepped stages (NOTE: [Disk-stepped stages] in disk_model.py) yet;
# plans with them are evaluated (`evaluate`, the tests' forced plans) and the runtime runs them. On
# the H200 box (2026-12-01, bench/README.md) both searched plans that ran keep their GPU budgets,
# but neither is the truth yet: the 7B at 24 GiB on a 44 GB host took 4.47 s a step against 3.95
# predicted (5.08 before the jobs ran by deadline and read ahead), and the 32B at max on a 104 GB
# host 11.51 s against 10.72 with its host peak 1.2 GiB over the plan's (98.0 of 96.8 GiB, the
# reserve included), not yet explained. The 7B's remaining wait was a job released last and due
# first, behind a running one; with both in the plan (NOTE: [Jobs due in release order's reverse] in backlog.py),
# the two measured plans re-evaluate at 4.55 and 11.73 s, but plans made with them are unmeasured.
# A plan the runtime cannot keep is worse than a slower one, so the search keeps them out (`_build`
# bounds `dstep` at 0 unless the plan is fixed) until a searched plan holds on the device, host
# memory included.

# NOTE: [Backward steps where nothing else fits]
# Steps in backward (NOTE: [Backward steps] in step_model.py), and with the disk tier their states on
# disk (NOTE: [Backward steps from disk] in disk_model.py), are searched only where no plan without them fits
# the budget (then also by `smallest_budget`, so a refusal names the least with them). Stage outputs
# on disk (NOTE: [Activations on disk] there) were searched with them until their tiles were (NOTE:
# [Boundary tiles] in boundary.py): at 1 x 1,048,576 tokens with `--disk` the first search, without
# them, spent the whole time limit (60 s, HiGHS then CBC, 2026-12-04) failing to show that no plan
# fits, where with them it proves its plan in 0.26 s. They are priced like the rest (the disk's
# seconds in every window), so the search takes them where they are faster, with `--disk` only. On
# the H200 box (2026-12-01, bench/results/backward_steps) the 32B at max (16 x 1024, bf16 masters),
# where host memory does not bind, measured 8.97 s with them against 8.16 predicted, and the plan
# without them 8.72 s against 8.74: slower, and 10 % off their plan, where the windows are short for
# the state traffic they add. Where host memory binds they take the gradient buffer off the host:
# the 32B with fp32 masters at 32 x 1024 fits the whole device only with them, and its plan (42 of
# 64 blocks stepped in backward) measured 15.29 s against 14.47 predicted (4bbf465, bench/README.md).
SEARCH_BACKWARD_STEPS = False
FLOOR_WEIGHT = 1e-7  # per `unit` of bytes: under 1e-4 of a step for any plan (NOTE: [Floor variables])
# the binaries per stage
KEYS = ("stream", "recompute", "off", "drop", "gstep", "ahead", "disk", "dstep", "bstep", "bdisk", "adisk", "mdisk", "free",
        "cast")


def _vars(m: mip.Model, stages: Stages, hw: Hardware):
    S = len(stages)
    v = {k: [m.add_var(f"{k}{s}", var_type=mip.BINARY) for s in range(S)] for k in KEYS}
    closed = limits(stages)  # the decisions a stage can never take (pass `limits`)
    v["R"] = [m.add_var(f"R{c}", lb=0.0) for c in range(S)]  # in `byte_unit` bytes (NOTE: [MIP scaling])
    unit = byte_unit(stages)
    for s, g in enumerate(stages):
        sig, rec, off, drop = v["stream"][s], v["recompute"][s], v["off"][s], v["drop"][s]
        m += off + drop <= 1
        m += v["gstep"][s] + v["dstep"][s] <= sig  # stepped on the GPU at its prefetch, or from disk
        m += v["ahead"][s] <= v["gstep"][s]
        m += v["disk"][s] <= sig - v["gstep"][s] - v["dstep"][s]  # host-stepped stages only
        # NOTE: [Backward steps]: GPU-stepped, fetched at the backward prefetch (not ahead), where the
        # step needs no global norm of this step, and the stage has a backward prefetch and a window after
        m += v["bstep"][s] <= v["gstep"][s] - v["ahead"][s]
        if stages.clipping == "exact" or sharding(stages) > 1 or s < 2 or s == len(stages) - 1:
            v["bstep"][s].ub = 0.0  # a bound, not a row: the exposure cuts then leave its mode out
        m += v["bdisk"][s] <= v["bstep"][s]  # NOTE: [Backward steps from disk] in disk_model.py
        m += v["mdisk"][s] <= v["bdisk"][s]  # NOTE: [Masters on disk] in disk_model.py: fp32 masters of 16-bit weights
        if not weights_from_master(stages, s):
            v["mdisk"][s].ub = 0.0
        m += v["adisk"][s] <= off  # NOTE: [Activations on disk] in disk_model.py: read back by the window before their reload
        if not can_put_outputs_on_disk(stages, s):
            v["adisk"][s].ub = 0.0
        # NOTE: [Resident gradients freed at their step] in footprint.py
        m += v["free"][s] <= 1 - sig
        if not can_free_grads(stages, hw, s, sharding(stages)):
            v["free"][s].ub = 0.0
        # NOTE: [Resident weights cast on use] in footprint.py: resident, recomputed, outputs not dropped
        m += v["cast"][s] <= 1 - sig
        m += v["cast"][s] <= rec
        m += v["cast"][s] <= 1 - drop
        if not can_cast(stages, s, sharding(stages)):
            v["cast"][s].ub = 0.0
        if s < 2:
            m += v["ahead"][s] == 0
        if closed[s].stream:
            m += sig == 0
        elif s < S - 1:
            # A streamed stage's weights leave between its forward and backward, but internals that
            # autograd saved are views of them: such a stage must recompute (the last stage's
            # weights stay from F to B, so it may save).
            m += sig <= rec
        if closed[s].recompute:
            m += rec == 0
        if closed[s].offload:
            m += off == 0
        # a saving stage's autograd graph holds its outputs on the GPU until its backward: moving
        # or dropping them would free nothing
        if g.chunks == 1 and g.consumers:
            m += off <= rec
            m += drop <= rec
        for c in g.consumers:
            m += off <= v["recompute"][c]
        if closed[s].drop:
            m += drop == 0
        else:
            m += drop <= v["recompute"][s + 1]
            m += drop <= 1 - sig
            for p in g.producers:
                m += drop <= 1 - v["off"][p]
    boundary.tile_variables(m, v, stages)  # NOTE: [Boundary tiles] in boundary.py
    m += v["R"][0] == 0
    # Without drop[c-1] the row must leave R[c] free: the least R[c-1] is at most the outputs of the
    # stages before c-1, so those and out[c-1] are a big enough M (a tighter one, a tighter relaxation).
    below = 0
    for c in range(1, S):
        below += stages[c - 1].out_bytes
        m += v["R"][c] >= v["R"][c - 1] + (stages[c - 1].out_bytes - below * (1 - v["drop"][c - 1])) / unit
    return v


def _exposure(m: mip.Model, model: StepModel, hw: Hardware, v, cuts: bool):
    modes = cuts_.modes(v)
    exposed = []  # seconds; the variables hold them in units of `unit_s`
    k = 1.0 / model.unit_s
    for t in range(len(model.cap)):
        e = m.add_var(f"exposed{t}", lb=0.0)
        h, d, c, cap, lag, dlag = model.h2d[t], model.d2h[t], model.cpu[t], model.cap[t], model.lag[t], model.dlag[t]
        m += e >= model.comm[t] * k - cap * k  # the ranks' collectives (NOTE: [Link bandwidth])
        m += e >= h * (k / hw.h2d_bandwidth) + lag * k - cap * k
        m += e >= d * (k / hw.d2h_bandwidth) + dlag * k - cap * k
        m += e >= (h + d) * (0.5 * k / hw.duplex_bandwidth) + lag * k - cap * k
        m += e >= c * k - cap * k
        m += e >= model.disk_io[t] * k - cap * k  # NOTE: [Backward steps from disk] in disk_model.py
        if isinstance(model.beside[t], mip.LinExpr):  # NOTE: [Device steps beside compute]
            m += e >= model.beside[t] * k
        if cuts:  # NOTE: [Exposure cuts] in cuts.py
            for load in (h * (k / hw.h2d_bandwidth) + lag * k, d * (k / hw.d2h_bandwidth) + dlag * k,
                         (h + d) * (0.5 * k / hw.duplex_bandwidth) + lag * k):
                cuts_.exposure_cut(m, v, e, load, cap * k, modes)
        exposed.append(e * model.unit_s)
    return exposed


def _build(stages, hw, budget, minimise_memory: bool, fixed: list[Placement] | None = None, cuts: bool = True,
           backward_steps: bool | None = None):
    """The MIP; `cuts`: with the valid rows of solver/cuts.py, which change no plan's value;
    `backward_steps`: whether the search may step blocks in backward (NOTE: [Backward steps where
    nothing else fits])."""
    m = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    m.verbose = 0
    m.threads = 1
    v = _vars(m, stages, hw)
    # NOTE: [Disk steps not searched], NOTE: [Backward steps where nothing else fits]: bounds at 0, as for the
    # choices a stage cannot take (`_vars`)
    backward_steps = SEARCH_BACKWARD_STEPS if backward_steps is None else backward_steps
    unsearched = ["dstep"] + ([] if backward_steps else ["bstep", "bdisk", "mdisk"])
    if fixed is None:
        for key in unsearched:
            for x in v[key]:
                if x is not None:
                    x.ub = 0.0
    if fixed is not None:
        for x, value in _start(v, fixed).items():
            m += x == value
    model = StepModel(stages, hw, v, m)
    exposed = _exposure(m, model, hw, v, cuts)
    intervals = job_intervals(model)  # NOTE: [Jobs due in release order's reverse] in backlog.py
    if intervals:
        block = m.add_var("job_block", lb=0.0)  # the longest disk-stepped job, in units of `unit_s`
        for *_, job in model.host_jobs:
            m += block >= job * (1.0 / model.unit_s)
        for work, windows in intervals:
            if isinstance(work, mip.LinExpr):
                m += work * (1.0 / model.unit_s) + block <= mip.xsum(
                    model.cap[t] * (1.0 / model.unit_s) + exposed[t] * (1.0 / model.unit_s) for t in windows)
    u = 1.0 / model.unit
    m += model.host * u <= hw.host_capacity * u
    m += model.disk * u <= hw.disk_bytes * u
    step = (model.compute + model.recompute + model.serial + mip.xsum(exposed)) * (1.0 / model.unit_s)
    if minimise_memory:
        peak = m.add_var("peak", lb=0.0)
        for t in model.mem + [model.tail]:
            m += t * u <= peak
        # Among the smallest plans, prefer the fastest.
        m.objective = mip.minimize(peak + 1e-6 * step)
    else:
        for t in model.mem + [model.tail]:  # NOTE: [Allocator reserve] in hardware/__init__.py
            m += t * u <= (budget - hw.allocator_reserve_bytes) * u
            if cuts:  # NOTE: [Memory cliques] in cuts.py
                cuts_.memory_clique(m, t * u, (budget - hw.allocator_reserve_bytes) * u)
        # NOTE: [Floor variables] `R`, `deferred_steps` and `host_step_buffers` stand for byte
        # counts that rows bound from below only, so at the optimum of `step` alone
        # the solver may leave them anywhere up to the budget, and the plan read from them said so
        # (a tiny model's window at 24 GiB - 512 B). A weight far below the gap pins them to their least.
        m.objective = mip.minimize(step + FLOOR_WEIGHT * mip.xsum(model.floors))
    return m, v, model, exposed


def _decisions(v, S, val) -> list[Placement]:
    """The placements the variables' values name (`_start` is the inverse)."""
    return [_placement({k: val(v[k][s]) > 0.5 for k in KEYS}, boundary.split_of(v, s, val)) for s in range(S)]


def _placement(on: dict[str, bool], split: Split | None = None) -> Placement:
    """One stage's placement from its binaries: `stream` picks resident or streamed weights, and a
    streamed stage's step kind is `dstep` (a job), `gstep` with `bstep` (in backward) or alone (at the
    prefetch), else a host step."""
    internals = Internals.RECOMPUTED if on["recompute"] else Internals.SAVED
    outputs = (Outputs.DISK if on["adisk"] else Outputs.OFFLOAD) if on["off"] else Outputs.DROP if on["drop"] else Outputs.KEEP
    tier = {False: Tier.HOST, True: Tier.DISK}
    if not on["stream"]:
        return Placement(Weights(cast_on_use=on["cast"]), internals, outputs, Step.resident(frees_grads=on["free"]), split)
    if on["dstep"]:
        step = Step.job()
    elif on["gstep"] and on["bstep"]:
        step = Step.in_backward(tier[on["bdisk"]], tier[on["mdisk"]])
    elif on["gstep"]:
        step = Step.at_prefetch()
    else:
        step = Step.host(tier[on["disk"]])
    return Placement(Weights(streamed=True, lookahead=2 if on["ahead"] else 1), internals, outputs, step, split)


def _start(v, decisions: list[Placement]) -> dict:
    """Each binary's value in `decisions` (a warm start, or the pinned values of a fixed plan): the
    inverse of `_decisions`."""
    values = {v[key][s]: float(value) for s, p in enumerate(decisions) for key, value in _binaries(p).items()}
    return values | boundary.tile_values(v, decisions)


def _binaries(p: Placement) -> dict[str, bool]:
    """One stage's binaries (`KEYS`) for its placement."""
    kind, step = p.kind, p.step
    return {
        "stream": p.streamed, "recompute": p.recomputed, "off": p.outputs.offloaded, "drop": p.outputs is Outputs.DROP,
        "gstep": kind in ("prefetch", "backward"), "ahead": p.weights.lookahead == 2,
        "disk": kind == "host" and step.states is Tier.DISK, "dstep": kind == "job", "bstep": kind == "backward",
        "bdisk": kind == "backward" and step.states is Tier.DISK, "adisk": p.outputs is Outputs.DISK,
        "mdisk": step.master is Tier.DISK, "free": step.frees_grads, "cast": p.weights.cast_on_use}


def _plan(stages, hw, budget, v, model, exposed, r: milp.Result, info: SolverInfo) -> Plan:
    def val(e) -> float:  # solver values carry tolerance noise: no negative seconds or bytes
        return max(0.0, milp.value(e, r))
    dec = _decisions(v, len(stages), val)
    mem = [int(round(val(t))) for t in model.mem]
    secs = [val(model.cap[t]) + val(exposed[t]) for t in range(len(mem))]
    beside = min(sum(val(b) for b in model.beside), sum(val(e) for e in exposed))
    tail = tail_bytes(stages, dec, hw)  # exact: the solver may leave its `deferred_steps` above their least
    edges = [("pre", 0, val(exposed[-2]))] + list(zip(model.L.labels(), mem, secs)) + [("tail", tail, val(exposed[-1]))]
    return Plan(
        decisions=tuple(dec), budget=budget, peak_bytes=max(mem + [tail]), host_bytes=int(round(val(model.host))),
        step_s=val(model.compute + model.recompute + model.serial + mip.xsum(exposed)),
        # the optimizer stream's share of the windows' exposure is the optimizer's, not the transfers'
        # (NOTE: [Device steps beside compute])
        compute_s=model.compute, recompute_s=val(model.recompute), exposed_s=max(0.0, sum(val(e) for e in exposed) - beside),
        optimizer_s=val(model.serial) + beside, windows=tuple(edges), solver=info,
        disk_bytes=int(sum(disk_bytes(stages, s, d) for s, d in enumerate(dec))),
        disk_s=sum(disk_io_s(disk_bytes(stages, s, d), hw) for s, d in enumerate(dec)),
    )


def disk_bytes(stages: Stages, s: int, p: Placement) -> int:
    """What stage `s` keeps on disk: a host-stepped stage's fp32 moments, a GPU-stepped stage's
    states (NOTE: [Disk-resident states], NOTE: [Disk-stepped stages] in disk_model.py), and its
    outputs between forward and backward (NOTE: [Activations on disk] there), and the master of a
    step in backward from disk (NOTE: [Masters on disk] there)."""
    g = stages[s]
    acts = boundary.disk_part_bytes(g, p.split) if p.outputs is Outputs.DISK else 0  # NOTE: [Boundary tiles]
    if p.step.states is not Tier.DISK:
        return acts
    master = disk_master_bytes(g) if p.step.master is Tier.DISK else 0
    # a host step's fp32 moments, or a device step's (a job's or one in backward) states as it keeps them
    return acts + master + (disk_state_bytes(g.param_numel) if p.kind == "host"
                            else disk_gpu_state_bytes(g.param_numel, stages.state_bytes))


def tail_bytes(stages: Stages, decisions, hw: Hardware) -> int:
    """GPU bytes after backward: resident weights, their gradients, and the steps gradient clipping
    defers until then (NOTE: [Resident steps])."""
    M = stages.master_bytes
    resident = [not p.streamed for p in decisions]
    n = sharding(stages)
    if n > 1:
        return sharded_tail(stages, hw, [int(r) for r in resident], sharded_deferred_bytes(stages, resident, n), n)
    # NOTE: [Flushed updates]
    flush = max((flush_bytes(stages, s) for s, p in enumerate(decisions) if p.kind == "prefetch"), default=0)
    slot = disk_step_slot_bytes(stages, decisions)  # NOTE: [Disk-stepped stages] in disk_model.py
    return fixed_bytes(stages) + hw.runtime_bytes + shared_grad_bytes(stages) + deferred_step_bytes(stages, resident) + flush + slot + sum(
        resident_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M) - (g.param_bytes if p.weights.cast_on_use else 0)
        + (0 if p.step.frees_grads else resident_grad_bytes(g.param_bytes, g.param_numel, M))
        for g, r, p in zip(stages, resident, decisions) if r)


