"""The tiled RMSNorm operator (NOTE: [Tiled RMSNorm] in lazytrain/kernels/tiled_norm.py): its output
and gradients equal transformers' RMSNorms (Llama's family and Gemma3's) in one tile and in several,
with frozen inputs; bf16 keeps its dtype; autograd keeps only its input and weight; it passes
torch.library.opcheck and torch.export; swap_norms finds the norms of Qwen2, Llama, Gemma3 and Qwen3
(q and k norms too), the models train as before, restore_norms undoes it. A compiled step with
tiled norms: tests/test_tiled_mlp.py."""

from __future__ import annotations

import pytest
import torch

from lazytrain.kernels.tiled_norm import FORMS, norm_form, restore_norms, swap_norms
from test_tiled_mlp import ATOL, assert_same, leaves, loss_and_grads, tiny

H = 16


def eager(x, weight, eps, form):
    """transformers' formulas (Qwen2RMSNorm.forward and Gemma3RMSNorm.forward)."""
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * n.to(x.dtype) if form == "weight_after_cast" else (n * (1.0 + weight.float())).type_as(x)


def inputs(shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(shape, generator=g).to(dtype), (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tiles", [1, 3, 40])  # 3: uneven tiles of 14 rows; 40 > 14
@pytest.mark.parametrize("shape", [(2, 7, H), (14, H)], ids=["batch", "flat"])
def test_op_equals_the_eager_formula(form, tiles, shape):
    x, w = inputs(shape)
    mine, ref = leaves([x, w]), leaves([x, w])
    assert_same(torch.ops.lazytrain.rms_norm(*mine, 1e-6, form, tiles), eager(*ref, 1e-6, form), mine, ref)


@pytest.mark.parametrize("frozen", [(0,), (1,)], ids=["x", "weight"])
def test_frozen_inputs_get_no_gradient(frozen):
    x, w = inputs((2, 7, H))
    mine, ref = leaves([x, w], frozen), leaves([x, w], frozen)
    torch.ops.lazytrain.rms_norm(*mine, 1e-6, "weight_after_cast", 3).sum().backward()
    eager(*ref, 1e-6, "weight_after_cast").sum().backward()
    for i, (a, b) in enumerate(zip(mine, ref)):
        if i in frozen:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad, atol=ATOL, rtol=0)


@pytest.mark.parametrize("form", FORMS)
def test_bf16_keeps_its_dtype_and_is_close_to_eager_bf16(form):
    x, w = inputs((4, 33, H))
    low, ref = leaves([x.bfloat16(), w.bfloat16()]), leaves([x.bfloat16(), w.bfloat16()])
    out = torch.ops.lazytrain.rms_norm(*low, 1e-6, form, 5)
    expected = eager(*ref, 1e-6, form)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=0, rtol=0)  # the same kernels, row by row
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    out.backward(grad)
    expected.backward(grad)
    for a, b in zip(low, ref):
        assert a.grad.dtype == torch.bfloat16
        # the weight's gradient sums 132 rows in float32 here, in bf16 in eager
        torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=5e-2, rtol=2e-2)


def test_autograd_keeps_only_the_input_and_weight():
    x, w = leaves(list(inputs((2, 7, H), torch.bfloat16)))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.ops.lazytrain.rms_norm(x, w, 1e-6, "weight_after_cast", 3)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [((2, 7, H), torch.bfloat16), ((H,), torch.bfloat16)]
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        eager(x, w, 1e-6, "weight_after_cast")
    assert sum(t.dtype == torch.float32 and t.numel() == 2 * 7 * H for t in saved) >= 2  # eager: float32 copies


def test_unknown_form_and_no_tiles_are_refused():
    x, w = inputs((3, H))
    with pytest.raises(ValueError, match="supported: weight_after_cast, one_plus_weight"):
        torch.ops.lazytrain.rms_norm(x, w, 1e-6, "layer_norm", 1)
    with pytest.raises(ValueError, match="at least 1"):
        torch.ops.lazytrain.rms_norm(x, w, 1e-6, "weight_after_cast", 0)


@pytest.mark.parametrize("form", FORMS)
def test_opcheck(form):
    x, w = inputs((2, 7, H))
    torch.library.opcheck(torch.ops.lazytrain.rms_norm.default, (*leaves([x, w]), 1e-6, form, 3))
    args = (torch.randn(2, 7, H), x, w, 1e-6, form, 3)
    torch.library.opcheck(torch.ops.lazytrain.rms_norm_backward.default, args)
    torch.library.opcheck(torch.ops.lazytrain.rms_norm_backward.default, (*args, [True, False]))


def test_export_on_meta():
    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(H))

        def forward(self, x):
            return torch.ops.lazytrain.rms_norm(x, self.weight, 1e-6, "weight_after_cast", 4)

    with torch.device("meta"):
        model, x = Norm(), torch.empty(2, 7, H, dtype=torch.bfloat16)
    exported = torch.export.export(model, (x,))
    assert "lazytrain.rms_norm.default" in [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]


# norms a model has: 2 a layer and the final one; Gemma3 4 a layer and q/k norms; Qwen3 q/k norms
NORMS = {"qwen2": 5, "llama": 5, "gemma3": 13, "qwen3": 9}


@pytest.mark.parametrize("family", sorted(NORMS))
def test_swapped_models_train_as_before(family):
    model = tiny(family)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    loss, grads = loss_and_grads(model, ids)
    seen = []
    assert swap_norms(model, lambda x, width, item: seen.append((x.shape[-1], item)) or 3) == NORMS[family]
    assert swap_norms(model, lambda x, width, item: 3) == 0  # already swapped
    tiled_loss, tiled_grads = loss_and_grads(model, ids)
    assert len(seen) == NORMS[family] and all(item == 4 for _, item in seen)
    torch.testing.assert_close(tiled_loss, loss, atol=ATOL, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(tiled_grads[name], grad, atol=ATOL, rtol=0, msg=name)
    assert restore_norms(model) == NORMS[family]
    assert all("forward" not in vars(m) for m in model.modules())


def test_norm_form_leaves_what_it_cannot_identify():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    class Scaled(Qwen2RMSNorm):  # named like one, computing something else
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    assert norm_form(Qwen2RMSNorm(8)) == "weight_after_cast"
    assert norm_form(Scaled(8)) is None
    assert norm_form(torch.nn.LayerNorm(8)) is None
