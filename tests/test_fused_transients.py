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
    # `a` and cos(a * 2) (read by the sum, not element-wise) at the sum; a * 2 fused into the cos
    assert returned == 2 * B + 4
    # x dies at the sin, before the peak; held, it lives to the end
    assert peak_bytes(g, fused=True, counted_inputs=frozenset({0})) == returned
    assert peak_bytes(g, fused=True, counted_inputs=frozenset({0}), held=True) == returned + B


def test_fused_stages_peak_no_higher_than_eager():
    """Each fusable stage's forward, saving forward and backward peaks are at most eager's, and the
    layers' forward peaks strictly lower; none lowered below what the stage saves and outputs. (At
    this size the compiled backward, holding what its forward saved to its end, peaks at eager's:
    its `backward_bytes` stay; a 7B layer's are 1.40 GiB lower at 32 x 1024.)"""
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
