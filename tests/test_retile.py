"""Pass `retile` and the tile sizes a compile searches (NOTE: [Tile sizes] in lazytrain/passes/retile.py):
a graph retiled equals the graph captured at that size; where no untiled plan fits, the compile keeps
the fastest size that fits, and the schedule of a retiled graph trains as eager does."""

from __future__ import annotations

import pytest
import torch
import transformers

from lazytrain import pipeline
from lazytrain.pipeline import AUTO_TILE_BYTES, analyse, compile_model, minimum_budget
from lazytrain.hardware import load
from lazytrain.passes.retile import GATED_MLP, RMS_NORM, retile
from checks import check_replay
from models import model_pair

# 2 x 128 tokens, an intermediate of 1024 in fp32 (4 KiB a row): 1, 4 and 16 MLP tiles
SIZES = (AUTO_TILE_BYTES, 256 << 10, 64 << 10)


@pytest.fixture
def qwen(monkeypatch):
    """A Qwen2 whose MLPs hold most of a layer (the wide intermediate), so tile sizes decide budgets."""
    monkeypatch.setattr(pipeline, "TILE_SIZES", SIZES)
    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, use_cache=False, attn_implementation="sdpa",
                                      tie_word_embeddings=False)
    meta, real = model_pair(lambda: transformers.Qwen2ForCausalLM(config))
    ids = torch.randint(0, 64, (2, 128), generator=torch.Generator().manual_seed(0))
    return meta, real, {"input_ids": ids, "labels": ids.clone()}


def _counts(graph) -> list:
    return [n.args[-1] for n in graph.nodes if n.target in (GATED_MLP, RMS_NORM)]


def test_a_retiled_graph_is_the_graph_captured_at_that_size(qwen):
    meta, _, batch = qwen
    cpu = load("cpu")
    captured = {size: analyse(meta, batch, cpu, tile_bytes=size)[0] for size in SIZES}
    assert _counts(captured[AUTO_TILE_BYTES]) == [1] * len(_counts(captured[AUTO_TILE_BYTES]))
    assert 16 in _counts(captured[64 << 10]) and 4 in _counts(captured[256 << 10])
    for size in SIZES:
        assert retile(captured[AUTO_TILE_BYTES], size) == captured[size]


def test_where_only_small_tiles_fit_the_compile_takes_them_and_trains_as_eager(qwen):
    meta, real, batch = qwen
    smallest = minimum_budget(meta, batch, "cpu")
    untiled = minimum_budget(meta, batch, "cpu", tile_bytes=0)
    by_size = {size: minimum_budget(meta, batch, "cpu", tile_bytes=size) for size in SIZES}
    assert smallest == min(by_size.values()) < untiled
    fitting = min(by_size, key=by_size.get)
    assert fitting != AUTO_TILE_BYTES  # smaller tiles hold less: the premise
    c = compile_model(meta, batch, smallest, "cpu", time_limit=20)
    assert c.options.tile_bytes == fitting
    assert _counts(c.graph) == _counts(analyse(meta, batch, load("cpu"), tile_bytes=fitting)[0])
    check_replay(c.source_text, real, batch)


def test_of_the_sizes_that_fit_the_fastest_is_kept(qwen):
    meta, _, batch = qwen
    untiled = minimum_budget(meta, batch, "cpu", tile_bytes=0)
    by_size = {size: minimum_budget(meta, batch, "cpu", tile_bytes=size) for size in SIZES}
    budget = (max(b for b in by_size.values() if b < untiled) + untiled) // 2  # no untiled plan; 2 sizes fit
    fit = [s for s in SIZES if by_size[s] <= budget]
    assert len(fit) == 2
    c = compile_model(meta, batch, budget, "cpu", time_limit=20)
    steps = {s: compile_model(meta, batch, budget, "cpu", time_limit=20, tile_bytes=s).plan.step_s for s in fit}
    assert c.plan.step_s == min(steps.values())
    assert c.options.tile_bytes == min(fit, key=lambda s: (steps[s], SIZES.index(s)))
