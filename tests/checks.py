"""Checks shared by the compiler tests: a schedule's replay against eager PyTorch (loss and every
gradient, `check_replay`; `replay_equals_eager` is the correctness contract of DESIGN.md), its steps
against the reference optimizers, and resumes bit for bit.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lazytrain.ir.events import Kind, Phase
from lazytrain.pipeline import compile_model
from lazytrain.runtime.forward_only import whole_step_reason
from lazytrain.runtime.schedule import load_source

from models import HW, unique_name


ATOL = RTOL = 1e-5


def assert_train_resumes_bit_identically(schedule, tmp_path, capsys) -> None:
    """`lazytrain train --schedule` of the built-in model, 4 steps with checkpoints every 2, its
    offload files under --offload-dir while it runs and gone after; a run killed after its step-2
    checkpoint (its later checkpoint removed) and resumed ends with the uninterrupted run's
    weights, to the bit."""
    import shutil

    from safetensors.torch import load_file

    from lazytrain.cli import main

    offload = tmp_path / "offload"
    offload.mkdir()
    whole, killed = tmp_path / "whole", tmp_path / "killed"

    def train(run_dir, *extra):
        argv = ["train", "--schedule", schedule, "--steps", 4, "--checkpoint-dir", run_dir, "--checkpoint-every", 2,
                "--offload-dir", offload, "--no-progress", *extra]
        assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
        assert offload_files(offload) == []  # preallocated for the run, removed at its end

    train(whole)
    shutil.copytree(whole, killed)
    shutil.rmtree(killed / "checkpoints" / "step-00000004")
    (killed / "checkpoints" / "LATEST").write_text("step-00000002\n")
    train(killed, "--resume")
    capsys.readouterr()
    a, b = (load_file(str(r / "checkpoints" / "step-00000004" / "model.safetensors")) for r in (whole, killed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def mapped_ranges(path) -> list[tuple[int, int]]:
    """The address ranges this process maps `path` at (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == str(path):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi))
    return out


def resident_kib(path) -> int:
    """KiB of this process's mappings of `path` resident in its memory (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


# ---- eager reference and replay ------------------------------------------------------------------

def _loss(out) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out


def eager_grads(real: nn.Module, batch: dict, times: int = 1):
    """Loss and {parameter name: grad} of eager PyTorch on a deepcopy of `real`."""
    model = copy.deepcopy(real)
    model.train()
    loss = None
    for _ in range(times):
        loss = _loss(model(**batch))
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_grads_match(model: nn.Module, loss, ref_loss, ref_grads, atol=ATOL, rtol=RTOL):
    assert loss is not None, "the replay returned no loss"
    assert torch.allclose(loss, ref_loss, atol=atol, rtol=rtol), f"loss {loss.item()} != eager {ref_loss.item()}"
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        got = grads[name]
        if ref is None:
            assert got is None or not got.any(), f"{name}: eager has no gradient, replay has one"
            continue
        assert got is not None, f"{name}: replay left no gradient"
        assert got.shape == ref.shape, f"{name}: gradient shape {tuple(got.shape)} != {tuple(ref.shape)}"
        err = (got - ref).abs().max().item()
        assert torch.allclose(got, ref, atol=atol, rtol=rtol), f"{name}: gradient differs from eager by {err:.3g}"


def adamw_reference(real: nn.Module, batch: dict, steps: int, **hp) -> nn.Module:
    """A deepcopy of `real` after `steps` eager steps of a fresh torch.optim.AdamW over its parameters."""
    model = copy.deepcopy(real)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), **hp)
    for _ in range(steps):
        opt.zero_grad()
        _loss(model(**batch)).backward()
        opt.step()
    return model


def check_adamw_steps(source_text: str, real: nn.Module, batch: dict, steps: int, **hp) -> list[torch.Tensor]:
    """`steps` of the schedule's `step` leave the weights `steps` eager torch.optim.AdamW steps
    would (1e-6); returns the losses."""
    trainer, model = bind_source(source_text, real, **hp)
    losses = [trainer.step(batch) for _ in range(steps)]
    trainer.synchronize()
    assert_adamw_weights(model, real, batch, steps, **hp)
    return losses


def assert_adamw_weights(model: nn.Module, real: nn.Module, batch: dict, steps: int, **hp) -> None:
    """`model`'s weights are those `steps` eager torch.optim.AdamW steps from `real` give (1e-6)."""
    ref = adamw_reference(real, batch, steps, **hp)
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), \
            f"{name} differs from torch.optim.AdamW by {(got - want).abs().max().item():.3g}"


def assert_previous_norm_steps(source_text: str, real: nn.Module, batch: dict, max_norm: float, steps: int = 3, **hp):
    """`steps` steps of a previous-norm schedule give torch.optim.AdamW's weights with every step
    clipped by the previous step's norm and the first, with none yet, not clipped (a schedule whose
    steps cannot wait for this step's norm); the norms are large enough for clipping to bite."""
    trainer, model = bind_source(source_text, real, max_grad_norm=max_norm, **hp)
    ref = copy.deepcopy(real)
    opt = torch.optim.AdamW(ref.parameters(), **hp)
    previous = None
    for _ in range(steps):
        trainer.step(batch)
        opt.zero_grad()
        ref(**batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()  # the norm alone
        coef = 1.0 if previous is None else min(1.0, max_norm / (previous + 1e-6))
        for q in ref.parameters():
            q.grad.mul_(coef)
        opt.step()
        previous = norm
    trainer.synchronize()
    assert previous > max_norm * 2  # the clipping bit
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), name


def bind_source(source_text: str, real: nn.Module, **optimizer_args):
    """Load a schedule and bind it to a deepcopy of `real`: (trainer, bound model)."""
    module = load_source(source_text, unique_name())
    model = copy.deepcopy(real)
    return module.bind(model, **optimizer_args), model


def two_on_disk(source_text: str, real: nn.Module, tmp_path, **optimizer_args):
    """The schedule bound twice, each to its own offload directory under `tmp_path` ("a", "b"):
    ((trainer, model), (trainer, model)), for a run against one that does something more."""
    bound = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        bound.append(bind_source(source_text, real, offload_dir=str(tmp_path / name), **optimizer_args))
    return tuple(bound)


def offload_files(directory) -> list[str]:
    """The files in an offload directory, by name."""
    return sorted(p.name for p in directory.iterdir())


def assert_disk_steps_equal_adamw(source_text: str, real: nn.Module, batch: dict, tmp_path, steps: int = 3, **hp):
    """A schedule with states on disk: its replay equals eager; bound with `tmp_path` as its offload
    directory it makes one offload file there, and `steps` steps give torch AdamW's weights. Returns
    the trainer, for the caller's checks of where the states are."""
    check_replay(source_text, real, batch)
    trainer, model = bind_source(source_text, real, offload_dir=str(tmp_path), **hp)
    [name] = offload_files(tmp_path)
    assert name.startswith("lazytrain-offload-")
    for _ in range(steps):
        trainer.step(batch)
    trainer.synchronize()
    assert_adamw_weights(model, real, batch, steps, **hp)
    return trainer


def assert_steps_agree(first, second, batch: dict, steps: int) -> None:
    """`steps` steps of two bound trainers, then the same weights in their models, to the bit."""
    for _ in range(steps):
        first.step(batch)
        second.step(batch)
    for trainer in (first, second):
        trainer.sync_model()
    for (name, a), b in zip(first.model.named_parameters(), second.model.parameters()):
        assert torch.equal(a, b), name


def assert_same_steps(texts, real: nn.Module, batch: dict, tmp_path, steps: int = 3, **bind) -> None:
    """Each schedule in `texts`, bound to `real` with `tmp_path` as its offload directory, `steps`
    steps: the same weights after them, to the bit, every one of them stepped."""
    weights = []
    for text in texts:
        trainer, model = bind_source(text, real, offload_dir=str(tmp_path), **bind)
        for _ in range(steps):
            trainer.step(batch)
        trainer.sync_model()
        weights.append([p.detach().clone() for p in model.parameters()])
    for (name, before), *got in zip(real.named_parameters(), *weights):
        assert all(torch.equal(got[0], w) for w in got[1:]), name
        assert not torch.equal(got[0], before), f"{name} was not stepped"


def assert_disk_resume_bit_identical(source_text: str, real: nn.Module, batch: dict, tmp_path, **hp) -> None:
    """A schedule with states on disk: 2 steps, a checkpoint (model weights and optimizer state), a
    new trainer loading it, 1 step give the same weights as 3 uninterrupted steps, to the bit; the
    checkpoint holds the states that were on disk. Each trainer has its own offload directory."""
    for d in "abc":
        (tmp_path / d).mkdir()
    whole, model = bind_source(source_text, real, offload_dir=str(tmp_path / "a"), **hp)
    for _ in range(3):
        whole.step(batch)
    whole.synchronize()
    first, half = bind_source(source_text, real, offload_dir=str(tmp_path / "b"), **hp)
    for _ in range(2):
        first.step(batch)
    first.synchronize()
    saved = copy.deepcopy(first.state_dict())
    assert all("exp_avg" in v for v in saved["state"].values())  # the disk stages' states are in it
    resumed, again = bind_source(source_text, copy.deepcopy(half), offload_dir=str(tmp_path / "c"), **hp)
    resumed.load_state_dict(saved)
    resumed.step(batch)
    resumed.synchronize()
    for (n, got), want in zip(again.named_parameters(), model.parameters()):
        assert torch.equal(got, want), n


def check_replay(source_text: str, real: nn.Module, batch: dict, atol=ATOL, rtol=RTOL) -> None:
    """One forward_backward of the schedule == eager loss.backward(), loss and every gradient; and
    an evaluation (`loss`, the forwards alone: NOTE: [Forward-only evaluation]) gives the same loss."""
    ref_loss, ref_grads = eager_grads(real, batch)
    trainer, model = bind_source(source_text, real)
    loss = trainer.forward_backward(batch)
    assert_grads_match(model, loss, ref_loss, ref_grads, atol, rtol)
    held = _weight_slots_at_forwards(trainer)
    assert torch.equal(trainer.loss(batch), loss)
    del trainer.replay._call  # the recording wrapper (an instance attribute) goes
    assert trainer.replay.env is None and not [s for s in trainer.store.slots if s.startswith("w:")]
    if whole_step_reason(trainer) is None:  # the forwards alone ran: NOTE: [Evaluation fetches ahead]
        step = _step_weights_at_forwards(trainer.replay.events)
        assert held and all(held[s] <= step[s] for s in held), (held, step)


def _weight_slots_at_forwards(trainer) -> dict[int, set[str]]:
    """The weight slots an evaluation holds at each stage's forward, recorded as it runs."""
    held, replay = {}, trainer.replay
    call = replay._call

    def recording(stage, grad, *args, **kwargs):
        held[stage.index] = {n for n in trainer.store.slots if n.startswith("w:")}
        return call(stage, grad, *args, **kwargs)
    replay._call = recording
    return held


def _step_weights_at_forwards(events) -> dict[int, set[str]]:
    """The weight buffers the step's event order holds at each stage's forward compute."""
    live, out = set(), {}
    for e in events:
        live |= {b for b in e.allocs if b.startswith("w:")}
        if e.kind is Kind.COMPUTE and e.phase is Phase.FWD:
            out[e.stage] = set(live)
        live -= set(e.frees)
    return out


def check_seeded_replay(source_text: str, real: nn.Module, batch: dict, seed: int = 7, steps: int = 0, **hp) -> None:
    """For models that draw random numbers (dropout): from the same seed, one forward_backward gives
    eager's loss and gradients; with `steps`, that many `step`s then give eager AdamW's weights."""
    torch.manual_seed(seed)
    ref_loss, ref_grads = eager_grads(real, batch)
    trainer, model = bind_source(source_text, real)
    torch.manual_seed(seed)
    assert_grads_match(model, trainer.forward_backward(batch), ref_loss, ref_grads)
    if steps:
        torch.manual_seed(seed)
        ref = adamw_reference(real, batch, steps, **hp)
        trainer, model = bind_source(source_text, real, **hp)
        torch.manual_seed(seed)
        for _ in range(steps):
            trainer.step(batch)
        trainer.synchronize()
        for (name, got), want in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), f"{name} differs from eager AdamW"


def replay_equals_eager(meta: nn.Module, real: nn.Module, batch: dict, budget: int, *, time_limit: float = 20.0,
                        atol=ATOL, rtol=RTOL):
    """Compile `meta` for `budget`, replay on a deepcopy of `real`, compare with eager. Returns the Compiled."""
    compiled = compile_model(meta, batch, budget, HW, source="tests", time_limit=time_limit)
    check_replay(compiled.source_text, real, batch, atol, rtol)
    return compiled


def reference_optimizers(module, model, hp: dict) -> list:
    """The optimizers one process would step for a schedule with 8-bit states: bitsandbytes'
    AdamW8bit over its 8-bit stages' parameters, torch's AdamW over its 32-bit (host-stepped) ones."""
    import bitsandbytes as bnb

    fp32 = {module.PLACEHOLDERS[p][1] for s in module.STAGES if s.states == "32bit" for p in s.params}
    params = dict(model.named_parameters())
    opts = [bnb.optim.AdamW8bit([p for n, p in params.items() if n not in fp32], **hp)]
    if fp32:
        opts.append(torch.optim.AdamW([p for n, p in params.items() if n in fp32], **hp))
    return opts
