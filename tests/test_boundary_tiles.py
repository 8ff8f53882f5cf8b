"""Offloaded stage outputs split by the tile between the device, host memory and disk (NOTE:
[Boundary tiles] in solver/boundary.py): the split's arithmetic, the placements that may carry one,
what the plan counts of each part, a replay equal to eager and to the same plan unsplit, and the
1M-token plan of the long-sequence issue, which needs them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lazytrain import hardware
from lazytrain.errors import PlanError
from lazytrain.examples import tiny_gpt
from lazytrain.ir.placement import NAMESPACE, Outputs, Placement, PlacementError, Split
from lazytrain.pipeline import analyse
from lazytrain.solver import boundary
from lazytrain.solver.footprint import ACT_RING
from lazytrain.solver.solve import evaluate
from lazytrain.sizes import disk_region_bytes
from checks import assert_steps_agree, bind_source
from models import model_pair, token_batch
from plans import decisions, forced
from test_forced_plans import check_forced

HW = hardware.load("cpu")
HP = dict(lr=1e-3, eps=1e-6)
# 8 stages of tiny GPT; stages 0-4 offloaded (each read by the next, all at most S - 3, so disk may take them)
SPEC = ["-Ro"] * 5 + ["-Rk", "-Rk", "-rk"]
TILES = 4


@pytest.fixture(scope="module")
def gpt():
    meta, real = model_pair(lambda: tiny_gpt.TinyGPT(dim=64, layers=6, seq=256))
    batch = token_batch(4, 256, tiny_gpt.VOCAB)  # outputs of 256 KiB a block: 64 disk blocks
    graph, stages = analyse(meta, batch, HW)
    return graph, dataclasses.replace(stages, disk=True), batch, real


@pytest.fixture
def tiles(gpt, monkeypatch):
    """Tiles small enough that each block's outputs are TILES of them."""
    stages = gpt[1]
    monkeypatch.setattr(boundary, "TILE_BYTES", -(-stages[1].out_bytes // TILES))
    assert [boundary.tiles(stages[s]) for s in range(1, 5)] == [TILES] * 4


def split(spec, splits: dict[int, tuple[Outputs, Split | None]]) -> list[Placement]:
    """`decisions(spec)` with the given stages' outputs and splits."""
    out = decisions(spec)
    for s, (outputs, how) in splits.items():
        out[s] = dataclasses.replace(out[s], outputs=outputs, split=how)
    return out


# each way a part may go: kept and host; kept, host and disk; host and disk; kept and disk
SPLITS = {1: (Outputs.OFFLOAD, Split(1, 0, TILES)), 2: (Outputs.DISK, Split(1, 2, TILES)),
          3: (Outputs.DISK, Split(0, 1, TILES)), 4: (Outputs.DISK, Split(3, 1, TILES))}
WHOLE = {s: (outputs, None) for s, (outputs, _) in SPLITS.items()}


@given(n=st.integers(0, 10_000), of=st.integers(2, 64), data=st.data())
def test_a_split_cuts_every_tensor_into_its_shares(n, of, data):
    device = data.draw(st.integers(0, of - 1))
    disk = data.draw(st.integers(0, of - device))
    if device == 0 and disk in (0, of):
        with pytest.raises(PlacementError):
            Split(device, disk, of)
        return
    s = Split(device, disk, of)
    kept, host, on_disk = s.numels(n)
    assert kept + host + on_disk == n and min(kept, host, on_disk) >= 0
    assert kept * of >= n * device > (kept - 1) * of  # the first ceil(n * device / of) stay
    assert on_disk * of <= n * disk < (on_disk + 1) * of  # the last floor(n * disk / of) go to disk
    assert eval(repr(s), {"__builtins__": {}}, NAMESPACE) == s


def test_only_offloaded_outputs_split_and_disk_tiles_only_on_disk():
    for outputs, how in ((Outputs.KEEP, Split(1, 0, 4)), (Outputs.DROP, Split(1, 0, 4)),
                         (Outputs.OFFLOAD, Split(1, 1, 4)), (Outputs.DISK, Split(1, 0, 4))):
        with pytest.raises(PlacementError):
            dataclasses.replace(decisions(["-Ro"])[0], outputs=outputs, split=how)
    with pytest.raises(PlacementError):
        Split(4, 0, 4)  # all kept is Outputs.KEEP
    p = dataclasses.replace(decisions(["-Rf"])[0], split=Split(1, 2, 4))
    assert eval(repr(p), {"__builtins__": {}}, NAMESPACE) == p


def test_a_plan_counts_each_part_where_it_is(gpt, tiles):
    graph, stages, batch, _ = gpt
    whole = evaluate(stages, HW, 1 << 40, split(SPEC, WHOLE))
    parts = forced(graph, stages, batch, split(SPEC, SPLITS), HW)
    plan, buffers = parts.plan, {b.name: b for b in parts.schedule.buffers}
    # on disk: each split's disk share, carved as the runtime carves it
    assert plan.disk_bytes == sum(disk_region_bytes(stages[s].out_bytes, len(stages[s].outputs), how)
                                  for s, (_, how) in SPLITS.items())
    assert whole.disk_bytes > plan.disk_bytes
    # on the device: a buffer for each kept part, of its share
    for s, (_, how) in SPLITS.items():
        assert (f"part:{s}" in buffers) == (how.device > 0)
        if how.device:
            assert buffers[f"part:{s}"].bytes == boundary.kept_bytes(stages[s], how)
            assert buffers[f"part:{s}"].bytes >= stages[s].out_bytes * how.device // TILES
    # the kept parts cost the device memory they keep, so the plan needs more of it
    assert plan.peak_bytes > whole.peak_bytes
    assert max(parts.trace) <= plan.peak_bytes
    # what goes to the host is what the splits leave it, less than whole offloads: with a ring of
    # ACT_RING buffers as large as the largest disk share in place of the disk's bytes
    assert plan.host_bytes < whole.host_bytes + ACT_RING * max(
        disk_region_bytes(stages[s].out_bytes, len(stages[s].outputs), how) for s, (_, how) in SPLITS.items())


def test_a_split_must_have_the_stages_tile_count(gpt, tiles):
    _, stages, _, _ = gpt
    with pytest.raises(PlanError, match="tiles"):
        evaluate(stages, HW, 1 << 40, split(SPEC, {1: (Outputs.OFFLOAD, Split(1, 0, TILES + 1))}))


def test_split_replay_equals_eager_and_the_plan_unsplit(gpt, tiles, tmp_path):
    graph, stages, batch, real = gpt
    text = check_forced(graph, stages, batch, real, split(SPEC, SPLITS)).source_text
    assert "Split(1, 2, 4)" in text and "4 tiles: 1 kept, 1 to host, 2 to disk" in text
    trainer, _ = bind_source(text, real, offload_dir=str(tmp_path), **HP)
    reference, _ = bind_source(forced(graph, stages, batch, split(SPEC, WHOLE), HW).source_text, real,
                               offload_dir=str(tmp_path), **HP)
    assert_steps_agree(trainer, reference, batch, steps=3)
    assert trainer.replay.parts == {}  # every kept part went back into its output
    # each split output's host buffer holds its host share alone (none where it has no host tiles)
    for s, (_, how) in SPLITS.items():
        [name] = stages[s].outputs
        host = how.numels(stages[s].out_bytes // 4)[1]  # float32 outputs
        assert (trainer.replay.host_act[name].numel() if name in trainer.replay.host_act else 0) == host, s


def test_an_output_not_laid_out_in_one_piece_goes_to_the_host_whole(gpt, tiles):
    """The runtime's fallback (NOTE: [Boundary tiles]): a strided output cannot be cut in memory
    order, so none of it stays on the device or goes to disk."""
    from lazytrain.runtime.replay import _numels
    t = torch.zeros(8, 6).t()
    assert _numels(t, Split(1, 2, 4)) == (0, 48, 0)
    assert _numels(t.contiguous(), Split(1, 2, 4)) == (12, 12, 24)


def test_the_million_token_plan_is_split_and_does_not_fit_whole():
    """The 7B shape at 1 x 1,048,576 tokens with the disk tier, on the H200 box with a 160 GiB GPU
    (the H200's 139.8 GiB refuses it since attention's backward workspace is counted in fused
    bodies, NOTE: [Workspace the trace cannot see]; bench/README.md): the search proves its plan,
    which splits boundaries, and the same plan with every boundary whole does not fit the device."""
    from bench.shapes import batch as bench_batch
    from bench.shapes import meta_model
    from lazytrain.options import CompileOptions
    from lazytrain.pipeline import compile_model

    seq, hw = 1 << 20, dataclasses.replace(hardware.load("h200"), gpu_memory_bytes=160 << 30)
    meta = meta_model("qwen2.5-7b", seq).to(torch.bfloat16)
    c = compile_model(meta, bench_batch("qwen2.5-7b", 1, seq), hardware=hw, options=CompileOptions(
        budget="max", optimizer_states="8bit", master_weights="bf16", disk=True, tile_bytes=256 << 20, time_limit=60))
    assert c.plan.solver.status == "optimal"
    splits = [d for d in c.plan.decisions if d.split is not None]
    assert len(splits) > 10
    unsplit = [dataclasses.replace(d, split=None) for d in c.plan.decisions]
    with pytest.raises(PlanError):
        evaluate(c.stages, hw, c.plan.budget, unsplit)
