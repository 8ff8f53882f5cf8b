"""The gated MLP of a decoder layer computed in tiles of tokens: the `lazytrain::gated_mlp` operator,
its backward, and `swap_mlps`, which makes a model's MLP modules call it."""

# NOTE: [Tiled MLP]
# A decoder layer's gated MLP (Qwen2, Llama, Gemma3: down_proj(act(gate_proj(x)) * up_proj(x)), no
# biases) makes intermediates of [tokens, intermediate_size], 5.3x the hidden state for Qwen2.5-7B
# (18944 against 3584): at 1 x 131,072 tokens each is 4.97 GB in bf16, and autograd keeps four of
# them a layer (gate_proj's output for the activation, act's output and up_proj's for the product,
# the product for down_proj). As Arctic Long Sequence Training's TiledMLP does, this operator takes
# the tokens (x flattened to [N, H]) in `tiles` nearly equal contiguous tiles (torch.tensor_split),
# writes each tile's output into one preallocated output, and keeps only x (and the weights) for
# backward; its backward, a second operator, recomputes each tile's gate and up products and applies
# the chain rule, accumulating the weight gradients across tiles (in float32 for bf16/fp16 weights).
# The intermediates are then one tile's worth, forward and backward: `tiles_for` picks the fewest
# tiles that keep one at most 256 MiB (19 tiles for the 7B at 131,072 tokens). The price is 2 of the
# 3 forward matmuls again in backward: 11 matmuls a step where eager runs 9.
# The activation's derivative comes from aten's own backward kernels (silu_backward, gelu_backward,
# threshold_backward: those autograd records for F.silu, F.gelu, F.relu), since an operator's kernel
# runs below autograd, where nothing is recorded even under torch.enable_grad().

import functools

import torch
import torch.nn.functional as F

from lazytrain.kernels.tiling import body_of, restore, split, swap_forward, swapped

aten = torch.ops.aten

# transformers' ACT2FN names -> (the function, grad of its input from (grad of its output, its input))
ACTIVATIONS = {
    "silu": (F.silu, aten.silu_backward),
    "swish": (F.silu, aten.silu_backward),
    "gelu_pytorch_tanh": (functools.partial(F.gelu, approximate="tanh"),
                          functools.partial(aten.gelu_backward, approximate="tanh")),
    "gelu": (F.gelu, aten.gelu_backward),
    "relu": (F.relu, functools.partial(aten.threshold_backward, threshold=0)),
}


def _checked(activation: str, tiles: int):
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_mlp: unknown activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
    if tiles < 1:
        raise ValueError(f"gated_mlp: tiles must be at least 1 (got {tiles})")
    return ACTIVATIONS[activation]


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, in acc's dtype (float32 sums of bf16/fp16 tiles)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


@torch.library.custom_op("lazytrain::gated_mlp", mutates_args=())
def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str,
              tiles: int) -> torch.Tensor:
    """x [..., H], gate and up [I, H], down [H, I] (nn.Linear weights) -> [..., H] in x's dtype,
    contiguous: F.linear(act(F.linear(x, gate)) * F.linear(x, up), down), `tiles` tiles of tokens at a
    time (NOTE: [Tiled MLP])."""
    act, _ = _checked(activation, tiles)
    gate, up, down = (w.to(x.dtype) for w in (gate, up, down))
    x2 = x.reshape(-1, x.shape[-1])
    out = x.new_empty(x2.shape)
    for xt, ot in zip(split(x2, tiles), split(out, tiles)):
        if xt.shape[0]:
            h = act(xt @ gate.t())
            h.mul_(xt @ up.t())
            torch.mm(h, down.t(), out=ot)
    return out.view(x.shape)


@gated_mlp.register_fake
def _(x, gate, up, down, activation, tiles):
    _checked(activation, tiles)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("lazytrain::gated_mlp_backward", mutates_args=())
def gated_mlp_backward(grad_out: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                       down: torch.Tensor, activation: str, tiles: int, needs: list[bool] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dgate, dup, ddown), contiguous, in the shapes and dtypes of x, gate, up and down; those
    `needs` (4 flags, all by default) marks False are not computed and come back empty ([0])."""
    act, act_backward = _checked(activation, tiles)
    need_dx, need_dgate, need_dup, need_ddown = needs if needs is not None else (True,) * 4
    sums = torch.float32 if gate.dtype in (torch.bfloat16, torch.float16) else gate.dtype
    dgate, dup, ddown = (w.new_zeros(w.shape, dtype=sums) if need else w.new_empty(0)
                         for w, need in ((gate, need_dgate), (up, need_dup), (down, need_ddown)))
    w_gate, w_up, w_down = (w.to(x.dtype) for w in (gate, up, down))
    x2 = x.reshape(-1, x.shape[-1])
    grad2 = grad_out.reshape(x2.shape).to(x.dtype)
    dx = torch.empty_like(x2) if need_dx else x.new_empty(0)
    dx_tiles = split(dx, tiles) if need_dx else (None,) * len(split(x2, tiles))
    for xt, gt, dxt in zip(split(x2, tiles), split(grad2, tiles), dx_tiles):
        if not xt.shape[0]:
            continue
        g, u = xt @ w_gate.t(), xt @ w_up.t()  # recomputed: forward kept only x
        a = act(g)
        if need_ddown:
            _accumulate(ddown, gt.t(), a * u)
        if not (need_dx or need_dgate or need_dup):
            continue
        dh = gt @ w_down
        dg = act_backward(dh * u, g)  # d(act(g)) * act'(g)
        du = dh.mul_(a)
        del g, u, a
        if need_dx:
            torch.mm(dg, w_gate, out=dxt)
            dxt.addmm_(du, w_up)
        if need_dgate:
            _accumulate(dgate, dg.t(), xt)
        if need_dup:
            _accumulate(dup, du.t(), xt)
    dx = dx.view(x.shape) if need_dx else dx
    return dx, dgate.to(gate.dtype), dup.to(up.dtype), ddown.to(down.dtype)


@gated_mlp_backward.register_fake
def _(grad_out, x, gate, up, down, activation, tiles, needs=None):
    _checked(activation, tiles)
    needs = needs if needs is not None else (True,) * 4
    return tuple(t.new_empty(t.shape if need else (0,)) for t, need in zip((x, gate, up, down), needs))


def _setup_context(ctx, inputs, output):
    x, gate, up, down, activation, tiles = inputs
    ctx.save_for_backward(x, gate, up, down)  # neither the output nor any intermediate
    ctx.activation, ctx.tiles = activation, tiles


def _backward(ctx, grad_out):
    needs = list(ctx.needs_input_grad[:4])  # frozen weights: their gradients are not computed
    grads = torch.ops.lazytrain.gated_mlp_backward(grad_out, *ctx.saved_tensors, ctx.activation, ctx.tiles, needs)
    return *(g if need else None for g, need in zip(grads, needs)), None, None


torch.library.register_autograd("lazytrain::gated_mlp", _backward, setup_context=_setup_context)


def _plain(value):
    """An activation module's attribute in a comparable form: a functools.partial by its function and
    arguments, a bound method by its function."""
    if isinstance(value, functools.partial):
        return value.func, value.args, sorted(value.keywords.items())
    return getattr(value, "__func__", value)


def _attributes(module) -> dict:
    return {k: _plain(v) for k, v in vars(module).items() if not k.startswith("_") and k != "training"}


def activation_name(act) -> str | None:
    """The ACT2FN name (among ACTIVATIONS) whose fresh module has act's class and attributes, else None:
    e.g. GELUTanh with F.gelu(approximate="tanh") is "gelu_pytorch_tanh", with its Python formula it is
    "gelu_python_tanh", which is not supported."""
    from transformers.activations import ACT2FN

    for name in ACTIVATIONS:
        fresh = ACT2FN[name]
        if type(act) is type(fresh) and _attributes(act) == _attributes(fresh):
            return name
    return None


def _plain_linear(module) -> bool:
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward \
        and module.bias is None


def _tiled_forward(module, activation: str, tiles_of, x):
    return torch.ops.lazytrain.gated_mlp(x, module.gate_proj.weight, module.up_proj.weight,
                                         module.down_proj.weight, activation,
                                         tiles_of(x, module.gate_proj.weight.shape[0], x.element_size()))


def swap_mlps(model: torch.nn.Module, tiles_of) -> int:
    """Make every gated MLP of model (a submodule whose class name ends in "MLP", with gate_proj,
    up_proj and down_proj plain nn.Linear children without bias and an act_fn `activation_name`
    knows, and whose forward is the gated MLP's line, `_GATED`) compute through `lazytrain::gated_mlp`,
    with tiles_of(x, intermediate size, x's itemsize) tiles for its input x: its
    forward, set on the instance, calls the operator with its own weights (parameters and their names
    are unchanged). Others are left alone. Returns how many were swapped; `restore_mlps` undoes it."""
    count = 0
    for module in model.modules():
        if not type(module).__name__.endswith("MLP") or swapped(module, _tiled_forward):
            continue
        projections = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if not all(_plain_linear(p) for p in projections):
            continue
        name = activation_name(getattr(module, "act_fn", None))
        if name is None or not _computes_gated_mlp(type(module)):
            continue
        swap_forward(module, _tiled_forward, name, tiles_of)
        count += 1
    return count


# the forwards of transformers' gated MLPs (Qwen2, Llama, Gemma3, Mistral, ...) as `body_of` reads them:
# a class named like one but computing something else is left alone
_PRODUCT = "self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))"
_GATED = (f"down_proj={_PRODUCT}returndown_proj", f"return{_PRODUCT}")


def _computes_gated_mlp(cls) -> bool:
    return body_of(cls.forward) in _GATED


def restore_mlps(model: torch.nn.Module) -> int:
    """Give the MLPs `swap_mlps` changed their class's forward back; returns how many."""
    return restore(model, _tiled_forward)
