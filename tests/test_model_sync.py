"""After `step()`, the bound model's normal APIs see the updated weights without `sync_model()`.

A GPU-stepped streamed stage lands its update at the next prefetch (NOTE: [GPU-stepped streamed
stages] in solver/formulation.py), so right after `step()` the model's own parameters hold the weights of
one step before. `state_dict()`, `forward` and `save_pretrained` must apply it first (NOTE: [Model
sync hooks] in runtime/model_sync.py). Every test here forces such a plan and checks that the update
really was still pending when the model was read, so it tests the deferral, not a plan without one.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from lazytrain import hardware
from lazytrain.ir.placement import Outputs
from lazytrain.pipeline import analyse
from lazytrain.runtime.schedule import load_source
from checks import adamw_reference, bind_source
from models import hf_pair, tiny_gpt_pair, unique_name
from plans import decisions, forced, repair

HW = hardware.load("cpu")
# eps well above the gradients' float noise: AdamW's first step moves a weight by lr * g / (|g| + eps),
# whose slope in g is up to 1 / (4 eps); at eps=1e-6 a v_proj gradient of 1.5e-6 turned replay-vs-eager
# float noise (1e-9, 1e-8 of the tensor's largest) into 1.7e-6 of weight (AMD EPYC, AVX2, 2026-11-30)
HP = dict(lr=1e-2, eps=1e-4, weight_decay=0.1)
# a host-stepped streamed stage between two GPU-stepped ones, and a resident prologue
PLAN = ["-Rk", "GRk", "SRk", "GRk", "-rk"]


@pytest.fixture(scope="module")
def gpt():
    """(schedule text, real model, batch, reference model after 2 torch AdamW steps)."""
    meta, real, batch = tiny_gpt_pair()
    graph, stages = analyse(meta, batch, HW)
    text = forced(graph, stages, batch, decisions(PLAN), HW).source_text
    return text, real, batch, adamw_reference(real, batch, 2, **HP)


def stepped(text, real, batch, steps: int = 2):
    trainer, model = bind_source(text, real, **HP)
    for _ in range(steps):
        trainer.step(batch)
    assert trainer.stepper.pending, "the plan must leave GPU steps pending after step()"
    return trainer, model


def assert_weights(state: dict, ref: torch.nn.Module):
    want = ref.state_dict()
    assert state.keys() == want.keys()
    for name, w in want.items():
        err = (state[name] - w).abs().max().item()
        assert torch.allclose(state[name], w, atol=1e-6, rtol=1e-5), f"{name}: differs from torch AdamW by {err:.3g}"


def test_state_dict_sees_pending_updates(gpt):
    text, real, batch, ref = gpt
    trainer, model = stepped(text, real, batch)
    assert_weights(model.state_dict(), ref)
    assert not trainer.stepper.pending
    # once synchronised, the parameters themselves hold the new weights
    assert_weights({n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}, ref)


def test_submodule_state_dict_sees_pending_updates(gpt):
    text, real, batch, ref = gpt
    _, model = stepped(text, real, batch)
    block = model.blocks[2]  # its stage (3) is GPU-stepped
    got = block.state_dict()
    want = ref.blocks[2].state_dict()
    for name, w in want.items():
        assert torch.allclose(got[name], w, atol=1e-6, rtol=1e-5), name


def test_forward_sees_pending_updates(gpt):
    text, real, batch, ref = gpt
    _, model = stepped(text, real, batch)
    with torch.no_grad():
        got, want = model(**batch), ref(**batch)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), f"forward {got.item()} != torch AdamW's {want.item()}"


def test_training_continues_after_a_synchronising_read(gpt):
    """A read between steps applies the pending update early; the next step starts from it and
    the weights still follow torch's AdamW. An evaluation under inference mode, which applies the
    first update of each stage (creating its optimizer states), leaves training working."""
    text, real, batch, _ = gpt
    trainer, model = stepped(text, real, batch, steps=1)
    with torch.inference_mode():
        model(**batch)
    trainer.step(batch)
    model.state_dict()
    trainer.step(batch)
    assert_weights(model.state_dict(), adamw_reference(real, batch, 3, **HP))


def test_hooks_are_cheap_when_nothing_is_pending(gpt, monkeypatch):
    text, real, batch, _ = gpt
    trainer, model = stepped(text, real, batch)
    model.state_dict()
    calls = []
    monkeypatch.setattr(trainer, "synchronize", lambda: calls.append(1))
    model.state_dict()
    with torch.no_grad():
        model(**batch)
    assert not calls


def test_rebinding_lands_the_old_trainers_updates_and_detaches_it(gpt):
    """Binding the model again starts from the updated weights; the first trainer's hooks go."""
    text, real, batch, ref = gpt
    old, model = stepped(text, real, batch)
    new = load_source(text, unique_name()).bind(model, **HP)
    assert not old.stepper.pending
    assert_weights({n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}, ref)
    old.step(batch)  # the old trainer steps on: the model no longer consults it
    assert old.stepper.pending
    model.state_dict()
    assert old.stepper.pending
    new.step(batch)
    assert new.stepper.pending
    model.state_dict()
    assert not new.stepper.pending


def test_garbage_collected_trainer_leaves_no_hooks(gpt):
    text, real, batch, _ = gpt
    trainer, model = stepped(text, real, batch)
    model.state_dict()
    hooks = sum(len(m._forward_pre_hooks) + len(m._state_dict_pre_hooks) for m in model.modules())
    assert hooks > 0
    del trainer
    gc.collect()
    assert sum(len(m._forward_pre_hooks) + len(m._state_dict_pre_hooks) for m in model.modules()) == 0
    with torch.no_grad():
        model(**batch)


def test_bound_model_still_copies_and_pickles(gpt, tmp_path):
    """A copy of a bound model is not bound: its hooks are inert, and the model pickles."""
    text, real, batch, ref = gpt
    trainer, model = stepped(text, real, batch)
    clone = copy.deepcopy(model)
    assert trainer.stepper.pending  # copying read nothing through the hooks
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    loaded.state_dict()
    clone.state_dict()
    assert trainer.stepper.pending
    assert_weights(model.state_dict(), ref)


def test_save_pretrained_sees_pending_updates(tmp_path):
    """A tiny Qwen2: every stage with weights streamed and stepped on the GPU; save_pretrained
    right after step() writes torch AdamW's weights."""
    from safetensors.torch import load_file

    meta, real, batch = hf_pair("qwen2", layers=2)
    graph, stages = analyse(meta, batch, HW)
    decs = repair(stages, [(True, True, Outputs.KEEP, True)] * len(stages))
    assert any(d.kind == "prefetch" for d in decs)
    text = forced(graph, stages, batch, decs, HW).source_text
    trainer, model = bind_source(text, real, **HP)
    trainer.step(batch)
    assert trainer.stepper.pending
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    want = adamw_reference(real, batch, 1, **HP).state_dict()
    assert saved.keys() <= want.keys() and saved
    for name, t in saved.items():
        assert torch.allclose(t, want[name], atol=1e-6, rtol=1e-5), name


def test_the_plan_leaves_room_to_apply_a_pending_update_between_steps():
    """`sync_model()` (and a checkpoint, or `model.state_dict()`) applies a pending GPU update between
    steps, beside the resident weights, states and gradients: a weight slot and an `opt:S` buffer
    (NOTE: [Flushed updates] in solver/footprint.py). The plan's tail, and so its peak, counts the
    largest."""
    from lazytrain.solver.footprint import flush_bytes
    from lazytrain.solver.formulation import tail_bytes
    from lazytrain.solver.solve import evaluate

    meta, _, batch = tiny_gpt_pair()
    _, stages = analyse(meta, batch, HW)
    decs = decisions(PLAN)
    flush = max(flush_bytes(stages, s) for s, d in enumerate(decs) if d.kind == "prefetch")
    no_gpu_steps = [d if d.kind != "prefetch" else decisions(["SRk"])[0] for d in decs]
    assert flush > 0 and tail_bytes(stages, decs, HW) == tail_bytes(stages, no_gpu_steps, HW) + flush
    plan = evaluate(stages, HW, 1 << 40, decs)
    assert plan.peak_bytes >= tail_bytes(stages, decs, HW)
