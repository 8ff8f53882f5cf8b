"""Data parallel on torch.distributed (NOTE: [Data parallel] in runtime/data_parallel.py), on 2 CPU
ranks in a gloo group spawned from here (dp_worker.py).

Schedules compiled with `--world-size 2` for one rank's batch, for the tiny GPT (tied embeddings:
a shared parameter) and a tiny Qwen2, everything resident and at the smallest budget (streamed
stages), and a forced plan with GPU-stepped streamed stages and a chunked loss stage. On each:
  - one `forward_backward` on each rank's rows gives eager's loss and every gradient on the global batch;
  - three `step`s leave every rank with torch AdamW's weights on the global batches, with and
    without `max_grad_norm` (clipped with the global norm);
bind refuses a schedule compiled for another world size, ranks that bound different schedules or
weights, and a rank that exits or stalls makes the other raise `DistributedError` within the
group's timeout instead of hanging.

All cases but the lost ranks share one spawn of the ranks (module fixture): starting processes is
most of the cost.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from lazytrain import hardware
from lazytrain.errors import PlanError, ScheduleMismatch
from lazytrain.pipeline import analyse, compile_model, minimum_budget
from lazytrain.runtime.schedule import load_source
from models import unique_name
from plans import decisions, forced
import dp_worker

GiB = 1 << 30
WORLD = 2
MODELS = ("tiny_gpt", "qwen2")
BUDGETS = ("resident", "minimum")


def _compile(name: str, budget: str, world_size: int = WORLD, shard_state: bool | None = None,
             clipping: str = "exact") -> str:
    meta, _, batch = dp_worker.pair(name)
    size = GiB if budget == "resident" else minimum_budget(meta, batch, "cpu", world_size=world_size,
                                                           shard_state=shard_state)
    return compile_model(meta, batch, size, "cpu", source=name, time_limit=20, world_size=world_size,
                         shard_state=shard_state, clipping=clipping).source_text


def _forced_homes(sharded: bool = False) -> str:
    """The tiny GPT with every parameter home the runtime has: a resident prologue holding the tied
    embedding (shared with the epilogue), GPU-stepped streamed blocks 0 and 2, a host-stepped
    streamed block 1, and a streamed epilogue whose loss runs in chunks."""
    meta, _, batch = dp_worker.pair("tiny_gpt")
    hw = hardware.load("cpu")
    graph, stages = analyse(meta, batch, hw, loss_chunk_bytes=1)
    stages = dataclasses.replace(stages, world_size=WORLD, sharded=sharded)
    assert stages[-1].chunks > 1
    f = forced(graph, stages, batch, decisions(["-rk", "GRk", "SRk", "GRk", "Srk"]), hw, world_size=WORLD)
    assert [d.kind for d in f.plan.decisions] == ["resident", "prefetch", "host", "prefetch", "host"]
    return f.source_text


@pytest.fixture(scope="module")
def sources():
    out = {(m, b): _compile(m, b) for m in MODELS for b in BUDGETS}
    out[("tiny_gpt", "forced")] = _forced_homes(sharded=True)
    out[("tiny_gpt", "forced-replicated")] = _forced_homes(sharded=False)
    out[("tiny_gpt", "minimum-replicated")] = _compile("tiny_gpt", "minimum", shard_state=False)
    out[("tiny_gpt", "world1")] = _compile("tiny_gpt", "resident", world_size=1)
    out[("tiny_gpt", "previous-norm")] = _compile("tiny_gpt", "minimum", clipping="previous-norm")
    return out


# sharded state (the default) at every model and budget; replicated on the forced homes and the smallest budget
CASES = [(m, b) for m in MODELS for b in BUDGETS] + [("tiny_gpt", "forced"), ("tiny_gpt", "forced-replicated"),
                                                     ("tiny_gpt", "minimum-replicated")]


@pytest.fixture(scope="module")
def ranks(sources):
    """Every case on the same two ranks: {case id: None or what failed}, refusals' messages."""
    cases = []
    for m, b in CASES:
        src = sources[(m, b)]
        cases += [((m, b, "fb"), "check_forward_backward", m, src),
                  ((m, b, "steps"), "check_steps", m, src, None),
                  ((m, b, "clip"), "check_steps", m, src, 0.5)]
    cases += [("previous-norm", "check_steps", "tiny_gpt", sources[("tiny_gpt", "previous-norm")], 0.5, True),
              ("world1", "check_refused", "tiny_gpt", sources[("tiny_gpt", "world1")]),
              ("other schedules", "check_refused", "tiny_gpt", None,
               {0: sources[("tiny_gpt", "resident")], 1: sources[("tiny_gpt", "minimum")]}),
              ("other weights", "check_other_weights", "tiny_gpt", sources[("tiny_gpt", "resident")])]
    results = dp_worker.launch(dp_worker.run_cases, cases, world=WORLD)
    assert sorted(results) == [0, 1]
    refusals = {}
    for case in ("world1", "other schedules", "other weights"):
        got = [r[case] for r in results.values()]
        assert all(isinstance(g, tuple) for g in got), "\n".join(g for g in got if not isinstance(g, tuple))
        refusals[case] = [g[1] for g in got]
    return results, refusals


@pytest.mark.parametrize("kind", ["fb", "steps", "clip"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_two_ranks_equal_global_batch(ranks, case, kind):
    """fb: loss and gradients of one forward_backward; steps / clip: weights after three steps
    (clip: max_grad_norm 0.5, which clips) equal single-process eager on the global batch, on both ranks."""
    results, _ = ranks
    got = [r[case + (kind,)] for r in results.values()]
    assert sorted(results) == [0, 1]
    failures = [r for r in got if not isinstance(r, tuple)]
    assert not failures, "\n".join(failures)
    if kind != "fb":  # the ranks stepped the same averaged gradients: bit-identical weights
        assert got[0][1] == got[1][1], "the ranks' weights differ"


def test_two_ranks_clip_by_the_previous_norm(ranks):
    """`--clipping previous-norm` with sharded state: each step is clipped by the global norm (every
    rank's shards) of the step before, the first by its own, as one process would on the global batch."""
    results, _ = ranks
    got = [r["previous-norm"] for r in results.values()]
    failures = [r for r in got if not isinstance(r, tuple)]
    assert not failures, "\n".join(failures)
    assert got[0][1] == got[1][1], "the ranks' weights differ"


def test_schedule_for_one_rank_refused_in_a_group_of_two(ranks):
    _, refusals = ranks
    for msg in refusals["world1"]:
        assert msg.startswith("ScheduleMismatch"), msg
        assert "compiled for 1 data-parallel rank (--world-size 1)" in msg and "process group of 2 ranks" in msg, msg
        assert "--world-size 2" in msg, msg


def test_schedule_for_two_ranks_refused_in_one_process(sources):
    """No process group: a schedule for 2 ranks says how to launch it, or to recompile for 1."""
    module = load_source(sources[("tiny_gpt", "resident")], unique_name())
    _, real, _ = dp_worker.pair("tiny_gpt")
    with pytest.raises(ScheduleMismatch, match=r"compiled for 2 data-parallel ranks \(--world-size 2\).*not initialised.*"
                                               r"torchrun --nproc-per-node 2.*recompile it with --world-size 1"):
        module.bind(real)


def test_ranks_with_other_schedules_or_weights_refused(ranks):
    """Ranks that bound different schedules (both for 2 ranks), or the same one to different weights."""
    _, refusals = ranks
    for msg in refusals["other schedules"]:
        assert msg.startswith("ScheduleMismatch: the ranks bound different schedules"), msg
    for msg in refusals["other weights"]:
        assert "start from different weights (" in msg and ("wte.weight differs" in msg or "head.weight differs" in msg), msg


@pytest.mark.parametrize("mode", ["exit", "stall"])
def test_lost_rank_raises_within_timeout(sources, mode):
    """Rank 1 exits (or stops taking part) after one step; rank 0's next step raises
    DistributedError, within the group's 2 s timeout, instead of hanging."""
    timeout_s = 2.0
    release = mp.get_context("spawn").Event()
    got = dp_worker.launch(dp_worker.lost_rank, "tiny_gpt", sources[("tiny_gpt", "minimum")], mode, timeout_s, release,
                           world=WORLD, deadline_s=120)
    seconds, msg = got[0]
    assert seconds < timeout_s + 5, f"rank 0 took {seconds:.1f} s to notice"
    assert "failed on rank 0 of 2" in msg and "timeout (2 s)" in msg and "init_process_group(timeout=" in msg, msg


def test_compile_records_world_size(sources):
    module = load_source(sources[("tiny_gpt", "minimum")], unique_name())
    assert module.WORLD_SIZE == 2
    meta, _, batch = dp_worker.pair("tiny_gpt")
    with pytest.raises(PlanError, match="world_size 0 is not a number of ranks"):
        compile_model(meta, batch, GiB, "cpu", world_size=0)


def test_cli_world_size(tmp_path, capsys):
    """`lazytrain compile --world-size 2` writes WORLD_SIZE 2 and `inspect` says so; 0 is refused."""
    from lazytrain.cli import main
    from lazytrain.runtime.schedule import load_schedule

    out = tmp_path / "s.py"
    model = str(Path(__file__).parents[1] / "lazytrain" / "examples" / "tiny_gpt.py")
    assert main(["compile", model, "-o", str(out), "--hardware", "cpu", "--budget", "1GiB",
                 "--world-size", "2"]) == 0
    assert "data parallel over 2 ranks, state sharded: each runs this plan on its own batch, keeps 1/2" in \
        capsys.readouterr().out
    assert load_schedule(out).WORLD_SIZE == 2
    with pytest.raises(SystemExit):
        main(["compile", model, "-o", str(out), "--world-size", "0"])
    assert "--world-size: 0 is below 1" in capsys.readouterr().err


def test_schedule_of_format_4_refused(sources):
    """A schedule from before WORLD_SIZE (format 4) is stale: refused with the format error."""
    from lazytrain.runtime.schedule import FORMAT_VERSION, checksum

    text = sources[("tiny_gpt", "world1")].replace(f"FORMAT = {FORMAT_VERSION}\n", "FORMAT = 4\n")
    text = "\n".join(line for line in text.split("\n") if not line.startswith("WORLD_SIZE = "))
    text = text.replace(text[text.index('CHECKSUM = "'):text.index('"\n', text.index('CHECKSUM = "')) + 1],
                        'CHECKSUM = ""')
    text = text.replace('CHECKSUM = ""', f'CHECKSUM = "{checksum(text)}"')
    with pytest.raises(ScheduleMismatch, match=f"has format 4, this lazytrain reads {FORMAT_VERSION}: it is stale; recompile it"):
        load_source(text, unique_name())


def test_sharded_checkpoint_reshards(sources, tmp_path):
    """`sharded_state_dict()` through torch.distributed.checkpoint (NOTE: [Sharded checkpoints]): saved
    by 2 ranks with sharded state (every parameter home: the forced plan), loaded by 2 ranks and by 1
    (another plan, state not sharded): the same masters, moments, steps and weights; the 2-rank
    load then steps to the saving run's next weights, bit for bit."""
    import numpy as np

    path = str(tmp_path / "ckpt")
    saved = dp_worker.launch(dp_worker.check_dcp_save, "tiny_gpt", sources[("tiny_gpt", "forced")], path, world=WORLD)
    for world, key in ((WORLD, ("tiny_gpt", "forced")), (1, ("tiny_gpt", "world1"))):
        loaded = dp_worker.launch(dp_worker.check_dcp_load, "tiny_gpt", sources[key], path, WORLD, world=world)
        want_state, want_next = saved[0]
        for rank, (state, after) in loaded.items():
            assert sorted(state) == sorted(want_state)
            for k, v in want_state.items():
                assert np.array_equal(state[k], v), f"{k} differs after loading at {world} rank(s) (rank {rank})"
            assert any(k.endswith("exp_avg") and np.abs(v).sum() > 0 for k, v in state.items()), "no moments saved"
            if after is not None:
                for n, w in want_next.items():
                    assert np.array_equal(after[n], w), f"{n} differs one step after loading (rank {rank})"


def test_a_gather_marks_its_weights_final_from_inside_its_event(monkeypatch):
    """The GATHER handler says its stage's weights are final while `CudaStreams.run` is still
    running it, before the event's own completion is recorded: the mark must come from the stream
    it runs on. (It looked the event up in `done` and raised KeyError on the first GATHER of a
    2-GPU run; CPU streams make the mark a no-op, so only this double of CUDA's bookkeeping sees it.)"""
    import contextlib

    import torch

    from lazytrain.ir.events import Event, Kind, Stream
    from lazytrain.runtime.streams import CudaStreams

    class FakeEvent:
        def __init__(self, **_):
            self.on = None

        def record(self, stream):
            self.on = stream

    comm, compute = object(), type("S", (), {"wait_event": lambda self, ev: None})()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: comm)
    streams = object.__new__(CudaStreams)
    streams.device, streams.record, streams.done, streams.stepped = "cuda", False, {}, {}
    streams.streams = {Stream.COMM: comm, Stream.COMPUTE: compute}
    gather = Event(id=7, stream=Stream.COMM, kind=Kind.GATHER, stage=3)
    streams.run(gather, lambda: streams.stepped_at(gather.stage))
    assert streams.stepped[3].on is comm and 7 in streams.done
