"""A decoder's RMSNorm computed in tiles of tokens: the `lazytrain::rms_norm` operator, its backward,
and `swap_norms`, which makes a model's RMSNorm modules call it."""

# NOTE: [Tiled RMSNorm]
# transformers' RMSNorms compute in float32 whatever the model's dtype: x.float(), its square, the
# mean, x * rsqrt(mean + eps), the cast back, the weight's product. Eager autograd keeps the float32
# x, its square's input and x * rsqrt for backward: 1.75 GiB each for the Qwen2.5-7B shape at
# 1 x 131,072 tokens (hidden 3584), and the plan counted 10.5 GiB saved a layer, 8.75 of it in the
# layer's two norms; their backward holds five float32 [S, H] temporaries at its peak (NOTE:
# [Backward temporaries] in analysis/memory.py). Like the tiled MLP (NOTE: [Tiled MLP]), this
# operator keeps only x (and the weight): forward computes the same formula a tile of rows at a time
# into one preallocated output; backward recomputes each tile's 1/rms and applies the chain rule,
# summing the weight's gradient over the tiles in float32. Working memory is then one tile's
# float32 rows. Two forms, the ones transformers' decoders use:
#   "weight_after_cast" (Llama, Qwen2, Qwen3, Mistral): weight * (x.float() * r).to(x.dtype);
#   "one_plus_weight" (Gemma, Gemma3): ((x.float() * r) * (1 + weight.float())).to(x.dtype).
# The gradient of x is the same expression eager autograd evaluates, r * dn - x * (r^3 mean(dn x)),
# term for term: float32 results agree to rounding (tests/test_tiled_norm.py, 1e-5).

import torch

from lazytrain.kernels.tiling import body_of, restore, split, swap_forward, swapped

FORMS = ("weight_after_cast", "one_plus_weight")


def _checked(form: str, tiles: int) -> None:
    if form not in FORMS:
        raise ValueError(f"rms_norm: unknown form {form!r}; supported: {', '.join(FORMS)}")
    if tiles < 1:
        raise ValueError(f"rms_norm: tiles must be at least 1 (got {tiles})")


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, form: str) -> torch.dtype:
    return torch.promote_types(weight.dtype, x.dtype) if form == "weight_after_cast" else x.dtype


def _normed(xt: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x as float32, 1/rms per row, x / rms) for one tile, as transformers computes them."""
    xf = xt.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf, r, xf * r


@torch.library.custom_op("lazytrain::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str, tiles: int) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H], contiguous: transformers' RMSNorm of the given form
    (NOTE: [Tiled RMSNorm]), `tiles` tiles of rows at a time."""
    _checked(form, tiles)
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape, dtype=_out_dtype(x, weight, form), device=x.device)
    for xt, ot in zip(split(x2, tiles), split(out, tiles)):
        if not xt.shape[0]:
            continue
        _, _, n = _normed(xt, eps)
        if form == "weight_after_cast":
            torch.mul(weight, n.to(x.dtype), out=ot)
        else:
            ot.copy_(n.mul_(1.0 + weight.float()))
    return out.view(x.shape)


@rms_norm.register_fake
def _(x, weight, eps, form, tiles):
    _checked(form, tiles)
    return torch.empty(x.shape, dtype=_out_dtype(x, weight, form), device=x.device)


@torch.library.custom_op("lazytrain::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, form: str,
                      tiles: int, needs: list[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight), contiguous, in the shapes and dtypes of x and weight; one that `needs` (2 flags,
    both by default) marks False is not computed and comes back empty ([0])."""
    _checked(form, tiles)
    need_dx, need_dw = needs if needs is not None else (True, True)
    x2 = x.reshape(-1, x.shape[-1])
    grad2 = grad_out.reshape(x2.shape)
    dw = weight.new_zeros(weight.shape, dtype=torch.float32) if need_dw else weight.new_empty(0)
    dx = torch.empty_like(x2) if need_dx else x.new_empty(0)
    dx_tiles = split(dx, tiles) if need_dx else (None,) * len(split(x2, tiles))
    for xt, gt, dxt in zip(split(x2, tiles), split(grad2, tiles), dx_tiles):
        if not xt.shape[0]:
            continue
        xf, r, n = _normed(xt, eps)
        if form == "weight_after_cast":
            nb = n.to(x.dtype)
            if need_dw:
                dw.add_((gt * nb).float().sum(0))
            dn = (gt * weight).to(x.dtype).float() if need_dx else None
        else:
            gf = gt.float()
            if need_dw:
                dw.add_((gf * n).sum(0))
            dn = gf * (1.0 + weight.float()) if need_dx else None
        del n
        if need_dx:  # r * dn + x * d(r): d(r) = -r^3 / H * sum(dn * x), as autograd's chain gives it
            dr = (dn * xf).sum(-1, keepdim=True)
            dxf = dn.mul_(r).add_(xf * (dr * (-0.5 * r.pow(3)) / xf.shape[-1] * 2.0))
            dxt.copy_(dxf)
    dx = dx.view(x.shape) if need_dx else dx
    return dx, dw.to(weight.dtype) if need_dw else dw


@rms_norm_backward.register_fake
def _(grad_out, x, weight, eps, form, tiles, needs=None):
    _checked(form, tiles)
    needs = needs if needs is not None else (True, True)
    return tuple(t.new_empty(t.shape if need else (0,)) for t, need in zip((x, weight), needs))


def _setup_context(ctx, inputs, output):
    x, weight, eps, form, tiles = inputs
    ctx.save_for_backward(x, weight)  # neither the output nor any float32 intermediate
    ctx.eps, ctx.form, ctx.tiles = eps, form, tiles


def _backward(ctx, grad_out):
    needs = list(ctx.needs_input_grad[:2])
    grads = torch.ops.lazytrain.rms_norm_backward(grad_out, *ctx.saved_tensors, ctx.eps, ctx.form, ctx.tiles, needs)
    return *(g if need else None for g, need in zip(grads, needs)), None, None, None


torch.library.register_autograd("lazytrain::rms_norm", _backward, setup_context=_setup_context)


# transformers' RMSNorm forwards as `body_of` reads them (a class named like one but computing something
# else is left alone): Llama's family, and Gemma's with its `_norm`
_WEIGHT_AFTER_CAST = (
    "input_dtype=hidden_states.dtypehidden_states=hidden_states.to(torch.float32)"
    "variance=hidden_states.pow(2).mean(-1,keepdim=True)"
    "hidden_states=hidden_states*torch.rsqrt(variance+self.variance_epsilon)"
    "returnself.weight*hidden_states.to(input_dtype)")
_ONE_PLUS_WEIGHT = "output=self._norm(x.float())output=output*(1.0+self.weight.float())returnoutput.type_as(x)"
_GEMMA_NORM = "returnx*torch.rsqrt(x.pow(2).mean(-1,keepdim=True)+self.eps)"


def norm_form(module) -> str | None:
    """The FORMS entry `module` computes (by its class's forward), else None."""
    cls = type(module)
    if not cls.__name__.endswith("RMSNorm") or not isinstance(getattr(module, "weight", None), torch.nn.Parameter):
        return None
    forward = body_of(cls.forward)
    if forward == _WEIGHT_AFTER_CAST and isinstance(getattr(module, "variance_epsilon", None), float):
        return "weight_after_cast"
    if (forward == _ONE_PLUS_WEIGHT and body_of(getattr(cls, "_norm", None)) == _GEMMA_NORM
            and isinstance(getattr(module, "eps", None), float)):
        return "one_plus_weight"
    return None


def _tiled_forward(module, form: str, tiles_of, x):
    eps = module.variance_epsilon if form == "weight_after_cast" else module.eps
    return torch.ops.lazytrain.rms_norm(x, module.weight, eps, form, tiles_of(x, x.shape[-1], 4))  # float32 rows


def swap_norms(model: torch.nn.Module, tiles_of) -> int:
    """Make every RMSNorm of model whose forward `norm_form` knows compute through
    `lazytrain::rms_norm`, with tiles_of(x, hidden size, 4) tiles (its rows in float32) for its input x: its forward, set on
    the instance, calls the operator with its own weight. Returns how many were swapped;
    `restore_norms` undoes it."""
    count = 0
    for module in model.modules():
        form = None if swapped(module, _tiled_forward) else norm_form(module)
        if form is not None:
            swap_forward(module, _tiled_forward, form, tiles_of)
            count += 1
    return count


def restore_norms(model: torch.nn.Module) -> int:
    """Give the norms `swap_norms` changed their class's forward back; returns how many."""
    return restore(model, _tiled_forward)
