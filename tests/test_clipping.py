"""Gradient clipping modes (NOTE: [Gradient clipping] in runtime/stepping.py): what each schedule
plans for, and what bind and step do with `max_grad_norm`."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from lazytrain import hardware
from lazytrain.errors import ScheduleMismatch, TrainingError
from lazytrain.pipeline import analyse, compile_model, minimum_budget
from lazytrain.solver.footprint import cpu_step_s
from lazytrain.solver.solve import evaluate
from checks import bind_source
from models import BlockSpec, ModelSpec, random_block_model
from plans import decisions

HP = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)
GiB = 1 << 30


def _model():
    # no attention: its key bias's gradients are rounding noise that Adam amplifies (test_replay)
    return random_block_model(ModelSpec(
        (BlockSpec("mlp", 24, "gelu"), BlockSpec("norm", 16, "tanh"), BlockSpec("linear", 16)), tied=True, table="grad"))


@pytest.mark.parametrize("budget", ["resident", "minimum"])
def test_previous_norm_clips_by_the_step_before(budget):
    """With "previous-norm" the first step clips by its own norm and every later one by the norm of
    the step before, as torch would with that coefficient; `last_grad_norm` is one step behind."""
    meta, real, batch = _model()
    smallest = minimum_budget(meta, batch, "cpu")
    c = compile_model(meta, batch, GiB if budget == "resident" else smallest, "cpu", time_limit=20,
                      clipping="previous-norm")
    trainer, model = bind_source(c.source_text, real, max_grad_norm=0.05, **HP)
    ref = copy.deepcopy(real)
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    previous = None
    for i in range(4):
        trainer.step(batch)
        opt.zero_grad()
        ref(**batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()  # the norm alone
        used = norm if previous is None else previous
        for p in ref.parameters():
            p.grad.mul_(min(1.0, 0.05 / (used + 1e-6)))
        opt.step()
        assert trainer.last_grad_norm == pytest.approx(used, rel=1e-5)
        previous = norm
    trainer.synchronize()
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), name


def test_previous_norm_stops_after_a_step_that_was_not_finite():
    """A non-finite gradient was already applied under "previous-norm": the next step stops, naming the fix."""
    meta, real, batch = _model()
    c = compile_model(meta, batch, minimum_budget(meta, batch, "cpu"), "cpu", time_limit=20, clipping="previous-norm")
    trainer, _ = bind_source(c.source_text, real, max_grad_norm=1.0, **HP)
    trainer.step(batch)
    bad = {k: v.clone() for k, v in batch.items()}
    key = next(k for k, v in bad.items() if v.is_floating_point())
    bad[key][0] = float("nan")
    trainer.step(bad)
    with pytest.raises(TrainingError, match="--clipping exact"):
        trainer.step(batch)


def test_a_schedule_without_clipping_refuses_max_grad_norm():
    meta, real, batch = _model()
    c = compile_model(meta, batch, GiB, "cpu", time_limit=20, clipping="off")
    with pytest.raises(ScheduleMismatch, match="--clipping off"):
        bind_source(c.source_text, real, max_grad_norm=1.0)
    trainer, _ = bind_source(c.source_text, real, **HP)  # unclipped, it binds
    assert torch.isfinite(trainer.step(batch))


def test_an_unknown_clipping_mode_is_refused():
    meta, _, batch = _model()
    with pytest.raises(Exception, match="previous-norm"):
        compile_model(meta, batch, GiB, "cpu", clipping="sometimes")


def test_exact_clipping_keeps_host_steps_out_of_backward():
    """NOTE: [Host step deadlines]: with exact clipping a host step starts after backward and ends
    before its next prefetch. So a slow host lengthens no backward window, and the first stage's
    step (prefetched in `pre`) lands in the tail; unclipped, host steps lengthen backward windows."""
    meta, _, batch = random_block_model(ModelSpec(tuple(BlockSpec("mlp", 32) for _ in range(6))))
    fast = hardware.load("cpu")
    slow = dataclasses.replace(fast, cpu_adamw_params_per_s=3e7)
    stages = analyse(meta, batch, fast)[1]
    streamed = decisions(["SRk"] * len(stages))

    def windows(clipping, hw):
        plan = evaluate(dataclasses.replace(stages, clipping=clipping), hw, 1 << 40, streamed)
        return {label: secs for label, _, secs in plan.windows}
    exact, exact_fast, off, off_fast = (windows(c, hw) for c in ("exact", "off") for hw in (slow, fast))
    backward = [w for w in exact if w.startswith("B")]
    assert [exact[w] for w in backward] == pytest.approx([exact_fast[w] for w in backward], abs=1e-12)
    assert sum(off[w] for w in backward) > sum(off_fast[w] for w in backward) + 1e-5
    first = cpu_step_s(stages[0].param_bytes, stages[0].param_numel, slow, stages.master_bytes)
    # the slow host's time lands after backward (the tail and the next forward, a tie between them)
    outside = lambda w, fast_w: sum(w[k] - fast_w[k] for k in w if not k.startswith("B"))
    assert exact["tail"] >= first - 1e-12 and outside(off, off_fast) < outside(exact, exact_fast)
