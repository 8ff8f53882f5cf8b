"""What a compiled body holds in flight (NOTE: [Fused transients] in
lazytrain/analysis/fused_transients.py): the replay of a graph eager and fused, and the fused
stages' peaks in the plan."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from lazytrain import hardware
from lazytrain.analysis.fused_transients import peak_bytes
from lazytrain.examples import tiny_qwen
from lazytrain.ir.stages import fusable
from lazytrain.pipeline import analyse

N, H, F = 64, 16, 32
B = N * F * 4  # one [N, F] fp32 value


def _gated_mlp(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate) * (x @ up)) @ down


def _graph(fn, *shapes) -> torch.fx.Graph:
    return make_fx(fn, tracing_mode="fake")(*(torch.empty(s) for s in shapes)).graph


def test_a_gated_mlp_holds_one_intermediate_fewer_fused():
    """Eager makes gate, up, silu(gate) and their product: three [N, F] values live at the product.
    Fused, silu(gate) is never made and the product is written into gate's buffer, which dies
    there: two."""
    g = _graph(_gated_mlp, (N, H), (H, F), (H, F), (F, H))
    assert peak_bytes(g, fused=False) == 3 * B
    assert peak_bytes(g, fused=True) == 2 * B


def test_returned_values_are_made_and_held():
    """A returned element-wise value is made even fused, and lives to the end; inputs count only
    where asked, held to the end with `held`."""
    def fn(x):
        a = x.sin()
        return a, (a * 2).cos().sum()
    g = _graph(fn, (N, F))
    returned = peak_bytes(g, fused=True)
    # `a` and the sum at the sum: a * 2 and its cos are computed inside the reduction's kernel
    assert returned == B + 4
    assert peak_bytes(g, fused=False) == 3 * B  # eager: a, a * 2 and the cos at the cos
    # counted, x lives until the sin makes `a`; held, to the end
    assert peak_bytes(g, fused=True, counted_inputs=frozenset({0})) == 2 * B
    assert peak_bytes(g, fused=True, counted_inputs=frozenset({0}), held=frozenset({0})) == returned + B


def test_weight_gradients_count_from_where_they_can_be_made():
    """NOTE: [Weight gradients at the backward's peak] in analysis/backward.py. A backward making
    `h = g @ w.T` and `dx = sin(h) * h`, then the weight's gradient `x.T @ g`: in the graph's order
    (eager) the weight's gradient comes after the peak, so the peak less it is the count; fused,
    its kernel may run first (its inputs are the backward's own), so it counts from the start."""
    def backward(g, x, w):
        h = g @ w.t()
        dx = h.sin() * h
        return x.t() @ g, dx  # the weight's gradient, made last, and the input's
    g = _graph(backward, (N, F), (N, H), (H, F))
    NH, HF = N * H * 4, H * F * 4
    assert peak_bytes(g, fused=False, returned=False) == 2 * NH  # h and sin(h) at the product
    assert peak_bytes(g, fused=False, returned=False, weights=frozenset({0})) == 2 * NH - HF
    assert peak_bytes(g, fused=True, returned=False) == NH  # sin(h) inside the product's kernel
    assert peak_bytes(g, fused=True, returned=False, weights=frozenset({0})) == NH


def test_fused_stages_peak_no_higher_than_eager():
    """Each fusable stage's forward, saving forward and backward peaks are at most eager's, and the
    layers' forward peaks strictly lower; none lowered below what the stage saves and outputs. (At
    this size the compiled backward, holding what its forward saved to its end, peaks at eager's:
    its `backward_bytes` stay; a 7B layer's are 1.40 GiB lower at 32 x 1024. A backward may stand
    above eager's count where the compiled body's own replay does, NOTE: [Workspace the trace cannot
    see]; not at this size.)"""
    hw = hardware.load("h200")
    _, eager = analyse(tiny_qwen.build_model(), tiny_qwen.example_batch(), hw, fuse_stages=False)
    _, fused = analyse(tiny_qwen.build_model(), tiny_qwen.example_batch(), hw, fuse_stages=True)
    lower = 0
    for e, f in zip(eager, fused):
        assert f.peak_bytes <= e.peak_bytes and f.saving_peak_bytes <= e.saving_peak_bytes
        assert f.backward_bytes <= e.backward_bytes
        assert f.peak_bytes >= min(e.peak_bytes, f.out_bytes)
        assert f.saving_peak_bytes >= min(e.saving_peak_bytes, f.saved_bytes + f.out_bytes)
        assert f.backward_bytes >= min(e.backward_bytes, f.saved_bytes)
        if not fusable(e):
            assert (f.peak_bytes, f.backward_bytes) == (e.peak_bytes, e.backward_bytes)
        lower += ".layers." in e.name and f.peak_bytes < e.peak_bytes and f.saving_peak_bytes < e.saving_peak_bytes
    assert lower >= 2


def _two_products(x0, a, b, w1, w2):
    x = x0 @ w1
    return (x * a.sigmoid()) @ w2, (x * b) @ w2


def test_kernels_over_the_same_elements_join_and_write_into_donated_inputs():
    """`x * sigmoid(a)` and `x * b` read `x` and run as one kernel once `x` is made (Inductor's
    horizontal fusion): `x`, `a` and `b` are live while both products are written. A backward's
    saved inputs are donated, so each product goes into the input that dies there (`a`, `b`); `x`,
    read by both, takes neither. Not donated, both products are new buffers."""
    g = _graph(_two_products, (N, H), (N, F), (N, F), (H, F), (F, H))
    saved = frozenset({1, 2})
    assert peak_bytes(g, fused=True, counted_inputs=saved, donated=saved) == 3 * B
    assert peak_bytes(g, fused=True, counted_inputs=saved) == 5 * B
    # eager: the sigmoid is made; a dies at it, x and b live on to the second product
    assert peak_bytes(g, fused=False, counted_inputs=saved) == 4 * B


def test_a_recompute_that_skips_work_saves_less_and_peaks_apart():
    """A layer's recompute before backward runs its last linear as `grad_only_linear` (NOTE:
    [Skipped recompute]): traced that way, the compiled body saves less than the saving forward's,
    and the plan prices its recompute window from that trace (`remat_backward_bytes`)."""
    from lazytrain.analysis.fused_saved import trace

    hw = hardware.load("h200")
    graph, stages = analyse(tiny_qwen.build_model(), tiny_qwen.example_batch(), hw, fuse_stages=False)
    layer = next(s for s in stages if ".layers." in s.name and s.skips)
    saving = trace(graph, layer, stages.requires_grad)
    remat = trace(graph, layer, stages.requires_grad, remat=True)
    assert remat.compiled_saved < saving.compiled_saved
    _, fused = analyse(tiny_qwen.build_model(), tiny_qwen.example_batch(), hw, fuse_stages=True)
    assert all((s.remat_backward_bytes > 0) == bool(s.skips and fusable(s)) for s in fused)


def test_a_recompute_that_does_not_trace_keeps_eager_bytes(monkeypatch):
    """Where the recompute's own trace fails, its window is priced at eager's backward, never at the
    saving partition's smaller one."""
    from lazytrain.passes import fusion

    real = fusion.trace
    monkeypatch.setattr(fusion, "trace", lambda graph, s, rg, remat=False: None if remat else real(graph, s, rg))
    hw = hardware.load("h200")
    _, eager = analyse(tiny_qwen.build_model(), tiny_qwen.example_batch(), hw, fuse_stages=False)
    _, fused = analyse(tiny_qwen.build_model(), tiny_qwen.example_batch(), hw, fuse_stages=True)
    layers = [(e, f) for e, f in zip(eager, fused) if f.skips and fusable(f)]
    assert layers
    assert all(f.remat_backward_bytes == e.backward_bytes for e, f in layers)


def _attention_backward(grad, q, k, v, out, lse):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, True)


def test_attention_backward_holds_its_workspace_while_it_runs():
    """NOTE: [Workspace the trace cannot see]: the replay holds, while attention's backward runs,
    the queries' gradient in fp32 and, with fewer key-value heads than query heads, the key's and
    value's gradients at the queries' heads; with as many heads, no expansion."""
    T, D = 64, 16
    for heads, kv_heads in ((4, 2), (4, 4)):
        q, o = (1, heads, T, D), (1, heads, T, D)
        g = _graph(_attention_backward, o, q, (1, kv_heads, T, D), (1, kv_heads, T, D), o, (1, heads, T))
        made = 4 * (heads + 2 * kv_heads) * T * D  # its gradients of q, k and v
        expanded = 0 if kv_heads == heads else 2 * heads * T * D * 4
        assert peak_bytes(g, fused=False) == made + 4 * heads * T * D + expanded
        assert peak_bytes(g, fused=True) == peak_bytes(g, fused=False)


def test_a_fused_backward_is_never_under_the_compiled_replay():
    """Eager's count less what the eager replay holds more than the compiled one can fall under the
    compiled body's own replay (the default partition counts views of one input apart): the plan
    then counts the replay. The tiny Qwen2 at 1 x 1024 tokens is such a case."""
    from lazytrain.analysis.fused_saved import trace
    from lazytrain.analysis.fused_transients import fewer

    ids = torch.zeros(1, 1024, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": ids.clone()}
    hw = hardware.load("h200")
    _, eager = analyse(tiny_qwen.build_model(), batch, hw, fuse_stages=False)
    graph, fused = analyse(tiny_qwen.build_model(), batch, hw, fuse_stages=True)
    raised = 0
    for e, f in zip(eager, fused):
        if fusable(f) and ".layers." in f.name:
            held = fewer(trace(graph, f, fused.requires_grad))
            assert f.backward_bytes == max(e.backward_bytes - held.backward, held.backward_peak)
            raised += held.backward_peak > e.backward_bytes - held.backward
    assert raised >= 2
