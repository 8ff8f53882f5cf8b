"""GPU-stepped streamed stages with fp32 masters and bf16 compute prefetch from the master (NOTE:
[Weights from the master] in solver/footprint.py): the host keeps no bf16 copy, the plan counts
that, the schedule verifies at its predicted peak, and training gives bit for bit what the same
plan with a host copy gives, for each kind of GPU step."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from lazytrain import hardware
from lazytrain.pipeline import analyse
from lazytrain.solver import footprint
from lazytrain.solver import step_model
from lazytrain.solver.solve import evaluate
from checks import bind_source
from models import tiny_gpt_pair
from plans import decisions, forced

HW = hardware.load("cpu")
HP = dict(lr=1e-2, eps=1e-6)
SPECS = {  # blocks.0-2 of the tiny GPT, GPU-stepped each way
    "at the next prefetch": ["-rk", "GRk", "GRk", "GRk", "-rk"],
    "two windows ahead": ["-rk", "GRk", "GRk", "ERk", "-rk"],
    "in backward": ["-rk", "GRk", "BRk", "BRk", "-rk"],
    "from disk": ["-rk", "XRk", "GRk", "XRk", "-rk"],
}


@pytest.fixture(scope="module")
def mixed():
    """fp32 masters (the real model), bf16 compute (the captured one)."""
    meta, real, batch = tiny_gpt_pair()
    graph, stages = analyse(meta.to(torch.bfloat16), batch, HW)
    return graph, dataclasses.replace(stages, clipping="off", disk=True), batch, real


def _with_host_copy(monkeypatch):
    """The same passes with the rule off: every GPU-stepped stage keeps a bf16 host copy."""
    for mod in (step_model, footprint):  # lower and render ask `footprint.prefetches_from_master`
        monkeypatch.setattr(mod, "weights_from_master", lambda *args: False)


def _train(text: str, real, batch, tmp_path, steps: int = 3):
    tmp_path.mkdir()
    trainer, model = bind_source(text, real, offload_dir=str(tmp_path), **HP)
    losses = [trainer.step(batch).item() for _ in range(steps)]
    trainer.sync_model()
    return trainer, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", list(SPECS))
def test_training_equals_the_plan_with_a_host_copy(mixed, kind, tmp_path, monkeypatch):
    graph, stages, batch, real = mixed
    decs = decisions(SPECS[kind])
    cast = forced(graph, stages, batch, decs, HW)
    assert cast.source_text.count("from_master=True") == 3
    trainer, losses, weights = _train(cast.source_text, real, batch, tmp_path / "cast")
    for s in (1, 2, 3):
        for p in trainer.stages[s].params:
            assert trainer.store.source_is_master(p) and trainer.store.master[p].dtype == torch.float32
    with monkeypatch.context() as m:
        _with_host_copy(m)
        copied = forced(graph, stages, batch, decs, HW)
    assert "from_master" not in copied.source_text
    ref, ref_losses, ref_weights = _train(copied.source_text, real, batch, tmp_path / "copied")
    assert not ref.store.source_is_master(trainer.stages[1].params[0])  # that plan does keep a bf16 copy
    assert losses == ref_losses and losses[-1] < losses[0]
    for name, w in ref_weights.items():
        assert torch.equal(weights[name], w), f"{name} differs from the plan with a host copy"


def test_the_plan_counts_no_host_copy_and_the_master_on_the_link(mixed, monkeypatch):
    """Each such stage: its bf16 bytes off the host and its step's D2H, 2 more bytes a parameter on
    its backward prefetch, and its slot larger by its largest tensor in fp32."""
    _, stages, _, _ = mixed
    decs = decisions(SPECS["at the next prefetch"])
    cast = evaluate(stages, HW, 1 << 40, decs)
    with monkeypatch.context() as m:
        _with_host_copy(m)
        copied = evaluate(stages, HW, 1 << 40, decs)
    stepped = [stages[s] for s in (1, 2, 3)]
    assert copied.host_bytes - cast.host_bytes == sum(g.param_bytes for g in stepped)
    assert cast.peak_bytes > copied.peak_bytes


def test_fp32_compute_and_bf16_masters_keep_their_own_source(monkeypatch):
    """No cast to make: fp32 compute prefetches the master itself, as do bf16 masters."""
    meta, _, batch = tiny_gpt_pair()
    _, stages = analyse(copy.deepcopy(meta), batch, HW)
    decs = decisions(SPECS["at the next prefetch"])
    for st in (stages, dataclasses.replace(analyse(meta.to(torch.bfloat16), batch, HW)[1], master_bytes=2)):
        plain = evaluate(st, HW, 1 << 40, decs)
        with monkeypatch.context() as m:
            _with_host_copy(m)
            assert evaluate(st, HW, 1 << 40, decs).host_bytes == plain.host_bytes
