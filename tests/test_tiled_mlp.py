"""The tiled gated MLP operator (NOTE: [Tiled MLP] in lazytrain/kernels/tiled_mlp.py): its output and
gradients equal the eager formula for every supported activation, in one tile and in several (tokens
not divisible by the tiles, more tiles than tokens), with any leading dims and frozen weights; bf16
keeps its dtype; it passes torch.library.opcheck and torch.export; swap_mlps makes tiny Qwen2, Llama
and Gemma3 models train exactly as before and restore_mlps undoes it; tiles_for's tile counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lazytrain.kernels.tiled_mlp import ACTIVATIONS, activation_name, restore_mlps, swap_mlps
from lazytrain.kernels.tiling import tiles_for

ATOL = 1e-5
H, I = 8, 12


def weights(seed: int = 0, dtype=torch.float32):
    """gate, up [I, H] and down [H, I] at nn.Linear's scale, so that gradients are O(1)."""
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(I, H, generator=g) * H ** -0.5 for _ in range(2))
    down = torch.randn(H, I, generator=g) * I ** -0.5
    return [w.to(dtype) for w in (gate, up, down)]


def eager(x, gate, up, down, activation):
    act = ACTIVATIONS[activation][0]
    return F.linear(act(F.linear(x, gate)) * F.linear(x, up), down)


def leaves(tensors, frozen=()):
    return [t.detach().clone().requires_grad_(i not in frozen) for i, t in enumerate(tensors)]


@pytest.mark.parametrize("shape", [(2, 7, H), (5, H)], ids=["batch", "flat"])
@pytest.mark.parametrize("tiles", [1, 3, 9])  # 3: tiles of 5 and 4 of 14 tokens, 2 and 2 and 1 of 5; 9 > 5
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_op_equals_the_eager_formula(activation, tiles, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    mine, ref = leaves([x, *weights()]), leaves([x, *weights()])
    assert_same(torch.ops.lazytrain.gated_mlp(*mine, activation, tiles), eager(*ref, activation), mine, ref)


def assert_same(out, expected, mine, ref):
    """An operator's output (contiguous, shaped and typed as the eager one) and the gradients it
    gives its leaves `mine` equal eager's and those of `ref` (ATOL), for one random output gradient."""
    assert out.shape == expected.shape and out.dtype == expected.dtype and out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(grad)
    expected.backward(grad)
    for a, b in zip(mine, ref):
        assert a.grad.shape == b.grad.shape
        torch.testing.assert_close(a.grad, b.grad, atol=ATOL, rtol=0)


@pytest.mark.parametrize("frozen", [(1, 2, 3), (1,), (0, 3)], ids=["weights", "gate", "x-and-down"])
def test_frozen_inputs_get_no_gradient(frozen):
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(1))
    mine, ref = leaves([x, *weights()], frozen), leaves([x, *weights()], frozen)
    torch.ops.lazytrain.gated_mlp(*mine, "silu", 3).sum().backward()
    eager(*ref, "silu").sum().backward()
    for i, (a, b) in enumerate(zip(mine, ref)):
        if i in frozen:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad, atol=ATOL, rtol=0)


def test_autograd_keeps_only_the_inputs():
    x, gate, up, down = leaves([torch.randn(2, 7, H), *weights()])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.ops.lazytrain.gated_mlp(x, gate, up, down, "silu", 3)
    assert [tuple(t.shape) for t in saved] == [(2, 7, H), (I, H), (I, H), (H, I)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        eager(x, gate, up, down, "silu")
    assert sum(t.numel() == 2 * 7 * I for t in saved[4:]) == 4  # eager: g, act(g), u and their product


def test_backward_skips_what_is_not_needed():
    x = torch.randn(5, H)
    grads = torch.ops.lazytrain.gated_mlp_backward(torch.randn(5, H), x, *weights(), "gelu", 2,
                                                   [True, False, True, False])
    assert [tuple(g.shape) for g in grads] == [(5, H), (0,), (I, H), (0,)]


def test_bf16_keeps_its_dtype_and_is_close_to_float32():
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(1))
    low = leaves([x.bfloat16(), *weights(dtype=torch.bfloat16)])
    full = leaves([x, *weights()])
    out = torch.ops.lazytrain.gated_mlp(*low, "gelu_pytorch_tanh", 3)
    expected = eager(*full, "gelu_pytorch_tanh")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    out.float().sum().backward()
    expected.sum().backward()
    for a, b in zip(low, full):
        assert a.grad.dtype == torch.bfloat16
        torch.testing.assert_close(a.grad.float(), b.grad, atol=5e-2, rtol=5e-2)


def test_unknown_activation_and_no_tiles_are_refused():
    with pytest.raises(ValueError, match="supported: silu, swish"):
        torch.ops.lazytrain.gated_mlp(torch.randn(3, H), *weights(), "gelu_new", 1)
    with pytest.raises(ValueError, match="at least 1"):
        torch.ops.lazytrain.gated_mlp(torch.randn(3, H), *weights(), "silu", 0)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_opcheck(activation):
    x = torch.randn(2, 7, H)
    torch.library.opcheck(torch.ops.lazytrain.gated_mlp.default, (*leaves([x, *weights()]), activation, 3))
    args = (torch.randn(2, 7, H), x, *weights(), activation, 3)
    torch.library.opcheck(torch.ops.lazytrain.gated_mlp_backward.default, args)
    torch.library.opcheck(torch.ops.lazytrain.gated_mlp_backward.default, (*args, [True, False, True, True]))


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = (torch.nn.Parameter(w) for w in weights())

    def forward(self, x):
        return torch.ops.lazytrain.gated_mlp(x, self.gate, self.up, self.down, "silu", 3)


def test_export_on_meta():
    with torch.device("meta"):
        model, x = Mlp(), torch.empty(2, 7, H)
    exported = torch.export.export(model, (x,))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert "lazytrain.gated_mlp.default" in targets
    assert exported.module()(x).shape == (2, 7, H)


def test_tiles_for():
    assert tiles_for(131072, 18944, 2) == 19  # Qwen2.5-7B at 128 Ki tokens in bf16: 6,899 tokens a tile
    assert -(-131072 // 18) * 18944 * 2 > 256 << 20  # 18 tiles would be over
    assert tiles_for(1024, 18944, 2) == 1
    assert tiles_for(0, 64, 4) == 1
    assert tiles_for(10, 64, 4, budget_bytes=3 * 64 * 4) == 4  # at most 3 rows a tile
    assert tiles_for(10, 64, 4, budget_bytes=100) == 10  # one row is over budget: one row a tile


def test_activation_names():
    from transformers.activations import ACT2FN

    for name in ACTIVATIONS:
        assert activation_name(ACT2FN[name]) == name
    for name in ("gelu_python", "gelu_python_tanh", "gelu_new", "relu6", "gelu_fast"):
        assert activation_name(ACT2FN[name]) is None
    assert activation_name(torch.nn.ReLU()) == "relu" and activation_name(torch.nn.SiLU()) == "swish"
    assert activation_name(None) is None


def tiny(family: str, **extra):
    import transformers as tf

    classes = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}
    config_cls, model_cls = classes[family]
    config = config_cls(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                        use_cache=False, attn_implementation="sdpa", **extra)
    torch.manual_seed(0)
    return model_cls(config)


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma3"])
def test_swapped_models_train_as_before(family):
    model = tiny(family)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    loss, grads = loss_and_grads(model, ids)
    names = [name for name, _ in model.named_parameters()]

    seen = []
    assert swap_mlps(model, lambda x, inter, item: seen.append(x.shape) or 3) == 2
    assert swap_mlps(model, lambda x, inter, item: 3) == 0  # already swapped
    tiled_loss, tiled_grads = loss_and_grads(model, ids)
    assert seen == [(2, 9, 32)] * 2
    assert [name for name, _ in model.named_parameters()] == names
    torch.testing.assert_close(tiled_loss, loss, atol=ATOL, rtol=0)
    for name in names:
        torch.testing.assert_close(tiled_grads[name], grads[name], atol=ATOL, rtol=0, msg=name)

    assert restore_mlps(model) == 2
    assert all("forward" not in vars(m) for m in model.modules())
    seen.clear()
    restored_loss, _ = loss_and_grads(model, ids)
    assert seen == [] and torch.equal(restored_loss, loss)


def test_swap_leaves_what_it_cannot_identify():
    model = tiny("llama", hidden_act="gelu_new")  # an activation the operator does not have
    assert swap_mlps(model, lambda x, inter, item: 2) == 0
    model = tiny("llama", mlp_bias=True)
    assert swap_mlps(model, lambda x, inter, item: 2) == 0
    model = tiny("llama")
    from transformers.activations import ACT2FN

    model.model.layers[0].mlp.act_fn = ACT2FN["gelu_python"]  # GELUActivation with its Python formula
    assert swap_mlps(model, lambda x, inter, item: 2) == 1
    assert "forward" not in vars(model.model.layers[0].mlp) and "forward" in vars(model.model.layers[1].mlp)


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma3"])
@pytest.mark.parametrize("budget", ["max", "min"])
def test_a_compiled_step_with_tiled_mlps_and_norms_equals_eager(family, budget):
    """CompileOptions.tile_bytes: the captured step calls lazytrain::gated_mlp in every layer and
    lazytrain::rms_norm for every norm, in tiles, and the compiled step (every block resident, or
    at the smallest budget, streamed and recomputed) gives eager PyTorch's loss and gradients (fp32,
    the suite's tolerance); the model compiled is left as it was."""
    import copy

    from lazytrain.pipeline import compile_model
    from checks import assert_grads_match, bind_source
    from models import model_pair
    from test_packing_grads import build

    meta, real = model_pair(lambda: build(family))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 32), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    compiled = compile_model(meta, batch, budget, "cpu", source="tests", time_limit=20, tile_bytes=1024,
                             loss_chunk_bytes=4096)
    text = compiled.source_text
    assert compiled.stages[-1].chunks > 1  # the final norm is row-wise: the loss stage still chunks
    assert text.count("torch.ops.lazytrain.gated_mlp.default(") == 2  # one a layer
    assert text.count("torch.ops.lazytrain.rms_norm.default(") >= 5  # two a layer at least, and the final one
    assert "'silu', 16)" in text or "'gelu_pytorch_tanh', 16)" in text  # 64 tokens x 64 x 4 bytes in tiles of 1 KiB
    assert not any(vars(m).get("forward") for m in meta.modules())  # the swap is undone
    trainer, model = bind_source(text, real)
    loss = trainer.forward_backward(batch)
    reference = copy.deepcopy(real)
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    assert_grads_match(model, loss, ref_loss.detach(), {n: p.grad for n, p in reference.named_parameters()})


def test_a_schedule_with_tiled_mlps_runs_in_a_fresh_process(tmp_path):
    """A schedule that calls lazytrain::gated_mlp and lazytrain::rms_norm registers them itself: a
    process that imports only the schedule (as `lazytrain train` and the GPU machine do) finds them."""
    import subprocess
    import sys

    from lazytrain.examples import tiny_qwen
    from lazytrain.pipeline import compile_model

    batch = tiny_qwen.example_batch()
    text = compile_model(tiny_qwen.build_model(), batch, "max", "cpu", source="tests", tile_bytes=4096).source_text
    assert "torch.ops.lazytrain.gated_mlp.default(" in text and "torch.ops.lazytrain.rms_norm.default(" in text
    path = tmp_path / "schedule.py"
    path.write_text(text)
    code = ("import sys, torch\nfrom lazytrain.runtime.schedule import load_schedule\n"
            f"m = load_schedule({str(path)!r})\nassert 'lazytrain.kernels.tiled_mlp' in sys.modules\n"
            "assert 'lazytrain.kernels.tiled_norm' in sys.modules\n"
            "from lazytrain.examples import tiny_qwen\nt = m.bind(tiny_qwen.build_model(), device='cpu')\n"
            "print(float(t.forward_backward(tiny_qwen.example_batch())))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) > 0
