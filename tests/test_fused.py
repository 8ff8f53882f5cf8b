"""Fused stage bodies (NOTE: [Fused stages] in lazytrain/runtime/fused.py): stages of one block kind
share one compiled body, random stages stay eager, and a step with fused stages equals eager
PyTorch (Inductor's C++ backend on the CPU, fp32), with internals saved and recomputed and with
the loss in compiled chunks."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from lazytrain.examples import tiny_qwen
from lazytrain.pipeline import compile_model
from lazytrain.runtime import fused
from lazytrain.runtime.schedule import load_source
from checks import assert_grads_match
from plans import decisions


# Inductor's C++ backend compiles the fused bodies on the CPU; without a compiler the CPU keeps the
# eager path, and the GPU tests (tests/test_gpu.py) cover the fused one
needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler for Inductor's CPU backend")


def _schedule(budget="max", **kw):
    batch = tiny_qwen.example_batch()
    return load_source(compile_model(tiny_qwen.build_model(), batch, budget, "cpu", source="tests", **kw).source_text,
                       "fused_test"), batch


def test_stages_of_a_kind_share_one_body():
    module, _ = _schedule()
    stages = fused.fuse(module.STAGES)
    kinds = {}
    for s in stages:
        if fused.fusable(s):
            kinds.setdefault(s.kind, set()).add(id(s.fn))
    assert kinds["B"] and all(len(ids) == 1 for ids in kinds.values())  # one compiled body a kind
    assert fused.bodies(stages) == len(kinds)
    assert all(a.fn is b.fn for a, b in zip(module.STAGES, stages) if not fused.fusable(a))


def test_a_planned_body_that_fails_to_compile_stops_the_step_but_a_loss_slice_falls_back():
    """NOTE: [Fused plans run fused], [Compiled loss slices]: a fused plan counted the layers at their
    compiled bytes, and the chunked loss stage at eager's."""
    module, _ = _schedule(loss_chunk_bytes=1)
    stages = fused.fuse(module.STAGES, planned=True)
    assert stages[-1].chunks > 1
    assert [s.fn.planned for s in stages if isinstance(s.fn, fused._Timed)] == [s.chunks == 1 for s in stages]


def test_bodies_that_differ_are_not_shared():
    def f(device, x):
        """stage one"""
        return (x + 1,)

    def g(device, y):
        """stage two"""
        return (y + 1,)

    def h(device, x):
        """stage three"""
        return (x + 2,)

    assert fused._body(f.__code__, f.__doc__) == fused._body(g.__code__, g.__doc__)
    assert fused._body(f.__code__, f.__doc__) != fused._body(h.__code__, h.__doc__)


def _ragged_batch() -> dict:
    """Random tokens whose rows ignore (-100) unevenly many targets: a chunked loss's mean is over
    the whole batch's count (NOTE: [Chunked loss] in lazytrain/runtime/chunked.py)."""
    g = torch.Generator().manual_seed(1)
    rows, seq = tiny_qwen.BATCH, tiny_qwen.SEQ
    ids = torch.randint(0, tiny_qwen.config().vocab_size, (rows, seq), generator=g)
    labels = ids.clone()
    for row in range(rows):
        labels[row, seq - 7 * row:] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(seq).expand(rows, seq).clone()}


@needs_compiler
@pytest.mark.parametrize("plan", ["saved", "recomputed", "tiled", "chunked"])
def test_a_fused_step_equals_eager(plan):
    """Every layer's body compiled: the loss and gradients equal eager PyTorch's, with the layers'
    internals saved (autograd over the compiled forward) and recomputed (compiled forward without
    autograd, then again with it before backward), with tiled MLPs and norms (lazytrain's
    operators inside a compiled body, their backward through their own autograd formula), and with
    the loss stage in chunks, its slice body compiled (NOTE: [Compiled loss slices]), whose
    evaluation without autograd gives the step's loss."""
    torch.manual_seed(0)
    batch = tiny_qwen.example_batch() if plan != "chunked" else _ragged_batch()
    model = tiny_qwen.build_model()
    reference = copy.deepcopy(model)
    if plan in ("saved", "tiled", "chunked"):
        module, _ = _schedule(tile_bytes=1024 if plan == "tiled" else 0, **({"loss_chunk_bytes": 1} if plan == "chunked" else {}))
        assert (plan == "tiled") == any("rms_norm" in s.fn.__code__.co_names for s in module.STAGES)
        assert (plan == "chunked") == (module.STAGES[-1].chunks > 1)
    else:
        from lazytrain import hardware
        from lazytrain.codegen.render import render
        from lazytrain.passes.lower import lower
        from lazytrain.pipeline import analyse
        from lazytrain.solver.solve import evaluate

        hw = hardware.load("cpu")
        graph, stages = analyse(tiny_qwen.build_model(), batch, hw)
        spec = ["-Rk" if s.kind == "B" else "-rk" for s in stages]
        p = evaluate(stages, hw, 1 << 40, decisions(spec))
        module = load_source(render(graph, stages, p, lower(stages, p, hw), batch, hw.name, "32bit", "fp32"), "fused_r")
        assert any(s.placement.recomputed for s in module.STAGES)
    with pytest.warns(UserWarning, match="planned with stage bodies eager"):  # priced eager, run fused
        trainer = module.bind(model, device="cpu", fuse_stages=True)
    assert fused.bodies(trainer.stages) >= 1
    loss = trainer.forward_backward(batch)
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    assert_grads_match(model, loss, ref_loss.detach(), {n: p.grad for n, p in reference.named_parameters()})
    assert fused.compile_seconds() > 0
    assert isinstance(trainer.stages[-1].fn, fused._Timed)  # the loss stage compiled too, chunked or not
    assert not any(s.fn.failed for s in trainer.stages if isinstance(s.fn, fused._Timed))  # none fell back to eager
    if plan == "chunked":  # the evaluation's slices, compiled without autograd: the step's loss
        torch.testing.assert_close(trainer.loss(batch), loss.detach(), rtol=1e-5, atol=1e-6)


@needs_compiler
def test_lazytrain_train_fuses_on_request_and_leaves_compiling_out_of_the_step(tmp_path, capsys):
    """`lazytrain train --fuse-stages on` on the CPU: the first step compiles, says so, and its
    record's time leaves the compile out (tok/s is the step's, not the compiler's), which
    `test_a_steps_record_leaves_out_what_it_spent_compiling` checks apart from the machine's load:
    here, under the other test worker's, a warm compile once took 2.4 s and its step 2.6; the losses
    equal an eager run's from the same seed."""
    import json

    from lazytrain.cli import main

    logs = {}
    for mode in ("off", "on"):
        log = tmp_path / f"{mode}.jsonl"
        assert main(["train", "--steps", "3", "--fuse-stages", mode, "--log", str(log), "--no-progress"]) == 0
        logs[mode] = [json.loads(line) for line in log.read_text().splitlines()]
    out = capsys.readouterr().out
    assert out.count("compiled fused stage bodies in") >= 1
    assert "compile_s" in logs["on"][0] and "compile_s" not in logs["off"][0]
    for a, b in zip(logs["off"], logs["on"]):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * abs(a["loss"])


@needs_compiler
def test_a_compiled_body_saves_no_more_than_its_plan_counts():
    """NOTE: [Fused saved activations]: each compiled body, run under autograd, saves for backward
    (beyond its inputs and weights) the bytes its fused plan counts or fewer (within 1 %), for the
    layers fewer than eager."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from lazytrain import hardware
    from lazytrain.pipeline import analyse

    batch = tiny_qwen.example_batch()
    hw = hardware.load("cpu")
    graph, planned = analyse(tiny_qwen.build_model(), batch, hw, fuse_stages=True)
    _, eager = analyse(tiny_qwen.build_model(), batch, hw, fuse_stages=False)
    module, _ = _schedule(fuse_stages=True)
    trainer = module.bind(tiny_qwen.build_model(), device="cpu", fuse_stages=True)

    def value(name):
        spec = graph[name].spec
        if not spec.is_float:
            return torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype))
        return torch.randn(spec.shape, dtype=getattr(torch, spec.dtype)).requires_grad_(name in planned.requires_grad)
    checked = 0
    for stage in trainer.stages:
        if not isinstance(stage.fn, fused._Timed) or not planned[stage.index].saved_bytes:
            continue
        args = [value(n) for n in stage.placeholders + stage.inputs]
        given = {StorageWeakRef(a.untyped_storage()) for a in args}
        saved = {}

        def pack(t):
            if (key := StorageWeakRef(t.untyped_storage())) not in given:
                saved[key] = t.untyped_storage().nbytes()
            return t
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stage.fn(torch.device("cpu"), *args)
        # within 1 %: the loss stage's compiled body keeps its shifted labels (4 KiB here), which
        # neither count sees
        assert sum(saved.values()) <= 1.01 * planned[stage.index].saved_bytes, stage.name
        checked += ".layers." in stage.name and planned[stage.index].saved_bytes < eager[stage.index].saved_bytes
    assert checked >= 2  # the layers: fewer than eager


def test_a_steps_record_leaves_out_what_it_spent_compiling(tmp_path, monkeypatch):
    """Whatever the machine's load: a first step made to take 100 s longer, which the compile count
    says was compiling, is recorded at its own time, with the 100 s as its `compile_s`."""
    import json
    import time
    import types

    from lazytrain.cli import main
    from lazytrain.runtime.trainer import Trainer
    from lazytrain.train import loop

    compiled = [0.0]
    step = Trainer.step

    def compiles_first(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        compiled[0] = 100.0  # the clock and the compile count move on together, once
        return out
    monkeypatch.setattr(Trainer, "step", compiles_first)
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + compiled[0]))
    monkeypatch.setattr(loop, "compile_seconds", lambda: compiled[0])
    log = tmp_path / "log.jsonl"
    assert main(["train", "--steps", "2", "--fuse-stages", "off", "--log", str(log), "--no-progress"]) == 0
    first, second = [json.loads(line) for line in log.read_text().splitlines()]
    assert first["compile_s"] == 100.0 and first["step_s"] < 50 and "compile_s" not in second
