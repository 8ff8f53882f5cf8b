"""8-bit optimizer states (bitsandbytes' blockwise-quantised AdamW8bit) chosen at compile time:
the plan counts their smaller size, and the steps equal bitsandbytes' own optimizer with the same
clipping."""

import copy

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from lazytrain.pipeline import compile_model, minimum_budget  # noqa: E402
from lazytrain.runtime.schedule import load_source  # noqa: E402
from lazytrain.summary import summary  # noqa: E402
from models import tiny_gpt_pair  # noqa: E402

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)


def _schedule(meta, batch, budget, name):
    c = compile_model(meta, batch, budget, "cpu", optimizer_states="8bit")
    return c, load_source(c.source_text, name)


@pytest.fixture(scope="module")
def gpt():
    return tiny_gpt_pair()


def test_eight_bit_states_shrink_the_smallest_budget(gpt):
    meta, _, batch = gpt
    assert minimum_budget(meta, batch, "cpu", optimizer_states="8bit") < minimum_budget(meta, batch, "cpu")


@pytest.mark.parametrize("where", ["resident", "smallest"])
def test_clipped_steps_equal_bitsandbytes_adamw8bit(gpt, where):
    meta, real, batch = gpt
    budget = 1 << 30 if where == "resident" else minimum_budget(meta, batch, "cpu", optimizer_states="8bit")
    c, module = _schedule(meta, batch, budget, f"lt_8bit_{where}")
    assert module.OPTIMIZER_STATES == "8bit" and "optimizer states (8bit AdamW)" in summary(module)
    ours, ref = copy.deepcopy(real), copy.deepcopy(real)
    trainer = module.bind(ours, max_grad_norm=0.5, **HP)
    opt = bnb.optim.AdamW8bit(ref.parameters(), **HP)
    for step in range(4):
        torch.manual_seed(step)
        b = {k: torch.randint(0, 96, v.shape) for k, v in batch.items()}
        trainer.step(b)
        opt.zero_grad()
        ref(**b).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    trainer.synchronize()  # GPU-stepped streamed stages apply their last update here
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-5, rtol=0), name


def test_state_dict_round_trips_quantised_states_exactly(gpt):
    meta, real, batch = gpt
    _, module = _schedule(meta, batch, minimum_budget(meta, batch, "cpu", optimizer_states="8bit"), "lt_8bit_sd")
    batches = []
    for step in range(4):
        torch.manual_seed(10 + step)
        batches.append({k: torch.randint(0, 96, v.shape) for k, v in batch.items()})
    straight = copy.deepcopy(real)
    t1 = module.bind(straight, **HP)
    for b in batches:
        t1.step(b)

    first = copy.deepcopy(real)
    t2 = module.bind(first, **HP)
    for b in batches[:2]:
        t2.step(b)
    state = copy.deepcopy(t2.state_dict())
    resumed = copy.deepcopy(first)
    t3 = module.bind(resumed, **HP)
    t3.load_state_dict(state)
    for b in batches[2:]:
        t3.step(b)
    for (name, p), q in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(p, q), name
