"""What a stage's backward and a recomputed forward hold, against the allocations the device made.

The H200 figures (bench/stage_memory.py, bench/results/stage_memory/qwen2.5-7b_layer.txt, 2026-12-01): a Qwen2.5-7B layer's
backward holds 75776 bytes a token beyond what it saved and its weights' gradients (two of the MLP's
intermediates' gradients); its forward without autograd peaks at 7.375 GiB at 1 x 65536 tokens,
before its output exists.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lazytrain import hardware
from lazytrain.ir.events import Kind, Phase
from lazytrain.pipeline import analyse, compile_model
from lazytrain.solver.workspace import backward_workspace, forward_workspace
from models import hf_config, model_pair, token_batch

HW = hardware.load("cpu")


def _qwen(hidden: int = 32, intermediate: int = 512, layers: int = 2, batch: int = 2, seq: int = 16):
    from transformers import Qwen2ForCausalLM

    cfg = hf_config("qwen2", layers=layers, hidden=hidden)
    cfg.intermediate_size = intermediate
    meta, _ = model_pair(lambda: Qwen2ForCausalLM(cfg).to(torch.bfloat16))
    return meta, token_batch(batch, seq, cfg.vocab_size)


def test_a_residual_add_hands_its_gradient_through_without_a_copy():
    """NOTE: [Gradients handed through] in analysis/backward.py. With the MLP four times wider than
    anything else the layer's backward peaks at the MLP's product: its gradient is replaced by those
    of the activation and the up projection. The residual stream's gradient is the layer output's
    own (a buffer counted apart): counting a copy of it put every 7B backward window 448 MiB over
    the measured one at 1 x 65536. Of its weights' gradients only the down projection's exists there
    (NOTE: [Weight gradients at the backward's peak] in analysis/backward.py)."""
    meta, batch = _qwen(batch=8, seq=64)
    _, stages = analyse(meta, batch, HW)
    layer = next(g for g in stages if g.name == "model.layers.1")
    tokens, hidden, mlp = 8 * 64, 32, 512
    assert backward_workspace(layer) == 2 * tokens * mlp * 2 - (layer.param_bytes - hidden * mlp * 2)


def test_the_gradient_of_outputs_read_without_gradient_is_made_by_the_stage_that_takes_one():
    """Every layer reads the prologue's rotary tables, and only the first layer its hidden states:
    the prologue's output gradient is made in the first layer's backward, not the last one's."""
    meta, batch = _qwen(layers=3)
    _, stages = analyse(meta, batch, HW)
    assert stages[0].consumers[-1] == 3 and stages.grad_maker(0) == 1
    assert stages.grad_maker(1) == 2  # a layer's output: the next layer takes its gradient
    schedule = compile_model(meta, batch, None, HW).schedule
    makers = [e for e in schedule.events if "grad:0" in e.allocs]
    assert [(e.stage, e.phase) for e in makers] == [(1, Phase.BWD)]


def test_a_forward_without_autograd_holds_its_liveness_peak_with_its_outputs_in_it():
    """The forward's workspace beside its outputs' buffer adds up to its liveness peak, which
    counts the outputs from the node that makes them."""
    meta, batch = _qwen()
    _, stages = analyse(meta, batch, HW)
    layer = next(g for g in stages if g.name == "model.layers.1")
    assert forward_workspace(layer) + layer.out_bytes == layer.peak_bytes
    compiled = compile_model(meta, batch, "min", HW)
    recomputed = [e for e in compiled.schedule.events if e.kind is Kind.COMPUTE and e.phase is Phase.FWD
                  and compiled.plan.decisions[e.stage].recomputed and compiled.stages[e.stage].consumers]
    assert recomputed
    for e in recomputed:
        assert e.workspace + compiled.stages[e.stage].out_bytes == compiled.stages[e.stage].peak_bytes


class _Made(TorchDispatchMode):
    """The tensors made under it, as a timeline of allocations and frees (by storage; a result that
    shares an input's storage, a view or a detach, makes none). `peak(kept)`: the most bytes alive
    at once, leaving out the allocations still alive at the end whose storage is in `kept`."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (allocation id, +bytes or -bytes)
        self.alive: dict[int, int] = {}  # storage pointer -> allocation id

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            key, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            if n == 0 or key in seen or key in self.alive:
                continue
            self.alive[key] = ident = len(self.events)
            self.events.append((ident, n))
            weakref.finalize(t, self._free, key, ident, n)
        return out

    def _free(self, key, ident, n):
        self.events.append((ident, -n))
        if self.alive.get(key) == ident:
            del self.alive[key]

    def peak(self, kept: list[torch.Tensor], since: int = 0) -> int:
        """The most bytes alive at once from event `since` on (what was alive then counted)."""
        left = {self.alive[k] for k in (t.untyped_storage().data_ptr() for t in kept) if k in self.alive}
        live = most = 0
        for i, (ident, n) in enumerate(self.events):
            if ident not in left:
                live += n
                if i >= since:
                    most = max(most, live)
        return most


def test_a_layer_backward_holds_no_more_than_counted(hidden=256, heads=8, kv_heads=1):
    """NOTE: [Backward temporaries] in analysis/memory.py. A Qwen2 layer whose MLP and RMSNorms run
    in tiles, and whose 8 query heads share one key and value head (the 7B's are 28 and 4: there
    the repeat copies, here it is a view), run on the CPU from its stage function: the most bytes its
    tensors hold at once in backward (what forward saved, and what backward makes, less its
    outputs and its inputs' gradients, buffers the step model counts apart, and less all its weights'
    gradients, of which those made by then are counted) are at most the plan's `backward_bytes`. Without the temporaries of `mul` with a broadcast input, of
    `pow` and of slices, the plan fell short here by 1.8 MB of 10.8 (on the H200 by 3.6 GiB at
    1 x 131072); with tiled norms, without attention's key and value gradients at the repeated
    size, by 0.79 MB of 6.8."""
    from transformers import Qwen2ForCausalLM

    from lazytrain.options import CompileOptions
    from lazytrain.runtime.schedule import load_source

    cfg = hf_config("qwen2", layers=2, hidden=hidden)
    cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads = 128, heads, kv_heads
    meta, _ = model_pair(lambda: Qwen2ForCausalLM(cfg))
    rows, seq = 64, 16  # many tokens, short rows: the norms' [tokens, hidden] outweigh attention's [seq, seq]
    batch = token_batch(rows, seq, cfg.vocab_size)
    options = CompileOptions(budget="max", tile_bytes=4096)
    compiled = compile_model(meta, batch, hardware=HW, options=options)
    layer = next(s for s in compiled.stages if s.name == "model.layers.1")
    module = load_source(compiled.source_text, "backward_temporaries")
    stage = module.STAGES[layer.index]
    specs = {n: (shape, dtype) for n, (_, _, shape, dtype) in module.PLACEHOLDERS.items()}
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(specs[p][0], generator=g).mul_(0.05).requires_grad_() for p in stage.placeholders]
    inputs = {x: torch.randn(rows, seq, hidden, generator=g).requires_grad_(x in stage.grad_inputs) for x in stage.inputs
              if x not in ("to_4", "to_5")}
    head = hidden // heads
    inputs.update({x: torch.randn(rows, seq, head, generator=g) for x in stage.inputs if x in ("to_4", "to_5")})
    made = _Made()
    with made:  # forward too: what it saves is in the backward's memory
        outs = stage.fn("cpu", *weights, *(inputs[x] for x in stage.inputs))
    grads = [torch.randn_like(o) for o in outs]
    start = len(made.events)
    with made:
        torch.autograd.backward(list(outs), grads)
    # the stage's outputs and its inputs' gradients are buffers the step model counts apart; its
    # weights' gradients too, the event counting them beside `backward_bytes`, which is what the
    # backward holds at its peak less those not made by then (NOTE: [Weight gradients at the
    # backward's peak] in analysis/backward.py)
    apart = list(outs) + [t.grad for t in inputs.values() if t.grad is not None]
    held = made.peak(apart, since=start) - sum(t.grad.untyped_storage().nbytes() for t in weights if t.grad is not None)
    assert held <= layer.backward_bytes, (held, layer.backward_bytes)
    # the count is not loose either: 5.99 MB against 8.62, where the plan's replay peaks with 0.66 MB
    # of the weights' 0.99 MB of gradients made and this run before any (7.0 against 8.9 before
    # weights' gradients were counted as made)
    assert held > 0.65 * layer.backward_bytes
