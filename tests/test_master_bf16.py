"""`--master-weights bf16`: the optimizer updates bf16 parameters through fp32 twins and rounds
back stochastically (NOTE: [bf16 master weights] in runtime/optim.py); the plan counts the
smaller masters."""

import copy

import pytest
import torch
from checks import bind_source
from models import tiny_gpt_pair, unique_name
from plans import decisions

from lazytrain.codegen.render import render
from lazytrain.passes.lower import lower
from lazytrain.pipeline import analyse, compile_model, minimum_budget
from lazytrain.runtime.optim import round_stochastic_
from lazytrain.runtime.schedule import load_source
from lazytrain.solver.solve import evaluate


def test_stochastic_rounding_is_unbiased_between_neighbours():
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    hi = torch.nextafter(lo, torch.tensor(2.0, dtype=torch.bfloat16))
    x = torch.full((200_000,), float(lo) + 0.25 * (float(hi) - float(lo)))
    torch.manual_seed(0)
    out = round_stochastic_(torch.empty_like(x, dtype=torch.bfloat16), x)
    assert set(out.unique().tolist()) == {float(lo), float(hi)}
    assert abs((out == hi).float().mean().item() - 0.25) < 0.01
    assert abs(out.float().mean().item() - x[0].item()) < 1e-4 * (float(hi) - float(lo)) * 100
    # exact values, signs and infinities survive
    y = torch.tensor([0.0, -3.0, 0.5, float("inf"), float("-inf")])
    assert torch.equal(round_stochastic_(torch.empty_like(y, dtype=torch.bfloat16), y).float(), y)


def _schedule(meta, batch, decisions=None, master="bf16"):
    if decisions is None:
        budget = minimum_budget(meta, batch, "cpu", master_weights=master)
        return compile_model(meta, batch, budget, "cpu", master_weights=master).source_text
    from lazytrain import hardware

    hw = hardware.load("cpu")
    graph, stages = analyse(meta, batch, hw, master_weights=master)
    plan = evaluate(stages, hw, 1 << 40, decisions)
    return render(graph, stages, plan, lower(stages, plan, hw), batch, hw.name, master_weights=master)


def _train(text, real, batch, steps, **hp):
    model = copy.deepcopy(real)
    trainer = load_source(text, unique_name()).bind(model, **hp)
    losses = [trainer.step(batch).item() for _ in range(steps)]
    trainer.synchronize()
    return model, losses


def test_bf16_masters_shrink_memory():
    """No fp32 copy beside resident bf16 weights, and half the host bytes for masters."""
    meta, _, batch = tiny_gpt_pair()
    meta = meta.to(torch.bfloat16)
    full = compile_model(meta, batch, None, "cpu")
    half = compile_model(meta, batch, None, "cpu", master_weights="bf16")
    assert half.plan.peak_bytes < full.plan.peak_bytes and half.plan.host_bytes < full.plan.host_bytes
    assert "MASTER_WEIGHTS = \"bf16\"" in half.source_text


def test_bf16_masters_train_like_fp32_masters():
    """Every placement (resident, streamed with a host step, streamed with a GPU step): the model's
    parameters become bf16, and 25 steps track the fp32-master run's losses."""
    meta, real, batch = tiny_gpt_pair()
    meta = meta.to(torch.bfloat16)
    d = decisions(["-Rk", "GRk", "SRk", "GRk", "-rk"])
    hp = dict(lr=3e-3, max_grad_norm=1.0)
    torch.manual_seed(0)
    model, ours = _train(_schedule(meta, batch, d), real, batch, 25, **hp)
    torch.manual_seed(0)
    _, ref = _train(_schedule(meta, batch, d, master="fp32"), real, batch, 25, **hp)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert ours[-1] < ours[0] - 1.0  # it trains
    for a, b in zip(ours, ref):
        assert abs(a - b) < 0.03 * abs(b) + 0.02, (ours, ref)


def test_updates_smaller_than_bf16_spacing_still_land():
    """With round-to-nearest, an update far below the spacing of bf16 near the weight is lost
    every step; stochastic rounding applies it with a probability, so some weights move."""
    meta, real, batch = tiny_gpt_pair()
    text = _schedule(meta.to(torch.bfloat16), batch)
    start = copy.deepcopy(real).to(torch.bfloat16)
    torch.manual_seed(0)
    model, _ = _train(text, real, batch, 1, lr=1e-6, weight_decay=0.0)
    # where |w| > 0.1 the bf16 spacing is over 4e-4: an Adam update of about lr = 1e-6 rounds away
    moved = sum(((p != q) & (q.abs() > 0.1)).sum().item() for p, q in zip(model.parameters(), start.parameters()))
    assert moved > 0


def test_bf16_masters_resume_bit_identical():
    """Rounding noise depends on (parameter, step) alone: a run checkpointed after 2 steps (which
    applies pending GPU-step updates early) and resumed ends bit-identical to a straight run."""
    meta, real, batch = tiny_gpt_pair()
    meta = meta.to(torch.bfloat16)
    d = decisions(["-Rk", "GRk", "SRk", "GRk", "-rk"])
    text = _schedule(meta, batch, d)
    batches = []
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        batches.append({k: torch.randint(0, 96, v.shape, generator=g) for k, v in batch.items()})
    hp = dict(lr=1e-3, max_grad_norm=1.0)
    straight = copy.deepcopy(real)
    t1 = load_source(text, unique_name()).bind(straight, **hp)
    for b in batches:
        t1.step(b)
    t1.synchronize()
    first = copy.deepcopy(real)
    t2 = load_source(text, unique_name()).bind(first, **hp)
    for b in batches[:2]:
        t2.step(b)
    state = copy.deepcopy(t2.state_dict())
    resumed = copy.deepcopy(first)
    t3 = load_source(text, unique_name()).bind(resumed, **hp)
    t3.load_state_dict(state)
    for b in batches[2:]:
        t3.step(b)
    t3.synchronize()
    for (name, p), q in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(p, q), name


def test_seeded_host_rounding_is_unbiased_and_reproducible():
    """The host path draws its noise in chunks on parallel generators (NOTE: [Host rounding noise])."""
    from lazytrain.runtime.optim import _NOISE_CHUNK

    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    hi = torch.nextafter(lo, torch.tensor(2.0, dtype=torch.bfloat16))
    x = torch.full((3 * _NOISE_CHUNK + 5,), float(lo) + 0.25 * (float(hi) - float(lo)))
    a = round_stochastic_(torch.empty_like(x, dtype=torch.bfloat16), x, seed=11)
    b = round_stochastic_(torch.empty_like(x, dtype=torch.bfloat16), x, seed=11)
    assert torch.equal(a, b)
    for part in a.split(_NOISE_CHUNK)[:3]:  # every chunk rounds up a quarter of the time: no repeated noise
        assert abs((part == hi).float().mean().item() - 0.25) < 0.01
    assert not torch.equal(a[:_NOISE_CHUNK], a[_NOISE_CHUNK:2 * _NOISE_CHUNK])
    c = round_stochastic_(torch.empty_like(x, dtype=torch.bfloat16), x, seed=12)
    assert not torch.equal(a, c)


def test_resident_steps_hold_their_twins_only_while_they_run():
    """Resident bf16 masters step through fp32 twins of their largest tensor (NOTE: [Resident
    steps]): the workspace sits on each resident stage's OPT_STEP event, and after backward, where
    clipping defers every step, the largest of them beside every resident gradient; nothing of it
    is held through the forward. Streaming the stage with the largest tensor shrinks the latter."""
    from lazytrain import hardware
    from lazytrain.solver.footprint import TWIN_BYTES, deferred_step_bytes

    meta, _, batch = tiny_gpt_pair()
    hw = hardware.load("cpu")
    _, stages = analyse(meta, batch, hw, master_weights="bf16")
    biggest = max(g.largest_numel for g in stages)
    everything = deferred_step_bytes(stages, [True] * len(stages))
    assert TWIN_BYTES == 12 and everything >= TWIN_BYTES * max(biggest, stages.largest_shared_numel)
    streamed = [g.largest_numel == biggest for g in stages]
    assert deferred_step_bytes(stages, [not x for x in streamed]) < everything
    last = len(stages) - 1
    resident = decisions(["-rk"] * len(stages))
    streaming = decisions([("G" if x else "-") + ("R" if x and s < last else "r") + "k" for s, x in enumerate(streamed)])
    for chosen, deferred in ((resident, everything), (streaming, deferred_step_bytes(stages, [not x for x in streamed]))):
        schedule = lower(stages, evaluate(stages, hw, 1 << 30, chosen), hw)
        assert not any(b.name == "twins" for b in schedule.buffers)
        steps = {e.stage: e.workspace for e in schedule.events if e.kind.value == "opt_step" and e.device == "gpu"}
        for s, d in enumerate(chosen):
            if not d.streamed:
                assert steps[s] >= TWIN_BYTES * stages[s].largest_numel
        assert schedule.events[-1].kind.value == "free" and schedule.events[-1].workspace == deferred
        first_bwd = next(i for i, e in enumerate(schedule.events) if e.phase is not None and e.phase.value == "bwd")
        assert all(e.workspace < TWIN_BYTES * biggest or e.phase is not None for e in schedule.events[:first_bwd])


def test_a_bf16_step_releases_each_twin_before_the_next(monkeypatch):
    """On the device each bf16 master steps through a fresh fp32 twin and gradient (NOTE:
    [Resident steps]): the plan counts one tensor's, so the previous tensor's must be gone before
    the next one's are made. Held one tensor longer, two equal tensors stepped at 16 bytes a
    parameter on the H200 instead of 12."""
    import weakref

    from lazytrain.runtime import optim

    made: list[weakref.ref] = []

    def fresh(t, role):  # what the device path does: a new tensor per call
        if role == "master":
            assert all(r() is None for r in made), "an earlier parameter's fp32 twin is still alive"
        out = t.float()
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(optim, "_fp32", fresh)
    params = [torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = optim.staged_optimizer("32bit", [{"params": params}], lr=1e-3)
    opt.step_group(0)
    assert len(made) == 6


def test_bf16_rounding_noise_lives_in_the_opt_slot():
    """A GPU-stepped bf16 master rounds back with int32 noise of its largest tensor, drawn into its
    `opt:S` slot (which the plan sized for it, NOISE_BYTES in solver/footprint.py), not into a fresh buffer."""
    meta, real, batch = tiny_gpt_pair()
    text = _schedule(meta, batch, decisions(["-Rk", "GRk", "GRk", "GRk", "-rk"]))
    trainer, _ = bind_source(text, real, lr=1e-3)
    seen = []
    inner = trainer.stepper.step

    def step(stage, group):
        u = trainer.stepper.live.get(stage)
        if u is not None:
            slot = trainer.store.slots[f"opt:{stage}"].untyped_storage().data_ptr()
            seen.append(u.noise is not None and u.noise.untyped_storage().data_ptr() == slot)
        inner(stage, group)
    trainer.stepper.step = step
    trainer.step(batch)
    trainer.step(batch)
    assert len(seen) == 3 and all(seen)


@pytest.mark.parametrize("states", ["32bit", "8bit"])
def test_large_tensors_step_in_pieces_as_one_step_would(states, monkeypatch):
    """A bf16 master larger than `TWIN_CHUNK` steps through twins of one piece at a time (NOTE:
    [Twin chunks] in sizes.py): three steps (the first makes the state) leave the same
    weights and the same optimizer state, bit for bit, as whole-tensor steps."""
    from lazytrain.runtime import optim

    if states == "8bit":
        pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    shapes = [(4096, 96), (1000, 37), (300,)]
    start = [(torch.randn(s) * 0.02).to(torch.bfloat16) for s in shapes]
    grads = [[(torch.randn(s) * 1e-2).to(torch.bfloat16) for s in shapes] for _ in range(3)]
    results = []
    for chunk in (optim.TWIN_CHUNK, 1024):
        monkeypatch.setattr(optim, "TWIN_CHUNK", chunk)
        params = [torch.nn.Parameter(t.clone()) for t in start]
        fused = {"fused": True} if states == "32bit" else {}
        opt = optim.staged_optimizer(states, [{"params": params, "states": states, **fused}], lr=1e-2, weight_decay=0.1)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step_group(0)
        pieces = len(optim.twin_pieces(opt.state[params[0]], params[0].numel()))
        results.append((pieces, [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])))
    (one, whole, whole_state), (many, cut, cut_state) = results
    assert one == 1 and many == 4096 * 96 // 1024
    assert all(torch.equal(a, b) for a, b in zip(whole, cut))
    assert whole_state.keys() == cut_state.keys()
    def same(a, b):  # bitsandbytes nests its quantised state in a dict
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return torch.equal(a, b) if torch.is_tensor(a) else a == b
    for i in whole_state:
        assert same(whole_state[i], cut_state[i]), i
