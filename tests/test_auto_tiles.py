"""--tile-bytes auto, the default (NOTE: [Tiles where nothing else fits] in lazytrain/pipeline.py):
a compile tiles a model's MLPs and norms only where no untiled plan fits its budget, or where that
lowers `--budget min`; a model with nothing to tile compiles as it is."""

from __future__ import annotations

import pytest
import torch

from lazytrain.errors import InfeasibleBudget
from lazytrain.kernels.tiled import tileable
from lazytrain.pipeline import AUTO_TILE_BYTES, compile_model, minimum_budget
from models import model_pair, tiny_gpt_pair
from test_packing_grads import build

TILED = "torch.ops.lazytrain.rms_norm.default("


@pytest.fixture(scope="module")
def qwen():
    meta, _ = model_pair(lambda: build("qwen2"))
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    untiled = minimum_budget(meta, batch, "cpu", tile_bytes=0)
    tiled = minimum_budget(meta, batch, "cpu", tile_bytes=AUTO_TILE_BYTES)
    assert tiled < untiled  # the norms keep only their input: the premise of these tests
    return meta, batch, untiled, tiled


def test_auto_plans_untiled_where_that_fits(qwen):
    meta, batch, untiled, _ = qwen
    c = compile_model(meta, batch, untiled, "cpu", time_limit=20)
    assert c.options.tile_bytes == 0 and TILED not in c.source_text


def test_auto_tiles_where_no_untiled_plan_fits(qwen):
    meta, batch, untiled, tiled = qwen
    budget = (untiled + tiled) // 2
    with pytest.raises(InfeasibleBudget):
        compile_model(meta, batch, budget, "cpu", time_limit=20, tile_bytes=0)
    c = compile_model(meta, batch, budget, "cpu", time_limit=20)
    assert c.options.tile_bytes == AUTO_TILE_BYTES and TILED in c.source_text
    assert not any(vars(m).get("forward") for m in meta.modules())  # the model is left as it was


def test_auto_min_keeps_the_smaller_budget_and_refusals_name_both(qwen):
    meta, batch, untiled, tiled = qwen
    assert minimum_budget(meta, batch, "cpu") == tiled
    c = compile_model(meta, batch, "min", "cpu", time_limit=20)
    assert c.plan.budget == tiled and TILED in c.source_text
    with pytest.raises(InfeasibleBudget, match=r"\(in tiles of 256\.0 MiB\) \(with its MLPs and norms in tiles, --tile-bytes; untiled it needs") as refused:
        compile_model(meta, batch, tiled - 4096, "cpu", time_limit=20)
    assert refused.value.smallest_feasible == tiled


def test_a_model_with_nothing_to_tile_compiles_as_it_is():
    meta, _, batch = tiny_gpt_pair()
    assert tileable(meta) == 0
    assert minimum_budget(meta, batch, "cpu") == minimum_budget(meta, batch, "cpu", tile_bytes=0)
