"""8-bit optimizer states (bitsandbytes' blockwise-quantised AdamW8bit) chosen at compile time:
the plan counts their smaller size, keeps host-stepped stages' states fp32 (NOTE: [State precision
per stage] in solver/formulation.py), and the steps equal bitsandbytes' own optimizer on the 8-bit
stages and torch's AdamW on the 32-bit ones, with the same clipping."""

import copy
import dataclasses

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from lazytrain import hardware  # noqa: E402
from lazytrain.pipeline import compile_model, minimum_budget  # noqa: E402
from lazytrain.runtime.schedule import load_source  # noqa: E402
from lazytrain.summary import summary  # noqa: E402
from checks import reference_optimizers
from models import tiny_gpt_pair  # noqa: E402

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
# The CPU profile with a host AdamW as slow as its 8-bit device step, or far slower: the planner
# then mixes host-stepped 32-bit stages with 8-bit ones, or keeps every step on the device.
HOST_RATE = {"resident": 1e5, "streamed": 1e5, "mixed": 5e6}


def _schedule(meta, batch, case, name, master="fp32"):
    hw = dataclasses.replace(hardware.load("cpu"), cpu_adamw_params_per_s=HOST_RATE[case], cpu_round_params_per_s=1e12)
    opts = dict(optimizer_states="8bit", master_weights=master)
    budget = 1 << 30 if case == "resident" else minimum_budget(meta, batch, hw, **opts)
    if case == "streamed":  # where the smallest plan has no room to apply a GPU-stepped update between
        budget = int(budget * 1.1)  # steps (NOTE: [Flushed updates] in solver/footprint.py), it steps on the host
    c = compile_model(meta, batch, budget, hw, **opts)
    return c, load_source(c.source_text, name)


def _forced(meta, batch, spec, name, master):
    from lazytrain.codegen.render import render
    from lazytrain.passes.lower import lower
    from lazytrain.solver.solve import evaluate
    from lazytrain.pipeline import analyse
    from plans import decisions

    hw = hardware.load("cpu")
    graph, stages = analyse(meta, batch, hw, optimizer_states="8bit", master_weights=master)
    plan = evaluate(stages, hw, 1 << 40, decisions(spec))
    return load_source(render(graph, stages, plan, lower(stages, plan, hw), batch, hw.name, "8bit", master), name)


@pytest.fixture(scope="module")
def gpt():
    return tiny_gpt_pair()


def test_eight_bit_states_shrink_the_smallest_budget(gpt):
    meta, _, batch = gpt
    assert minimum_budget(meta, batch, "cpu", optimizer_states="8bit") < minimum_budget(meta, batch, "cpu")


def test_host_stepped_stages_keep_fp32_states(gpt):
    meta, _, batch = gpt
    c, module = _schedule(meta, batch, "mixed", "lt_8bit_placement")
    for d, s in zip(c.plan.decisions, module.STAGES):
        assert s.states == ("32bit" if d.optimizer == "cpu" else "8bit"), s.name
    line = next(ln for ln in summary(module).splitlines() if ln.startswith("optimizer states"))
    assert "8bit AdamW; 32-bit on the host-stepped stages" in line
    # the plan's host bytes count 8 bytes of states per host-stepped parameter, 2 for a GPU-stepped one
    host_32 = sum(s.param_numel for s in module.STAGES if s.states == "32bit")
    assert host_32 and c.plan.host_bytes >= 8 * host_32


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("case", ["resident", "streamed", "mixed"])
def test_steps_equal_the_reference_optimizers(gpt, case, clip):
    """Unclipped, every weight equals the references'. Clipped, our coefficient may differ from
    `clip_grad_norm_`'s in the last bit (a sum of per-stage squares, not a norm of norms), which 8-bit
    moments can turn into a quantisation step: there the 32-bit stages still agree to 1e-5 and each
    8-bit update agrees within 2 %, the bound bitsandbytes' own tests allow between its 8-bit and
    32-bit optimizers."""
    meta, real, batch = gpt
    c, module = _schedule(meta, batch, case, f"lt_8bit_{case}")
    states = {s.states for s in module.STAGES}
    assert states == ({"8bit"} if case == "resident" else {"8bit", "32bit"})
    if case == "streamed":
        assert any(d.streamed and d.optimizer == "gpu" for d in c.plan.decisions)
    assert module.OPTIMIZER_STATES == "8bit" and "optimizer states (8bit AdamW" in summary(module)
    start, ours, ref = copy.deepcopy(real), copy.deepcopy(real), copy.deepcopy(real)
    trainer = module.bind(ours, max_grad_norm=clip, **HP)
    opts = reference_optimizers(module, ref, HP)
    for step in range(4):
        torch.manual_seed(step)
        b = {k: torch.randint(0, 96, v.shape) for k, v in batch.items()}
        trainer.step(b)
        for opt in opts:
            opt.zero_grad()
        ref(**b).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        for opt in opts:
            opt.step()
    trainer.synchronize()  # GPU-stepped streamed stages apply their last update here
    fp32 = {module.PLACEHOLDERS[p][1] for s in module.STAGES if s.states == "32bit" for p in s.params}
    for (name, p), q, p0 in zip(ours.named_parameters(), ref.parameters(), start.parameters()):
        if clip is None:
            assert torch.equal(p, q), name
        elif name in fp32:
            assert torch.allclose(p, q, atol=1e-5, rtol=0), name
        else:
            mine, theirs = p.detach() - p0, q.detach() - p0
            assert (mine - theirs).norm() <= 0.02 * theirs.norm() + 1e-7, name


@pytest.mark.parametrize("master", ["fp32", "bf16"])
def test_state_dict_round_trips_quantised_states_exactly(gpt, master, monkeypatch):
    """Both kinds of state in one state dict; with bf16 masters, loading must not cast the 32-bit
    stages' moments or step counts to bf16."""
    meta, real, batch = gpt
    # GPU-stepped streamed stages (8-bit) beside host-stepped ones (32-bit) and the resident ones,
    # decided here: which of the equally fast plans the solver picks is its own business
    module = _forced(meta, batch, ["-rk", "GRk", "SRk", "GRk", "-rk"], f"lt_8bit_sd_{master}", master)
    # host-stepped 32-bit stages, and 8-bit ones or the 8-bit shared (tied) embedding
    assert "32bit" in {s.states for s in module.STAGES} and ("8bit" in {s.states for s in module.STAGES} or module.SHARED)
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
    # loading puts GPU-stepped stages' states back into the host buffers the prefetch reads
    # (page-locked on a GPU), not into the loader's fresh copies
    homes = [t2.store.home[p] for names in t2.stepper.params.values() for p in names]
    assert homes
    before = [{k: v for k, v in t2.optimizer.state[h].items() if torch.is_tensor(v)} for h in homes]
    t2.load_state_dict(state)
    for h, old in zip(homes, before):
        assert old and all(t2.optimizer.state[h][k] is v for k, v in old.items())
    resumed = copy.deepcopy(first)
    t3 = module.bind(resumed, **HP)
    t3.load_state_dict(state)
    for st in t3.optimizer.state.values():  # 32-bit moments and step counts stay fp32 (bf16 masters)
        assert all(v.dtype == torch.float32 for k, v in st.items() if torch.is_tensor(v) and v.is_floating_point())
    for b in batches[2:]:
        t3.step(b)
    for (name, p), q in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(p, q), name


def test_fresh_states_leave_the_shared_quantisation_maps_where_they_are(gpt):
    """NOTE: [Shared quantisation maps] in runtime/optim8bit.py: making a parameter's first states on
    another device (here `meta`, a disk job's host master on a GPU box) must not move the maps
    every other parameter's first step reads."""
    from lazytrain.runtime.optim import staged_optimizer

    params = [torch.nn.Parameter(torch.zeros(8192)) for _ in range(2)]
    opt = staged_optimizer("8bit", [{"params": [p]} for p in params], **HP)
    opt.fill_qmap()
    before = dict(opt.name2qmap)
    state = opt.fresh_state(0, torch.empty(8192, device="meta"),
                            lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta"))
    assert state["qmap1"].device.type == "meta"  # its own state's map is on its own device
    assert all(opt.name2qmap[k] is v and v.device.type == "cpu" for k, v in before.items())
