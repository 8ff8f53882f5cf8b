"""CompileOptions (lazytrain/options.py): each choice refused once, where the value is built, with
a message naming the valid ones; the budget resolved in one place (None and "max" the device's
memory, "min" the smallest feasible, bytes as given); `options=` or keyword settings, never both;
and the options a schedule was compiled with kept on the Compiled."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lazytrain import hardware
from lazytrain.errors import PlanError
from lazytrain.options import CompileOptions, apply_options
from lazytrain.pipeline import analyse, compile_model, minimum_budget, resolve_budget
from models import tiny_gpt_pair

GiB = 1 << 30
CPU = hardware.load("cpu")


@pytest.mark.parametrize("settings,message", [
    (dict(budget="most"), "budget 'most' is not a GPU budget; pass bytes (an integer >= 0), 'min'"),
    (dict(budget=-1), "budget -1 is not a GPU budget"),
    (dict(budget=1.5e9), "budget 1500000000.0 is not a GPU budget"),
    (dict(time_limit=0), "time_limit 0 is not a solver time limit; pass a number of seconds > 0"),
    (dict(dtype="bfloat16"), "dtype 'bfloat16' is not a compute dtype; pass a floating torch dtype"),
    (dict(dtype=torch.int64), "dtype torch.int64 is not a compute dtype"),
    (dict(optimizer_states="4bit"), "optimizer_states '4bit' is not a state precision; use one of 32bit, 8bit"),
    (dict(master_weights="fp16"), "master_weights 'fp16' is not a master precision; use one of fp32, bf16"),
    (dict(loss_chunk_bytes=-1), "loss_chunk_bytes -1 is not a working set; pass bytes (an integer >= 0; 0 never chunks)"),
    (dict(world_size=0), "world_size 0 is not a number of ranks; pass an integer >= 1 (1: one process)"),
    (dict(world_size=True), "world_size True is not a number of ranks"),
    (dict(shard_state="yes"), "shard_state 'yes' is not a choice; pass True (shard over the ranks), False"),
    (dict(clipping="global"), "clipping 'global' is not a mode; use one of exact, previous-norm, off"),
    (dict(disk="yes"), "disk 'yes' is not a choice; pass True (the plan may use the disk tier) or False"),
])
def test_refusals_name_the_valid_choices(settings, message):
    with pytest.raises(PlanError) as info:
        CompileOptions(**settings)
    assert message in str(info.value)
    with pytest.raises(PlanError, match="is not a"):  # a replace is checked as the constructor is
        dataclasses.replace(CompileOptions(), **settings)


def test_refused_before_the_capture():
    """A bad setting stops the compile before any stage runs: the model is never called."""
    class Untouchable(torch.nn.Module):
        def forward(self, x):
            raise AssertionError("captured")

    with pytest.raises(PlanError, match="clipping 'global' is not a mode"):
        compile_model(Untouchable(), {"x": torch.zeros(1)}, GiB, "cpu", clipping="global")


def test_sharded_by_default_for_several_ranks():
    assert not CompileOptions().sharded
    assert CompileOptions(world_size=2).sharded
    assert not CompileOptions(world_size=2, shard_state=False).sharded
    assert CompileOptions(world_size=2, optimizer_states="8bit").sharded  # in whole quantisation blocks
    assert not CompileOptions(world_size=2, optimizer_states="8bit", shard_state=False).sharded  # --replicate-state
    assert not CompileOptions(world_size=1, shard_state=True).sharded  # one rank has nothing to shard over


@pytest.fixture(scope="module")
def gpt():
    meta, _, batch = tiny_gpt_pair()
    return meta, batch, analyse(meta, batch, CPU)[1]


def test_budget_resolution(gpt):
    meta, batch, stages = gpt
    assert resolve_budget(CompileOptions(), stages, CPU) == CPU.max_budget
    assert resolve_budget(CompileOptions(budget="max"), stages, CPU) == CPU.max_budget
    assert resolve_budget(CompileOptions(budget=12345), stages, CPU) == 12345
    smallest = resolve_budget(CompileOptions(budget="min"), stages, CPU)
    assert smallest == minimum_budget(meta, batch, CPU) == 331268  # the tiny GPT's (test_invalid.py)
    assert compile_model(meta, batch, "min", "cpu", time_limit=20).plan.budget == smallest
    assert compile_model(meta, batch, "max", "cpu", time_limit=20).plan.budget == CPU.max_budget


def test_the_stages_get_the_options_fields(gpt):
    _, _, stages = gpt
    options = CompileOptions(optimizer_states="8bit", master_weights="bf16", world_size=2, shard_state=False,
                             clipping="previous-norm", disk=True)
    got = apply_options(stages, options, CPU)
    assert (got.state_bytes, got.master_bytes, got.world_size, got.sharded, got.clipping, got.disk) == (
        2.0 + 8.0 / 256, 2, 2, False, "previous-norm", True)
    assert apply_options(got, CompileOptions(), CPU) == stages
    no_link = dataclasses.replace(CPU, link_bandwidth=0.0)
    with pytest.raises(PlanError, match="has no link_bandwidth"):
        apply_options(stages, CompileOptions(world_size=2), no_link)


def test_options_and_settings_together_are_refused(gpt):
    meta, batch, _ = gpt
    options = CompileOptions(budget=GiB)
    with pytest.raises(PlanError, match="time_limit given beside options="):
        compile_model(meta, batch, hardware="cpu", options=options, time_limit=20)
    with pytest.raises(PlanError, match="budget given beside options="):
        compile_model(meta, batch, GiB, "cpu", options=options)
    with pytest.raises(PlanError, match="world_size given beside options="):
        minimum_budget(meta, batch, "cpu", options=options, world_size=2)


def test_compiled_keeps_its_options(gpt):
    meta, batch, _ = gpt
    options = CompileOptions(budget="min", time_limit=20, clipping="previous-norm")
    compiled = compile_model(meta, batch, hardware="cpu", options=options)
    assert compiled.options is options
    assert compiled.stages.clipping == "previous-norm"
    by_keywords = compile_model(meta, batch, "min", "cpu", time_limit=20, clipping="previous-norm")
    assert by_keywords.options == options
    assert by_keywords.source_text == compiled.source_text
