"""Small models and helpers shared by the compiler tests.

Every model is built twice: once under `torch.device("meta")` for the compiler (which never sees
real weights) and once on the CPU from a fixed seed for the replay. `replay_equals_eager` is the
correctness contract of DESIGN.md: replaying a schedule gives the eager loss and every parameter's
gradient within 1e-5.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lazytrain.codegen.render import render
from lazytrain.ir.events import Kind, Phase
from lazytrain.ir.placement import Internals, Outputs, Placement, Step, Tier, Weights
from lazytrain.passes.lower import lower
from lazytrain.passes.verify import verify
from lazytrain.pipeline import compile_model
from lazytrain.runtime.forward_only import whole_step_reason
from lazytrain.runtime.schedule import load_source
from lazytrain.solver.footprint import can_put_outputs_on_disk
from lazytrain.solver.solve import evaluate

ATOL = RTOL = 1e-5
HW = "cpu"
_names = itertools.count()


def examples(n: int) -> int:
    """Hypothesis example counts, scaled by LAZYTRAIN_HYPOTHESIS_SCALE (e.g. 10 for a long local run)."""
    return max(1, int(n * float(os.environ.get("LAZYTRAIN_HYPOTHESIS_SCALE", "1"))))


def unique_name(prefix: str = "lt_test_schedule") -> str:
    """A fresh module name for `load_source` (it registers the module in sys.modules)."""
    return f"{prefix}_{next(_names)}"


# ---- model pairs and batches ---------------------------------------------------------------------

def model_pair(build, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(meta copy for the compiler, real CPU copy with weights from `seed`)."""
    with torch.device("meta"):
        meta = build()
    torch.manual_seed(seed)
    real = build()
    return meta, real


def token_batch(batch: int, seq: int, vocab: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """input_ids and labels drawn independently (so a mixed-up input shows in the loss)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, vocab, (batch, seq), generator=g),
        "labels": torch.randint(0, vocab, (batch, seq), generator=g),
    }


def ragged(batch: dict) -> dict:
    """The batch with labels ignored (-100) unevenly: row 0 entirely, row 1 not at all, the others
    in growing runs, so every row counts its own number of targets (a chunked loss must divide by
    the global count, not average the chunks' means)."""
    labels = batch["labels"].clone()
    rows, seq = labels.shape
    labels[0] = -100
    for r in range(2, rows):
        labels[r, : (r * seq) // (rows + 1)] = -100
    return dict(batch, labels=labels)


def tiny_gpt_pair(seed: int = 0):
    from lazytrain.examples import tiny_gpt

    meta, real = model_pair(tiny_gpt.build_model, seed)
    return meta, real, token_batch(tiny_gpt.BATCH, tiny_gpt.SEQ, tiny_gpt.VOCAB)


def disk_gpt(hw, states: str = "32bit", clipping: str = "off", layers: int = 6, dim: int | None = None,
             compute: torch.dtype | None = None):
    """The tiny GPT with `layers` blocks, analysed on `hw` with the disk tier on: (graph, stages,
    batch, real model). `compute`: the dtype it is captured in (bfloat16: fp32 masters of bf16 weights)."""
    from lazytrain.examples import tiny_gpt
    from lazytrain.pipeline import analyse

    meta, real = model_pair(lambda: tiny_gpt.TinyGPT(dim=dim or tiny_gpt.DIM, layers=layers))
    batch = token_batch(tiny_gpt.BATCH, tiny_gpt.SEQ, tiny_gpt.VOCAB)
    graph, stages = analyse(meta.to(compute) if compute else meta, batch, hw, optimizer_states=states)
    return graph, dataclasses.replace(stages, disk=True, clipping=clipping), batch, real


def builtin_schedule(tmp_path, spec, hw, compute: torch.dtype | None = None):
    """The built-in model's schedule (lazytrain/examples/tiny_qwen.py) with the disk tier on and
    clipping off, its decisions `spec(number of stages)`, written to `tmp_path / "s.py"`; `compute`:
    the dtype it is captured in."""
    from pathlib import Path

    import lazytrain.examples
    from lazytrain.ir.capture import check_batch
    from lazytrain.ir.model_file import build_on_meta, load_model_file
    from lazytrain.pipeline import analyse

    path = Path(lazytrain.examples.__file__).parent / "tiny_qwen.py"
    build, example = load_model_file(path)
    batch = check_batch(example())
    meta = build_on_meta(build)
    graph, stages = analyse(meta.to(compute) if compute else meta, batch, hw, str(path))
    stages = dataclasses.replace(stages, disk=True, clipping="off")
    schedule = tmp_path / "s.py"
    schedule.write_text(forced(graph, stages, batch, decisions(spec(len(stages))), hw).source_text)
    return schedule


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


def tiny_qwen_pair(seed: int = 0):
    """The shipped example (lazytrain/examples/tiny_qwen.py: 4 layers, hidden 128, vocabulary 512)."""
    from lazytrain.examples import tiny_qwen

    meta, real = model_pair(tiny_qwen.build_model, seed)
    return meta, real, token_batch(tiny_qwen.BATCH, tiny_qwen.SEQ, tiny_qwen.config().vocab_size)


def hf_config(family: str, layers: int = 2, vocab: int = 128, hidden: int = 32):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[family]
    return cls(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )


def hf_pair(family: str, layers: int = 2, seed: int = 0, batch: int = 2, seq: int = 8, vocab: int = 128):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    cls = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}[family]
    cfg = hf_config(family, layers, vocab)
    meta, real = model_pair(lambda: cls(cfg), seed)
    return meta, real, token_batch(batch, seq, cfg.vocab_size)


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


# ---- forced plans --------------------------------------------------------------------------------

def producers(stages, s: int) -> set[int]:
    g = stages[s]
    return set(g.producers)


def repair(stages, raw) -> list[Placement]:
    """Turn any (stream, recompute, outputs[, gpu_step[, fetch ahead[, step in backward]]]) per stage into decisions
    that keep solve's rules:
    stream only with weights, and (but for the last stage) only when recomputing; chunked stages do
    not recompute; offload or drop only when the stage recomputes (a saving stage's autograd graph
    holds its outputs until its backward); offload only when every
    consumer recomputes and the last consumer is not the last stage; to disk only as offload, with
    the disk tier, and when the last consumer is stage S-3 or earlier; drop only for chain stages with
    resident weights whose next stage recomputes and none of whose producers offload."""
    S = len(stages)
    rec = [bool(r[1]) and stages[s].chunks == 1 for s, r in enumerate(raw)]
    # streamed stages recompute, but for the last (its weights stay from forward to backward)
    stream = [bool(r[0]) and stages[s].param_bytes > 0 and (rec[s] or s == S - 1) for s, r in enumerate(raw)]
    outs = [r[2] for r in raw]
    for s, g in enumerate(stages):
        if outs[s] is Outputs.DISK and not (stages.disk and can_put_outputs_on_disk(stages, s)):
            outs[s] = Outputs.OFFLOAD
        if outs[s] is not Outputs.KEEP and g.chunks == 1 and g.consumers and not rec[s]:
            outs[s] = Outputs.KEEP
        if outs[s].offloaded and (
                not g.consumers or g.consumers[-1] == S - 1 or not all(rec[c] for c in g.consumers)):
            outs[s] = Outputs.KEEP
        if outs[s] is Outputs.DROP and (not g.chain or stream[s] or not rec[s + 1]):
            outs[s] = Outputs.KEEP
    for s in range(S):
        if outs[s] is Outputs.DROP and any(outs[p].offloaded for p in producers(stages, s)):
            outs[s] = Outputs.KEEP
    gpu_step = [stream[s] and len(r) > 3 and bool(r[3]) for s, r in enumerate(raw)]
    ahead = [2 if gpu_step[s] and s >= 2 and len(r) > 4 and r[4] else 1 for s, r in enumerate(raw)]
    # a step in backward (NOTE: [Backward steps]): GPU-stepped, not ahead, not the first two or the last stage
    back = [gpu_step[s] and ahead[s] == 1 and 2 <= s < S - 1 and len(r) > 5 and bool(r[5]) for s, r in enumerate(raw)]
    internals = [Internals.RECOMPUTED if r else Internals.SAVED for r in rec]
    return [Placement(Weights(), internals[s], outs[s]) if not stream[s] else
            Placement(Weights(streamed=True, lookahead=ahead[s]), internals[s], outs[s],
                      Step.in_backward() if back[s] else Step.at_prefetch() if gpu_step[s] else Step.host())
            for s in range(S)]


# The first letter of a stage in `decisions`: its weights and its optimizer step's kind.
PLACES = {
    "-": (Weights(), Step.resident()),  # resident, stepped on the device as its backward ends
    "S": (Weights(streamed=True), Step.host()),  # streamed, stepped on the host
    "G": (Weights(streamed=True), Step.at_prefetch()),  # streamed, stepped on the device at its next prefetch
    "E": (Weights(streamed=True, lookahead=2), Step.at_prefetch()),  # G, fetched 2 windows ahead
    "B": (Weights(streamed=True), Step.in_backward()),  # streamed, stepped on the device right after its backward
    "D": (Weights(streamed=True), Step.host(Tier.DISK)),  # S, its states on disk
    "X": (Weights(streamed=True), Step.job()),  # streamed, stepped on the device by a job reading its states from disk
    "K": (Weights(streamed=True), Step.in_backward(Tier.DISK)),  # B, its states on disk
    "M": (Weights(streamed=True), Step.in_backward(Tier.DISK, Tier.DISK)),  # K, its fp32 master on disk too
}
INTERNALS = {"r": Internals.SAVED, "R": Internals.RECOMPUTED}
OUTPUTS = {"k": Outputs.KEEP, "o": Outputs.OFFLOAD, "d": Outputs.DROP, "f": Outputs.DISK}


def decisions(spec) -> list[Placement]:
    """Shorthand, three letters per stage -> its Placement: weights and step (`PLACES`: "-" resident,
    "S"/"G"/"E"/"B"/"D"/"X"/"K"/"M" streamed with the step kinds there), internals ("r" saved, "R"
    recomputed), outputs ("k" kept, "o" offloaded, "d" dropped, "f" offloaded on to the offload file).
    E.g. ["-Rd", "-Rd", "SRk"]: a dropped segment of two, then a streamed, recomputed stage. A
    combination no runtime path implements ("SRd": a streamed stage's outputs dropped) raises
    PlacementError here."""
    out = []
    for place, internals, outputs in spec:
        weights, step = PLACES[place]
        out.append(Placement(weights, INTERNALS[internals], OUTPUTS[outputs], step))
    return out


@dataclass(frozen=True)
class Forced:
    plan: object
    schedule: object
    trace: tuple[int, ...]
    source_text: str


def forced(graph, stages, batch, decs, hw, budget: int = 1 << 40, world_size: int = 1) -> Forced:
    """Evaluate fixed decisions, lower, verify at a budget of exactly the predicted peak, render
    (for `world_size` data-parallel ranks)."""
    plan = evaluate(stages, hw, budget, list(decs))
    schedule = lower(stages, plan, hw)
    trace = verify(dataclasses.replace(schedule, budget=plan.peak_bytes))
    text = render(graph, stages, plan, schedule, batch, hw.name, world_size=world_size)
    return Forced(plan, schedule, trace, text)


# ---- random block models -------------------------------------------------------------------------

ACTS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "silu": F.silu}
KINDS = ("linear", "mlp", "norm")


@dataclass(frozen=True)
class BlockSpec:
    kind: str  # "linear": act(Linear); "mlp": x + fc2(act(fc1(x))); "norm": act(Linear(LayerNorm(x)))
    width: int  # output width ("mlp": its hidden width; the output keeps the input width)
    act: str = "relu"


@dataclass(frozen=True)
class ModelSpec:
    blocks: tuple[BlockSpec, ...]
    d_in: int = 8
    width: int = 16  # width of the prologue's projection
    tied: bool = False  # the head reads the input projection's weight (transposed): a shared parameter
    table: str = "none"  # "none"; "const": a table made before the blocks (like rotary); "grad": one with gradient
    batch: int = 4

    def widths(self) -> list[int]:
        w = [self.width]
        for b in self.blocks:
            w.append(w[-1] if b.kind == "mlp" else b.width)
        return w


class _Block(nn.Module):
    def __init__(self, spec: BlockSpec, width_in: int):
        super().__init__()
        self.kind, self.act = spec.kind, ACTS[spec.act]
        if spec.kind == "linear":
            self.fc = nn.Linear(width_in, spec.width)
        elif spec.kind == "mlp":
            self.fc1 = nn.Linear(width_in, spec.width)
            self.fc2 = nn.Linear(spec.width, width_in)
        else:
            self.ln = nn.LayerNorm(width_in)
            self.fc = nn.Linear(width_in, spec.width)

    def forward(self, x, table):
        if table is not None:
            x = x * table
        if self.kind == "linear":
            return self.act(self.fc(x))
        if self.kind == "mlp":
            return x + self.fc2(self.act(self.fc1(x)))
        return self.act(self.fc(self.ln(x)))


class BlockModel(nn.Module):
    """inp: Linear(d_in, width) -> blocks (an nn.ModuleList) -> head to d_in -> mean squared error."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        widths = spec.widths()
        self.inp = nn.Linear(spec.d_in, spec.width)
        self.blocks = nn.ModuleList(_Block(b, w) for b, w in zip(spec.blocks, widths))
        if spec.tied:
            self.head_bias = nn.Parameter(torch.zeros(spec.d_in))
        else:
            self.head = nn.Linear(widths[-1], spec.d_in)

    def forward(self, x, y):
        h = self.inp(x)
        table = None
        if self.spec.table == "const":
            pos = torch.arange(x.shape[0], device=x.device, dtype=x.dtype).unsqueeze(-1)
            table = torch.cos(pos * 0.1) + 1.5
        elif self.spec.table == "grad":
            table = torch.sigmoid(h.mean(-1, keepdim=True)) + 0.5
        for block in self.blocks:
            h = block(h, table)
        out = F.linear(h, self.inp.weight.t(), self.head_bias) if self.spec.tied else self.head(h)
        return ((out - y) ** 2).mean()


def random_block_model(spec: ModelSpec | None = None, *, seed: int = 0, **kwargs):
    """(meta model, real model, batch) for a `ModelSpec` (or one built from kwargs)."""
    spec = spec or ModelSpec(**kwargs)
    if spec.tied and spec.widths()[-1] != spec.width:
        raise ValueError("a tied head needs the last width equal to the projection width")
    meta, real = model_pair(lambda: BlockModel(spec), seed)
    g = torch.Generator().manual_seed(seed + 1)
    batch = {"x": torch.randn(spec.batch, spec.d_in, generator=g), "y": torch.randn(spec.batch, spec.d_in, generator=g)}
    return meta, real, batch


def model_specs():
    """Hypothesis strategy for `ModelSpec`s: 1-5 blocks of random kinds and widths."""
    from hypothesis import strategies as st

    block = st.builds(BlockSpec, kind=st.sampled_from(KINDS), width=st.sampled_from((8, 12, 16, 24)),
                      act=st.sampled_from(tuple(ACTS)))

    @st.composite
    def specs(draw):
        blocks = draw(st.lists(block, min_size=1, max_size=5))
        width = draw(st.sampled_from((8, 16)))
        table = draw(st.sampled_from(("none", "const", "grad")))
        spec = ModelSpec(tuple(blocks), width=width, table=table)
        if draw(st.booleans()):
            last = spec.widths()[-1]
            if last != width:  # make the last block end at the projection width so the head can tie
                tail = blocks[-1]
                blocks[-1] = BlockSpec("linear" if tail.kind == "mlp" else tail.kind, width, tail.act)
            spec = ModelSpec(tuple(blocks), width=width, table=table, tied=True)
        return spec

    return specs()


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
