"""CPU replay of compiled schedules against eager PyTorch (DESIGN.md, correctness contract).

For the tiny GPT (tied embeddings), the shipped tiny Qwen example, a tinier Qwen2 and a tiny Llama, each at three budgets (everything
resident, a middle budget, and exactly `minimum_budget`): one `forward_backward` gives eager's loss
and every parameter's gradient; three `step`s give the weights of `torch.optim.AdamW` with the same
hyperparameters; two `forward_backward`s accumulate like two `loss.backward()`s.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain.passes.verify import verify
from lazytrain.pipeline import compile_model, minimum_budget
from checks import check_adamw_steps, assert_grads_match, bind_source, check_replay, eager_grads
from models import ModelSpec, BlockSpec, hf_pair, random_block_model, tiny_gpt_pair, tiny_qwen_pair

GiB = 1 << 30
# Non-default values, so a trainer that ignored one of them would show. eps is large enough that
# gradients of ~1e-9 (rounding noise in eager too) do not turn into lr-sized Adam updates.
HP = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)
MODELS = {
    "tiny_gpt": tiny_gpt_pair,
    "tiny_qwen": tiny_qwen_pair,
    "qwen2": lambda: hf_pair("qwen2", layers=2),
    "llama": lambda: hf_pair("llama", layers=3),
}
BUDGETS = ("resident", "middle", "minimum")


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request):
    """One model: (name, meta, real, batch, smallest budget, {budget name: Compiled})."""
    meta, real, batch = MODELS[request.param]()
    smallest = minimum_budget(meta, batch, "cpu")
    budgets = {"resident": GiB, "middle": smallest * 3 // 2, "minimum": smallest}
    compiled = {name: compile_model(meta, batch, b, "cpu", source=request.param, time_limit=20)
                for name, b in budgets.items()}
    return request.param, meta, real, batch, smallest, compiled


@pytest.mark.parametrize("budget", BUDGETS)
def test_plan_fits_budget(case, budget):
    """The plan's predicted peak and the verifier's event-by-event trace stay within the budget."""
    _, _, _, _, smallest, compiled = case
    c = compiled[budget]
    assert smallest <= c.plan.budget
    assert c.plan.peak_bytes <= c.plan.budget
    assert max(c.memory_trace) <= c.plan.budget
    assert verify(c.schedule) == c.memory_trace


def test_minimum_budget_is_tight(case):
    """At exactly the smallest feasible budget the plan uses all of it."""
    _, _, _, _, smallest, compiled = case
    assert compiled["minimum"].plan.peak_bytes == smallest


@pytest.mark.parametrize("budget", BUDGETS)
def test_forward_backward_equals_eager(case, budget):
    """Loss and every parameter's gradient equal eager `loss.backward()` within 1e-5."""
    _, _, real, batch, _, compiled = case
    check_replay(compiled[budget].source_text, real, batch)


@pytest.mark.parametrize("budget", BUDGETS)
def test_steps_equal_torch_adamw(case, budget):
    """Three `step`s == three steps of a fresh torch.optim.AdamW over model.parameters()."""
    _, _, real, batch, _, compiled = case
    losses = check_adamw_steps(compiled[budget].source_text, real, batch, 3, **HP)
    assert losses[0] > losses[-1], "three AdamW steps on one batch should lower its loss"


def test_forward_backward_accumulates(case):
    """Two `forward_backward` calls accumulate like two eager `loss.backward()` calls."""
    _, _, real, batch, _, compiled = case
    ref_loss, ref_grads = eager_grads(real, batch, times=2)
    trainer, model = bind_source(compiled["minimum"].source_text, real)
    trainer.forward_backward(batch)
    loss = trainer.forward_backward(batch)
    assert_grads_match(model, loss, ref_loss, ref_grads)


def test_loss_discards_gradients_and_steps_go_on_unchanged(case):
    """`loss` (an evaluation) gives eager's loss, leaves no gradient anywhere, and training after it
    steps exactly as training without it."""
    _, _, real, batch, _, compiled = case
    ref_loss, _ = eager_grads(real, batch)
    text = compiled["minimum"].source_text
    evaluated, model = bind_source(text, real, **HP)
    plain, other = bind_source(text, real, **HP)
    evaluated.step(batch)
    plain.step(batch)
    assert torch.isfinite(evaluated.loss(batch))
    assert all(p.grad is None for p in model.parameters())
    for _ in range(2):
        assert torch.equal(evaluated.step(batch), plain.step(batch))
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    fresh, _ = bind_source(text, real)
    assert torch.allclose(fresh.loss(batch), ref_loss, atol=1e-5, rtol=1e-5)


def test_an_evaluation_fetches_streamed_weights_ahead_as_the_step_does(case):
    """NOTE: [Evaluation fetches ahead] in runtime/forward_only.py: each streamed stage is fetched
    once, no later than its own forward, and on the smallest budget of a model that streams more than
    one stage some fetch starts before an earlier stage's forward (beside compute). `check_replay`
    checks that the slots held at each forward are the step's."""
    from lazytrain.runtime.forward_only import fetches_ahead

    _, _, _, _, _, compiled = case
    c = compiled["minimum"]
    stages = c.stages.stages
    streamed = [g.index for g, p in zip(stages, c.plan.decisions) if p.streamed and not p.weights.cast_on_use]
    ahead = fetches_ahead(c.schedule.events, c.plan.decisions)
    fetched = [t for ts in ahead.values() for t in ts]
    assert sorted(fetched) == sorted(set(fetched)) and set(fetched) <= set(streamed)
    assert all(t >= s for s, ts in ahead.items() for t in ts)  # never after its own forward
    if len(streamed) > 1:
        assert any(t > s for s, ts in ahead.items() for t in ts), ahead


def test_loss_depends_on_labels(case):
    """Different labels give a different loss: the replay reads the labels it is given."""
    _, _, real, batch, _, compiled = case
    trainer, _ = bind_source(compiled["resident"].source_text, real)
    other = dict(batch)
    key = "labels" if "labels" in batch else "y"
    other[key] = torch.flip(batch[key], dims=[0])
    assert not torch.equal(trainer.forward_backward(batch), trainer.forward_backward(other))


@pytest.mark.parametrize("budget", ["resident", "minimum"])
def test_steps_with_gradient_clipping_equal_torch(budget):
    """`max_grad_norm` clips exactly like torch.nn.utils.clip_grad_norm_ before AdamW.

    (A model without attention: the key bias of attention gets gradients that are rounding noise,
    which Adam amplifies, so it cannot pin 1e-6 after several clipped steps.)"""
    meta, real, batch = random_block_model(ModelSpec(
        (BlockSpec("mlp", 24, "gelu"), BlockSpec("norm", 16, "tanh"), BlockSpec("linear", 16)), tied=True, table="grad"))
    smallest = minimum_budget(meta, batch, "cpu")
    c = compile_model(meta, batch, GiB if budget == "resident" else smallest, "cpu", time_limit=20)
    trainer, model = bind_source(c.source_text, real, max_grad_norm=0.05, **HP)
    ref = copy.deepcopy(real)
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    for _ in range(3):
        trainer.step(batch)
        opt.zero_grad()
        ref(**batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        assert trainer.last_grad_norm == pytest.approx(norm.item(), rel=1e-5)
    trainer.synchronize()
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), name


def test_lr_scheduler_and_state_dict_resume(case):
    """An LR scheduler attached to `trainer.optimizer` acts as on torch's AdamW, and optimizer state
    saved after two steps and loaded into a fresh trainer continues to the same third step."""
    _, _, real, batch, _, compiled = case
    text = compiled["minimum"].source_text
    hp = dict(HP, lr=1e-3)
    trainer, model = bind_source(text, real, **hp)
    sched = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=1, gamma=0.5)
    for _ in range(2):
        trainer.step(batch)
        sched.step()
    state = copy.deepcopy(trainer.state_dict())
    resumed, resumed_model = bind_source(text, model, **hp)
    resumed.load_state_dict(state)
    resumed.step(batch)
    resumed.synchronize()

    ref = copy.deepcopy(real)
    opt = torch.optim.AdamW(ref.parameters(), **hp)
    ref_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        out = ref(**batch)
        (out.loss if hasattr(out, "loss") else out).backward()
        opt.step()
        ref_sched.step()
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [hp["lr"] / 4] * len(resumed.optimizer.param_groups)
    for (name, got), want in zip(resumed_model.named_parameters(), ref.parameters()):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), name
