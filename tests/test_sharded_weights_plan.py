"""Sharded host weights at compile time (NOTE: [Sharded host weights] in runtime/host_weights.py),
without ranks: a rank's host keeps 1/N of the streamed weights, every prefetch of a streamed stage
brings a shard and all-gathers the rest on the link, the plan prices that link volume, and the
option's refusals."""

from __future__ import annotations

import dataclasses

import pytest

from lazytrain import hardware
from lazytrain.errors import PlanError
from lazytrain.ir.events import Kind, Phase, Stream
from lazytrain.passes.lower import lower
from lazytrain.passes.verify import verify
from lazytrain.pipeline import analyse, compile_model
from lazytrain.solver.shards import piece
from lazytrain.solver.solve import evaluate
from models import tiny_gpt_pair
from plans import decisions

GiB = 1 << 30
# a resident prologue with the tied embedding, host-stepped streamed blocks 0 and 1, a GPU-stepped
# streamed block 2 and a host-stepped streamed epilogue
HOMES = ["-rk", "SRk", "SRk", "GRk", "Srk"]
STREAMED = range(1, 5)


def _plans(world: int, link_bandwidth: float | None = None):
    """{sharded host weights: (plan, schedule)} of the same decisions."""
    meta, _, batch = tiny_gpt_pair()
    hw = hardware.load("cpu")
    if link_bandwidth is not None:
        hw = dataclasses.replace(hw, link_bandwidth=link_bandwidth)
    _, stages = analyse(meta, batch, hw, loss_chunk_bytes=1)
    out = {}
    for held in (False, True):
        st = dataclasses.replace(stages, world_size=world, sharded=True, weights_sharded=held)
        plan = evaluate(st, hw, 1 << 40, decisions(HOMES))
        out[held] = (st, plan, lower(st, plan, hw), hw)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_host_weights_per_rank_shrink_by_the_ranks(world):
    """A rank's host keeps its piece of each streamed stage's weights: the plan's host bytes drop by
    (1 - 1/N) of them, up to a piece's rounding per tensor."""
    plans = _plans(world)
    st = plans[False][0]
    streamed = sum(st[s].param_bytes for s in STREAMED)
    saved = plans[False][1].host_bytes - plans[True][1].host_bytes
    assert saved == sum(st[s].param_bytes - piece(st[s].param_bytes, st[s].param_numel, len(st[s].params), world)
                        for s in STREAMED)
    assert saved == pytest.approx(streamed * (1 - 1 / world), rel=0.01)


def test_every_prefetch_of_a_streamed_stage_gathers():
    """Each PREFETCH of a streamed stage, forward and backward, brings a rank's shard over PCIe and a
    GATHER on the comm stream fills its slot before the compute that reads it; the forward's gathered
    weights no longer go back to the host, and the schedule verifies."""
    for held, (st, plan, sched, hw) in _plans(2).items():
        ev = sched.events
        gathers = [e for e in ev if e.kind is Kind.GATHER and e.stage in STREAMED]
        assert all(e.stream is Stream.COMM for e in gathers)
        prefetches = [e for e in ev if e.kind is Kind.PREFETCH and e.stage in STREAMED]
        back = [e for e in ev if e.kind is Kind.OFFLOAD and e.reads == (f"w:{e.stage}",) and e.stage in STREAMED]
        if not held:  # the forward's gather alone; its weights go back to the host copy the backward reads
            assert len(gathers) == len(STREAMED) and {e.stage for e in back} == set(STREAMED)
            continue
        assert len(gathers) == len(prefetches) == 2 * len(STREAMED) - 1  # the last stage stays for its backward
        assert {e.stage for e in back} == {3}  # the GPU step's new piece alone
        for p in prefetches:
            g = next(e for e in ev[p.id:] if e.kind is Kind.GATHER and e.stage == p.stage)
            use = next(e for e in ev[g.id:] if e.kind is Kind.COMPUTE and e.stage == p.stage)
            assert p.id in g.waits and g.id in use.waits, (p, g, use)
            shard = piece(st[p.stage].param_bytes, st[p.stage].param_numel, len(st[p.stage].params), 2)
            if p.stage != 3 or use.phase is Phase.BWD:  # a plain fetch: the shard of the weights alone
                assert p.duration_s * hw.h2d_bandwidth == pytest.approx(shard, rel=1e-3, abs=2)  # durations in ns
        assert verify(dataclasses.replace(sched, budget=1 << 40))


def test_the_backward_gathers_are_priced_on_the_link():
    """The link carries each streamed stage's weights once more, at its backward prefetch: the events
    and, on a link slow enough that nothing hides it, the predicted step grow by that volume."""
    plans = _plans(2, link_bandwidth=1e6)
    st = plans[True][0]
    extra = sum(st[s].param_bytes for s in STREAMED if s < len(st) - 1)
    moved = {held: sum(e.duration_s for e in sched.events if e.kind is Kind.GATHER) * 1e6
             for held, (_, _, sched, _) in plans.items()}
    assert moved[True] - moved[False] == pytest.approx(extra, rel=1e-3)
    grown = plans[True][1].step_s - plans[False][1].step_s
    assert grown == pytest.approx(extra / 1e6, rel=0.01)


def test_default_and_refusals():
    """On by default with sharded state (the schedule says so), off on request; asked for without
    sharded state, refused naming the cause and the fix."""
    meta, _, batch = tiny_gpt_pair()
    src = compile_model(meta, batch, GiB, "cpu", time_limit=20, world_size=2).source_text
    assert "SHARDED_WEIGHTS = True" in src
    off = compile_model(meta, batch, GiB, "cpu", time_limit=20, world_size=2, shard_weights=False)
    assert "SHARDED_WEIGHTS = False" in off.source_text and not off.stages.weights_sharded
    assert "SHARDED_WEIGHTS = False" in compile_model(meta, batch, GiB, "cpu", time_limit=20).source_text
    # one process has nothing to shard, as with shard_state=True
    assert "SHARDED_WEIGHTS = False" in compile_model(meta, batch, GiB, "cpu", time_limit=20, shard_weights=True).source_text
    with pytest.raises(PlanError, match="shard_weights=True.*shard_state=False .--replicate-state. replicates"):
        compile_model(meta, batch, GiB, "cpu", world_size=2, shard_state=False, shard_weights=True)
    with pytest.raises(PlanError, match="shard_weights 'yes' is not a choice"):
        compile_model(meta, batch, GiB, "cpu", world_size=2, shard_weights="yes")
