"""Fused stages in the plan (NOTE: [Fused stage prices] in lazytrain/passes/fusion.py): fusable
stages priced at their fused element-wise time, chunked and random ones eager; the schedule's
FUSED and header; the runtime's default following FUSED on a GPU only; the plan cache's key; the
factor's arithmetic; Inductor's cache folder (NOTE: [Compile cache] in runtime/fused.py)."""

from __future__ import annotations

import dataclasses
import types
import warnings

import pytest
import torch

from lazytrain import hardware
from lazytrain.errors import ScheduleMismatch
from lazytrain.examples import tiny_qwen
from lazytrain.analysis.fused_saved import trace
from lazytrain.ir.stages import fusable
from lazytrain.options import CompileOptions
from lazytrain.passes.fusion import FACTOR_FLOOR, elementwise_share, factor_from_times, fusion
from lazytrain.pipeline import analyse, compile_model
from lazytrain.runtime import fused
from lazytrain.runtime.schedule import load_source
from lazytrain.solver import plancache
from lazytrain.solver.solve import evaluate
from plans import decisions

H200 = hardware.load("h200")


def _stages(fuse: bool, hw=H200, **kw):
    return analyse(tiny_qwen.build_model(), tiny_qwen.example_batch(), hw, fuse_stages=fuse, **kw)


def test_fusable_stages_are_priced_at_the_fused_factor():
    """Every fusable stage's forward, backward and recompute lose (1 - factor) of its element-wise
    time; a plan of the same decisions predicts a step shorter by that much, summed."""
    f = H200.fused_elementwise_factor
    assert f == pytest.approx(0.252)
    (_, eager), (_, fused_) = _stages(False), _stages(True)
    assert not eager.fused and fused_.fused
    ew = 0.0
    for e, g in zip(eager, fused_):
        assert fusable(e) and e.elementwise_s > 0 and e.elementwise_bwd_s > 0
        assert g.fwd_s == pytest.approx(e.fwd_s - (1 - f) * e.elementwise_s)
        assert g.bwd_s == pytest.approx(e.bwd_s - (1 - f) * e.elementwise_bwd_s)
        assert g.remat_s == pytest.approx(e.remat_s - (1 - f) * e.elementwise_s)
        ew += e.elementwise_s + e.elementwise_bwd_s
    spec = ["-rk"] * len(eager)  # resident, internals saved: no recompute, nothing exposed
    a, b = evaluate(eager, H200, 1 << 40, decisions(spec)), evaluate(fused_, H200, 1 << 40, decisions(spec))
    assert a.compute_s - b.compute_s == pytest.approx((1 - f) * ew)
    assert a.step_s - b.step_s == pytest.approx((1 - f) * ew, rel=1e-6)


def test_random_stages_keep_their_eager_times_and_chunked_ones_their_eager_bytes():
    """NOTE: [Compiled loss slices]: a chunked stage is priced fused, at eager's bytes even with
    the graph that traces the unchunked bodies' memory; a random stage keeps eager's times."""
    graph, stages = _stages(False)
    last = len(stages) - 1
    chunked = dataclasses.replace(stages[last], chunks=4)
    random = dataclasses.replace(stages[2], random=True)
    mixed = dataclasses.replace(stages, stages=stages.stages[:2] + (random,) + stages.stages[3:last] + (chunked,),
                                fused=True)
    out = fusion(mixed, 0.5, graph)
    assert chunked.elementwise_s > 0 and chunked.elementwise_bwd_s > 0
    assert out[last].fwd_s == pytest.approx(chunked.fwd_s - 0.5 * chunked.elementwise_s)
    assert out[last].bwd_s == pytest.approx(chunked.bwd_s - 0.5 * chunked.elementwise_bwd_s)
    assert dataclasses.replace(out[last], fwd_s=chunked.fwd_s, bwd_s=chunked.bwd_s, remat_s=chunked.remat_s) == chunked
    assert (out[2].fwd_s, out[2].bwd_s, out[2].remat_s) == (random.fwd_s, random.bwd_s, random.remat_s)
    assert out[3].fwd_s < stages[3].fwd_s and out[3].saved_bytes < stages[3].saved_bytes
    assert fusion(dataclasses.replace(mixed, fused=False), 0.5) == dataclasses.replace(mixed, fused=False)


def test_fused_stages_save_what_the_compiled_body_saves():
    """NOTE: [Fused saved activations]: a fusable stage keeps fewer bytes from forward to backward
    than eager autograd, its saving forward's peak no more (chunked and random stages keep eager's
    bytes: the test above); the eager count on fake tensors equals the cost model's."""
    graph, eager = _stages(False)
    _, fused_ = _stages(True)
    layers = [i for i, s in enumerate(eager) if ".layers." in s.name]
    assert layers and all(fusable(eager[i]) for i in layers)
    for i in layers:
        assert fused_[i].saved_bytes < eager[i].saved_bytes
        assert trace(graph, eager[i], eager.requires_grad).eager_saved == eager[i].saved_bytes
    for e, f in zip(eager, fused_):
        assert f.saved_bytes <= e.saved_bytes and f.saving_peak_bytes <= e.saving_peak_bytes


def test_fuse_stages_defaults_to_the_profile_and_keys_the_plan_cache():
    """None: fused for a CUDA profile, eager for the CPU's; the plan cache keys differ even where the
    CPU profile (no fused rate) prices both alike."""
    assert CompileOptions().fused(H200) and not CompileOptions().fused(hardware.load("cpu"))
    assert CompileOptions(fuse_stages=True).fused(hardware.load("cpu")) and not CompileOptions(fuse_stages=False).fused(H200)
    with pytest.raises(Exception, match="fuse_stages"):
        CompileOptions(fuse_stages="yes")
    cpu = hardware.load("cpu")
    (_, eager), (_, fused_) = _stages(False, cpu), _stages(True, cpu)
    assert [s.fwd_s for s in eager] == [s.fwd_s for s in fused_]  # cpu.json: no fused rate, factor 1
    assert plancache.key(eager, cpu, 1 << 30) != plancache.key(fused_, cpu, 1 << 30)


def test_the_schedule_records_fused_and_names_its_regions():
    """FUSED in the module; the header says which stages compile and which stay eager, and why."""
    batch = tiny_qwen.example_batch()
    text = compile_model(tiny_qwen.build_model(), batch, "max", "h200", source="t", loss_chunk_bytes=64 << 10).source_text
    module = load_source(text, "fused_header")
    assert module.FUSED is True
    header = text.split("\nimport torch")[0]
    last = len(module.STAGES) - 1
    assert module.STAGES[last].chunks > 1
    kind = module.STAGES[last].kind
    assert f"compiled: stages 0-{last} (kinds A, B, {kind}), their element-wise time priced at 0.25 of eager" in header
    assert f"slices:   stage {last} epilogue compiles the body each slice runs; its memory counted as eager's" in header
    assert "eager:    stage" not in header
    eager = compile_model(tiny_qwen.build_model(), batch, "max", "cpu", source="t").source_text
    assert load_source(eager, "eager_header").FUSED is False
    assert "# fused:        no: every stage runs its ATen calls below, eager" in eager


def test_the_runtime_follows_fused_on_a_gpu_and_warns_when_told_otherwise():
    planned, eager = types.SimpleNamespace(FUSED=True), types.SimpleNamespace(FUSED=False)
    old = types.SimpleNamespace()  # a schedule from before FUSED: eager
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fused.choose(planned, cuda, None) and not fused.choose(planned, cpu, None)
        assert not fused.choose(eager, cuda, None) and not fused.choose(old, cuda, None)
        assert fused.choose(planned, cpu, True) and not fused.choose(eager, cuda, False)
    with pytest.warns(UserWarning, match=r"planned with stage bodies eager .* --fuse-stages on"):
        assert fused.choose(eager, cuda, True)
    with pytest.warns(UserWarning, match=r"planned with stage bodies compiled .* --fuse-stages off"):
        assert not fused.choose(planned, cpu, False)
    # NOTE: [Fused plans run fused]: eager on a GPU could outgrow a plan that counted compiled bodies
    with pytest.raises(ScheduleMismatch, match=r"FUSED = True.*recompile with --fuse-stages off"):
        fused.choose(planned, cuda, False)


def test_a_fused_plan_stops_where_a_body_does_not_compile():
    """NOTE: [Fused plans run fused]: a compile failure falls back eager with a warning, unless the
    plan counted the compiled body's memory."""
    def broken(*_):
        raise RuntimeError("no backend")

    with pytest.warns(UserWarning, match="runs eager, its compile failed: RuntimeError: no backend"):
        assert fused._Timed(broken, lambda x: x + 1, "stage 1")(1) == 2
    with pytest.raises(ScheduleMismatch, match=r"stage 1 did not compile \(RuntimeError: no backend\).*--fuse-stages off"):
        fused._Timed(broken, lambda x: x + 1, "stage 1", planned=True)(1)


def test_bind_on_the_cpu_stays_eager_by_default():
    text = compile_model(tiny_qwen.build_model(), tiny_qwen.example_batch(), "max", "cpu", source="t",
                         fuse_stages=True).source_text
    module = load_source(text, "fused_cpu")
    assert module.FUSED is True
    trainer = module.bind(tiny_qwen.build_model(), device="cpu")
    assert not trainer.fused and all(a is b for a, b in zip(trainer.stages, module.STAGES))


def test_lazytrain_train_auto_follows_the_schedule(monkeypatch):
    """`--fuse-stages auto` hands the runtime None (follow FUSED on a GPU), on and off force it, and
    compiling on the fly plans for what was asked."""
    from lazytrain.cli import parser, train_options
    from lazytrain.runtime import trainer as trainer_module

    for word, value in (("auto", None), ("on", True), ("off", False)):
        args = parser().parse_args(["train", "--fuse-stages", word])
        assert train_options(args).fuse_stages is value
    seen = []
    real = trainer_module.choose
    monkeypatch.setattr(trainer_module, "choose", lambda m, d, f: seen.append((m.FUSED, d.type, f)) or real(m, d, f))
    from lazytrain.cli import main

    assert main(["train", "--steps", "1", "--no-progress", "--hardware", "cpu"]) == 0
    assert seen == [(False, "cpu", None)]


def test_the_factor_from_one_measurement():
    """The H200's layer (84.6 ms eager, 72.4 compiled, 0.240 of it element-wise by the cost model)
    gives 0.40; the result stays within [FACTOR_FLOOR, 1]."""
    share = (7.98 + 13.56) / (30.32 + 59.31)
    assert factor_from_times(84.6, 72.4, share) == pytest.approx(0.40, abs=0.005)
    assert factor_from_times(84.6, 90.0, share) == 1.0  # compiled was slower: nothing gained
    assert factor_from_times(84.6, 10.0, share) == FACTOR_FLOOR  # more than the element-wise part saved
    assert factor_from_times(84.6, 72.4, 0.0) == 1.0
    _, stages = _stages(False)
    total = sum(s.fwd_s + s.bwd_s for s in stages)
    assert elementwise_share(stages) == pytest.approx(sum(s.elementwise_s + s.elementwise_bwd_s for s in stages) / total)


def test_inductor_caches_under_the_plan_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("LAZYTRAIN_NO_CACHE", raising=False)
    monkeypatch.setattr(fused, "_ASKED_DIR", None)
    assert fused.compile_cache("ab" * 32) == tmp_path / "lazytrain" / "inductor" / ("ab" * 8)
    assert plancache.directory().parent == fused.compile_cache("ab" * 32).parent.parent
    monkeypatch.setenv("LAZYTRAIN_NO_CACHE", "1")
    assert fused.compile_cache("ab" * 32) is None
    monkeypatch.delenv("LAZYTRAIN_NO_CACHE")
    monkeypatch.setattr(fused, "_ASKED_DIR", "/somewhere")
    assert fused.compile_cache("ab" * 32) is None
