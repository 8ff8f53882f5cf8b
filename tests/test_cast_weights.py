"""Resident weights cast on use (NOTE: [Resident weights cast on use] in solver/footprint.py): a
resident stage with fp32 masters and bf16 compute keeps no bf16 copy between uses. The plan counts
the copy only in its forward and backward windows, the schedule casts into a slot before each and
verifies at the plan's peak, and training gives bit for bit what the same plan with a kept copy
gives. Stages that save internals, drop outputs, or hold fp32 weights cannot."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lazytrain import hardware
from lazytrain.errors import PlanError
from lazytrain.ir.events import Kind, Phase, Stream
from lazytrain.ir.placement import PlacementError, Weights
from lazytrain.pipeline import analyse
from lazytrain.solver.solve import evaluate, smallest_budget, solve
from checks import bind_source
from models import tiny_gpt_pair
from plans import decisions, forced

HW = hardware.load("cpu")
HP = dict(lr=1e-2, eps=1e-6)
SPEC = ["-rk", "-Rk", "-Rk", "SRk", "-rk"]  # blocks.0 and blocks.1 resident and recomputed
CAST = (1, 2)


def casting(spec=SPEC, stages=CAST) -> list:
    cast = Weights(cast_on_use=True)
    return [dataclasses.replace(d, weights=cast) if s in stages else d for s, d in enumerate(decisions(spec))]


@pytest.fixture(scope="module")
def mixed():
    """fp32 masters (the real model), bf16 compute (the captured one)."""
    meta, real, batch = tiny_gpt_pair()
    graph, stages = analyse(meta.to(torch.bfloat16), batch, HW)
    return graph, dataclasses.replace(stages, clipping="off"), batch, real


def test_the_plan_counts_the_copy_in_its_windows_only(mixed):
    _, stages, _, _ = mixed
    kept = evaluate(stages, HW, 1 << 40, decisions(SPEC))
    cast = evaluate(stages, HW, 1 << 40, casting())
    S = len(stages)
    before = {w[0]: w[1] for w in kept.windows}
    after = {w[0]: w[1] for w in cast.windows}
    for label in [w[0] for w in kept.windows[1:]]:  # "pre" holds no memory row
        used = {s for s in CAST if label in (f"F{s}", f"B{s}")}
        saved = sum(stages[s].param_bytes for s in CAST if s not in used)
        assert before[label] - after[label] == saved, label
    assert S and cast.recompute_s > kept.recompute_s  # the casts' time
    assert cast.step_s > kept.step_s


def test_the_schedule_casts_before_each_use_and_verifies_at_the_plans_peak(mixed):
    graph, stages, batch, _ = mixed
    f = forced(graph, stages, batch, casting(), HW)  # verifies at exactly the predicted peak
    events = f.schedule.events
    for s in CAST:
        casts = [e for e in events if e.kind is Kind.PREFETCH and e.stage == s]
        assert len(casts) == 2 and all(e.stream is Stream.COMPUTE for e in casts)
        for e, phase in zip(casts, (Phase.FWD, Phase.BWD)):
            use = next(x for x in events if x.kind is Kind.COMPUTE and x.stage == s and x.phase is phase)
            free = next(x for x in events if x.kind is Kind.FREE and x.frees == (f"w:{s}",) and x.id > use.id)
            assert e.id < use.id < free.id
    assert f.source_text.count("Weights(cast_on_use=True)") == 2


def test_training_equals_the_plan_with_a_kept_copy(mixed):
    graph, stages, batch, real = mixed

    def train(decs):
        trainer, model = bind_source(forced(graph, stages, batch, decs, HW).source_text, real, **HP)
        losses = [trainer.step(batch).item() for _ in range(3)]
        trainer.sync_model()
        return trainer, losses, {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer, losses, weights = train(casting())
    for s in CAST:  # between steps no bf16 copy is held
        for p in trainer.stages[s].params:
            assert trainer.store.work[p].numel() == 0 and trainer.store.home[p].dtype == torch.float32
    _, ref_losses, ref_weights = train(decisions(SPEC))
    assert losses == ref_losses and losses[-1] < losses[0]
    for name, w in ref_weights.items():
        assert torch.equal(weights[name], w), f"{name} differs from the plan with a kept copy"


def test_gradients_without_a_step_equal_the_kept_copys(mixed):
    graph, stages, batch, real = mixed
    grads = []
    for decs in (casting(), decisions(SPEC)):
        trainer, model = bind_source(forced(graph, stages, batch, decs, HW).source_text, real)
        trainer.forward_backward(batch)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[1].items():
        assert torch.equal(grads[0][name], g), name


@pytest.mark.parametrize("spec", [["-rk", "-rk", "-Rk", "SRk", "-rk"],   # blocks.0 saves its internals
                                  ["-rk", "-Rd", "-Rk", "SRk", "-rk"]])  # blocks.0 drops its outputs
def test_saving_or_dropping_stages_cannot(spec):
    with pytest.raises(PlacementError, match="cast on use need recomputed internals and outputs that are not dropped"):
        casting(spec, stages=(1,))  # refused as the placement is built, before any plan


def test_fp32_weights_cannot_and_the_solver_casts_where_memory_binds(mixed):
    meta, real, batch = tiny_gpt_pair()
    _, fp32 = analyse(meta, batch, HW)
    with pytest.raises(PlanError):
        evaluate(fp32, HW, 1 << 40, casting())
    _, stages, _, _ = mixed
    kept = evaluate(stages, HW, 1 << 40, decisions(["-Rk"] * (len(stages) - 1) + ["-rk"]))
    hw = dataclasses.replace(HW, host_memory_bytes=kept.host_bytes)  # no room on the host to stream a block
    least = smallest_budget(stages, hw)
    plan = solve(stages, hw, least)
    assert any(d.weights.cast_on_use for d in plan.decisions)
