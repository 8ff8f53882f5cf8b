"""Sharded data-parallel state at compile time (NOTE: [Sharded state] in runtime/sharding.py), without ranks:
the schedule's REDUCE and GATHER events and the verifier's check of their order, the link in the
step model, per-rank host memory, the refusals, and bf16 rounding noise that a rank's piece draws as
the whole tensor would."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lazytrain import hardware
from lazytrain.errors import PlanError, VerifyError
from lazytrain.ir.events import Kind, Phase, Stream
from lazytrain.passes.lower import lower
from lazytrain.passes.verify import verify
from lazytrain.pipeline import analyse, compile_model, minimum_budget
from lazytrain.solver.solve import evaluate
from models import tiny_gpt_pair
from plans import decisions

GiB = 1 << 30


def _stages(world: int = 2, sharded: bool = True, hw=None):
    meta, _, batch = tiny_gpt_pair()
    _, stages = analyse(meta, batch, hw or hardware.load("cpu"), loss_chunk_bytes=1)
    return dataclasses.replace(stages, world_size=world, sharded=sharded)


def _schedule(hw=None):
    """Every parameter home: resident prologue with the shared embedding, GPU-stepped and host-stepped streamed blocks."""
    hw = hw or hardware.load("cpu")
    stages = _stages(hw=hw)
    plan = evaluate(stages, hw, 1 << 40, decisions(["-rk", "GRk", "SRk", "GRk", "Srk"]))
    return stages, lower(stages, plan, hw)


def test_reduce_and_gather_events_on_the_comm_stream():
    """One REDUCE per stage and for the shared weights, after that stage's backward; one GATHER per
    stage after its step (a streamed stage's at its forward, before the compute that reads it)."""
    stages, sched = _schedule()
    ev = sched.events
    S = len(stages)
    reduces = {e.stage: e for e in ev if e.kind is Kind.REDUCE}
    gathers = {e.stage: e for e in ev if e.kind is Kind.GATHER}
    assert sorted(reduces) == sorted(gathers) == list(range(-1, S))
    assert all(e.stream is Stream.COMM for e in list(reduces.values()) + list(gathers.values()))
    bwd = {e.stage: e.id for e in ev if e.kind is Kind.COMPUTE and e.phase is Phase.BWD}
    fwd = {e.stage: e.id for e in ev if e.kind is Kind.COMPUTE and e.phase is Phase.FWD}
    for s in range(S):
        assert reduces[s].id > bwd[s] and bwd[s] in reduces[s].waits, s
        if s > 0:  # overlaps the next stage's backward
            assert reduces[s].id < bwd[s - 1], s
        if stages[s].param_bytes and s in (1, 2, 3, 4):  # streamed: gathered before its forward reads the weights
            assert gathers[s].id < fwd[s] and gathers[s].id in ev[fwd[s]].waits, s
        else:  # resident: after its step
            step = next(e for e in ev if e.kind is Kind.OPT_STEP and e.stage == s)
            assert step.id in gathers[s].waits, s
    assert verify(dataclasses.replace(sched, budget=1 << 40))


def test_the_shared_step_is_priced_on_the_ranks_piece():
    """The shared weights' OPT_STEP event takes the step model's seconds (`shards.shared_step_s`): a
    rank steps its 1/N piece of them, not the whole tensors."""
    from lazytrain.solver.footprint import gpu_step_s
    from lazytrain.solver.shards import shared_step_s

    hw = hardware.load("h200")
    stages = dataclasses.replace(_stages(hw=hw), clipping="off")  # the device's time, not the host's issue
    plan = evaluate(stages, hw, 1 << 40, decisions(["-rk", "GRk", "SRk", "GRk", "Srk"]))
    step = next(e for e in lower(stages, plan, hw).events if e.kind is Kind.OPT_STEP and e.stage == -1)
    whole = gpu_step_s(stages.shared_numel, len(stages.shared_params), hw, stages.master_bytes, stages.state_bytes)
    assert step.duration_s == pytest.approx(shared_step_s(stages, hw), abs=1e-9)  # events keep nanoseconds
    assert 0 < step.duration_s < 0.6 * whole


def test_verify_checks_collective_order():
    """A forward that reads gathered weights without waiting for the GATHER, or a GATHER that
    overwrites resident weights without waiting for their step, is refused."""
    _, sched = _schedule()
    ev = list(sched.events)
    g = next(e for e in ev if e.kind is Kind.GATHER and e.stage == 1)  # GPU-stepped: the step, then the gather
    f = next(e for e in ev if e.kind is Kind.COMPUTE and e.phase is Phase.FWD and e.stage == g.stage)
    bad = ev[:]
    bad[f.id] = dataclasses.replace(f, waits=tuple(w for w in f.waits if w != g.id))
    with pytest.raises(VerifyError, match=f"reads {g.writes[0]} made by event {g.id} on another stream without waiting"):
        verify(dataclasses.replace(sched, events=tuple(bad), budget=1 << 40))
    r = next(e for e in ev if e.kind is Kind.GATHER and e.writes[0].startswith("res:"))
    bad = ev[:]
    bad[r.id] = dataclasses.replace(r, waits=())
    with pytest.raises(VerifyError, match=f"overwrites {r.writes[0]} without waiting for event"):
        verify(dataclasses.replace(sched, events=tuple(bad), budget=1 << 40))


def test_predicted_step_grows_with_lower_link_bandwidth():
    """The step model charges each stage's collectives to the link: a slower link, a longer step;
    without sharding (or on one rank) the link does not enter the prediction."""
    meta, _, batch = tiny_gpt_pair()
    base = hardware.load("cpu")
    steps = {}
    for bw in (1e12, 1e8, 1e6):
        hw = dataclasses.replace(base, link_bandwidth=bw)
        steps[bw] = compile_model(meta, batch, GiB, hw, time_limit=20, world_size=2).plan.step_s
        if bw == 1e6:
            one = compile_model(meta, batch, GiB, hw, time_limit=20, world_size=1).plan.step_s
            fast = compile_model(meta, batch, GiB, dataclasses.replace(base, link_bandwidth=1e12), time_limit=20,
                                 world_size=1).plan.step_s
            assert one == pytest.approx(fast)
    assert steps[1e12] < steps[1e8] < steps[1e6]
    nbytes = 4 * sum(p.numel() for p in meta.parameters())
    assert steps[1e6] - steps[1e12] >= nbytes / 1e6  # at least one full pass over the link that nothing hides


def test_host_memory_per_rank_counts_shards():
    """At the smallest budget (streamed stages), a rank's host memory holds 1/N of the masters'
    states and gradients: less with sharded state, and less with more ranks."""
    meta, _, batch = tiny_gpt_pair()
    host = {}
    for world, shard in ((2, False), (2, True), (4, True)):
        budget = minimum_budget(meta, batch, "cpu", world_size=world, shard_state=shard)
        plan = compile_model(meta, batch, budget, "cpu", time_limit=20, world_size=world, shard_state=shard).plan
        assert any(d.streamed for d in plan.decisions)
        host[(world, shard)] = plan.host_bytes
    assert host[(2, True)] < host[(2, False)]
    assert host[(4, True)] < host[(2, True)]


def test_refusals():
    meta, _, batch = tiny_gpt_pair()
    hw = dataclasses.replace(hardware.load("cpu"), link_bandwidth=0.0)
    with pytest.raises(PlanError, match="has no link_bandwidth.*lazytrain profile.*torchrun"):
        compile_model(meta, batch, GiB, hw, world_size=2)
    # replicated needs neither
    assert not compile_model(meta, batch, GiB, hw, world_size=2, shard_state=False).stages.sharded


def test_8bit_states_default_to_sharded():
    """8-bit states shard by default (in whole quantisation blocks); --replicate-state replicates them."""
    pytest.importorskip("bitsandbytes")
    meta, _, batch = tiny_gpt_pair()
    assert compile_model(meta, batch, GiB, "cpu", world_size=2, optimizer_states="8bit").stages.sharded
    assert not compile_model(meta, batch, GiB, "cpu", world_size=2, optimizer_states="8bit",
                             shard_state=False).stages.sharded


@pytest.mark.parametrize("states", ["32bit", "8bit"])
def test_a_ranks_share_of_sharded_state(states):
    """A resident stage's state on a rank: its 1/N of the state bytes (8-bit: a byte per moment and
    the absmax vectors' fp32 per block), rounded up by a piece's rounding per tensor: an element with
    32-bit states, a quantisation block with 8-bit ones, whose pieces are whole blocks. Never less
    than the runtime's largest piece of every tensor, the cut the runtime makes."""
    from lazytrain.ir.stages import STATE_BYTES
    from lazytrain.runtime.sharding import ShardLayout
    from lazytrain.sizes import QUANT_BLOCK
    from lazytrain.solver.shards import piece, resident_sharded_bytes, sharding

    meta, _, batch = tiny_gpt_pair()
    for world in (2, 4):
        graph, stages = analyse(meta, batch, hardware.load("cpu"), optimizer_states=states, world_size=world)
        n = sharding(stages)
        assert n == world and n.align == (QUANT_BLOCK if states == "8bit" else 1)
        for g in stages:
            if not g.params:
                continue
            numels = {p: graph[p].spec.numel for p in g.params}
            P, per = len(g.params), STATE_BYTES[states]
            home = resident_sharded_bytes(g.param_bytes, g.param_numel, P, per, 4, n)
            assert home - g.param_bytes == piece(per * g.param_numel, g.param_numel, P, n)
            assert home - g.param_bytes <= per * (g.param_numel / world + P * n.align) + 1
            largest = sum(max(hi - lo for lo, hi in (ShardLayout(numels, world, r, n.align).span(p) for r in range(world)))
                          for p in numels)
            assert home - g.param_bytes >= per * largest, g.name


@pytest.mark.parametrize("world", [2, 3])
def test_rounding_noise_of_a_piece_is_the_whole_tensors(world):
    """bf16 masters: each rank's piece rounds with the noise the whole tensor draws at those elements
    (NOTE: [Host rounding noise] in optim.py), across chunk boundaries, so weights do not depend on
    the number of ranks."""
    from lazytrain.runtime.optim import _NOISE_CHUNK, round_stochastic_

    n = 2 * _NOISE_CHUNK + 12345
    src = torch.randn(n)
    whole = round_stochastic_(torch.empty(n, dtype=torch.bfloat16), src, seed=7)
    c = -(-n // world)
    pieces = [round_stochastic_(torch.empty(len(range(n)[r * c:(r + 1) * c]), dtype=torch.bfloat16),
                                src[r * c:(r + 1) * c], seed=7, offset=r * c) for r in range(world)]
    assert torch.equal(torch.cat(pieces), whole)
    again = round_stochastic_(torch.empty(n, dtype=torch.bfloat16), src, seed=8)
    assert not torch.equal(again, whole)


def test_replicated_all_reduce_is_counted_on_the_compute_stream():
    """Without sharded state each stage's gradients are all-reduced as its backward ends, on the compute
    stream (NOTE: [Replicated all-reduce]): the same decisions take that much longer a step, in B(s)."""
    hw = hardware.load("cpu")
    one, two = _stages(world=1, sharded=False), _stages(world=2, sharded=False)
    resident = decisions(["-rk"] * len(one))
    alone, replicated = (evaluate(st, hw, GiB, resident) for st in (one, two))
    reduced = sum(2 * g.param_bytes for g in one) + 2 * one.shared_bytes
    assert replicated.step_s - alone.step_s == pytest.approx(reduced / hw.link_bandwidth, rel=1e-6)
    seconds = lambda plan: {label: s for label, _, s in plan.windows}  # noqa: E731
    last = f"B{len(one) - 1}"
    assert seconds(replicated)[last] - seconds(alone)[last] == pytest.approx(
        2 * one[-1].param_bytes / hw.link_bandwidth, rel=1e-6)
