"""Sharded host weights (NOTE: [Sharded host weights] in runtime/host_weights.py) on 2 CPU ranks in a
gloo group (dp_worker.launch, dp_worker_zero3.py).

Each rank's host keeps its piece of every streamed stage's weights; every prefetch brings the piece
and all-gathers the rest. On the tiny GPT with tied embeddings, on a forced plan with every home (a
resident prologue holding the shared embedding, GPU-stepped and host-stepped streamed blocks, a
streamed epilogue whose loss runs in chunks), with 32-bit and 8-bit sharded states:
  - one `forward_backward` gives eager's loss and every gradient on the global batch;
  - three steps (with and without clipping) leave torch AdamW's weights (32-bit states), and the
    weights of the same plan with the host weights whole, bit for bit (both state precisions);
  - the model's own parameters hold placeholders between steps, and whole weights after a sync;
  - a distributed checkpoint saved on 2 ranks loads on 2 and on 1, and steps on bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest

from lazytrain import hardware
from lazytrain.codegen.render import render
from lazytrain.passes.lower import lower
from lazytrain.passes.verify import verify
from lazytrain.pipeline import analyse, compile_model
from lazytrain.solver.solve import evaluate
from plans import decisions
import dp_worker
import dp_worker_zero3

WORLD = 2
HOMES = ["-rk", "GRk", "SRk", "GRk", "Srk"]


def _forced(states: str, held: bool) -> str:
    """The forced plan, verified at its predicted peak, with the host weights held in pieces or whole."""
    meta, _, batch = dp_worker.pair("tiny_gpt")
    hw = hardware.load("cpu")
    graph, stages = analyse(meta, batch, hw, loss_chunk_bytes=1, optimizer_states=states, world_size=WORLD,
                            shard_weights=held)
    assert stages.sharded and stages.weights_sharded == held
    plan = evaluate(stages, hw, 1 << 40, decisions(HOMES))
    assert [d.kind for d in plan.decisions] == ["resident", "prefetch", "host", "prefetch", "host"]
    schedule = lower(stages, plan, hw)
    verify(dataclasses.replace(schedule, budget=plan.peak_bytes))
    text = render(graph, stages, plan, schedule, batch, hw.name, states, world_size=WORLD)
    assert f"SHARDED_WEIGHTS = {held}" in text
    return text


STATES = ["32bit", "8bit"]


@pytest.fixture(scope="module")
def sources():
    out = {(s, held): _forced(s, held) for s in STATES for held in (True, False)}
    meta, _, batch = dp_worker.pair("tiny_gpt")
    out["world1"] = compile_model(meta, batch, 1 << 30, "cpu", source="tiny_gpt", time_limit=20).source_text
    return out


@pytest.fixture(scope="module")
def ranks(sources):
    held32 = sources[("32bit", True)]
    cases = [("fb", "check_forward_backward", "tiny_gpt", held32),
             ("eager", "check_steps", "tiny_gpt", held32, None),
             ("eager-clip", "check_steps", "tiny_gpt", held32, 0.5)]
    for s in STATES:
        cases += [((s, "whole"), dp_worker_zero3.check_held_equals_whole, "tiny_gpt", sources[(s, True)],
                   sources[(s, False)]),
                  ((s, "whole-clip"), dp_worker_zero3.check_held_equals_whole, "tiny_gpt", sources[(s, True)],
                   sources[(s, False)], 0.5)]
    return dp_worker.launch_cases(cases, world=WORLD)


def test_gradients_equal_the_global_batch(ranks):
    """One forward_backward with the host weights sharded: eager's loss and gradients, on both ranks."""
    dp_worker.case_results(ranks, "fb")


@pytest.mark.parametrize("case", ["eager", "eager-clip"])
def test_steps_equal_eager_adamw(ranks, case):
    """Three steps (clip: max_grad_norm 0.5): torch AdamW's weights on the global batches, the
    ranks bit for bit the same, each rank's host holding its pieces only."""
    digest0, digest1 = dp_worker.case_results(ranks, case)
    assert digest0 == digest1, "the ranks' weights differ"


@pytest.mark.parametrize("states", STATES)
@pytest.mark.parametrize("clip", ["", "-clip"])
def test_steps_equal_whole_host_weights(ranks, states, clip):
    """32-bit and 8-bit sharded states: the same losses and weights bit for bit as the same plan with
    the host weights whole; the model holds placeholders between steps, the whole weights after a sync."""
    digest0, digest1 = dp_worker.case_results(ranks, (states, "whole" + clip))
    assert digest0 == digest1, "the ranks' weights differ"


def test_checkpoint_reshards(sources, tmp_path):
    """`sharded_state_dict()` through torch.distributed.checkpoint, saved by 2 ranks whose host holds
    pieces of the weights, loaded by 2 ranks (the same) and by 1 (another plan): the same masters,
    moments, steps and weights; the 2-rank load then steps to the saving run's next weights, bit for bit."""
    import numpy as np

    path = str(tmp_path / "ckpt")
    held = sources[("32bit", True)]
    saved = dp_worker.launch(dp_worker.check_dcp_save, "tiny_gpt", held, path, world=WORLD)
    for world, source in ((WORLD, held), (1, sources["world1"])):
        loaded = dp_worker.launch(dp_worker.check_dcp_load, "tiny_gpt", source, path, WORLD, world=world)
        want_state, want_next = saved[0]
        for rank, (state, after) in loaded.items():
            assert sorted(state) == sorted(want_state)
            for k, v in want_state.items():
                assert np.array_equal(state[k], v), f"{k} differs after loading at {world} rank(s) (rank {rank})"
            if after is not None:
                for n, w in want_next.items():
                    assert np.array_equal(after[n], w), f"{n} differs one step after loading (rank {rank})"
