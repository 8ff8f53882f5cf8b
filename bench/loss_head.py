"""The loss stage three ways, on the GPU: which kernels should run a chunked loss kind?

Every stage body of a fused plan runs compiled by Inductor (NOTE: [Fused stages] in
lazytrain/runtime/fused.py), the chunked loss stage's (final norm, lm_head, cross-entropy: NOTE:
[Chunked loss] in lazytrain/runtime/chunked.py) slice by slice (NOTE: [Compiled loss slices]).
Measured here on the loss stage of a compiled schedule, with the plan's own chunks, its weights
and a batch of its shape:

  eager     the runtime's `chunked_backward` over the stage as the schedule writes it (the reference)
  compiled  the same, the stage's body compiled as the runtime compiles it (`fused.fuse`: one
            compile, every chunk the same shape)
  liger     the stage's norm eager, then Liger's fused linear cross-entropy over the whole batch
            (`LigerFusedLinearCrossEntropyFunction`, reduction "sum": it makes the gradients in its
            forward, a chunk of logits at a time, and never holds the logits whole)

Per way: the median of --repeat timed forward-and-backward runs after --warmup, the most memory
allocated beyond the inputs and weights, and the loss and gradients (the hidden state's, the
lm_head's, the norm's) against eager's, as the largest elementwise difference over the largest
value of eager's.

    python bench/loss_head.py [--schedule .bench/fidelity/qwen2.5-7b_b32_s1024_24GiB_8bit_bf16_fused.py]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GiB = 1 << 30
DEFAULT = ROOT / ".bench" / "fidelity" / "qwen2.5-7b_b32_s1024_24GiB_8bit_bf16_fused.py"


def _inputs(module, stage, device, seed: int = 0):
    """The stage's weights as leaves (the norm's about 1, the lm_head's about 0.02), its input
    activation in bf16 and labels with a tenth ignored, at their schedule shapes."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    work, env = {}, {}
    for p in stage.placeholders:
        kind, _, shape, dtype = module.PLACEHOLDERS[p]
        if kind == "param":
            t = torch.randn(shape, generator=g) * 0.02 + (1.0 if len(shape) == 1 else 0.0)
            work[p] = t.to(getattr(torch, dtype)).to(device).requires_grad_(True)
    vocab, hidden = _head_shape(module, stage)
    labels = next(p for p in stage.placeholders if module.PLACEHOLDERS[p][0] == "input")
    shape = module.PLACEHOLDERS[labels][2]
    ids = torch.randint(0, vocab, shape, generator=g)
    ids[torch.rand(shape, generator=g) < 0.1] = -100
    env[labels] = ids.to(device)
    env[stage.inputs[0]] = torch.randn((*stage.tokens, hidden), generator=g).to(torch.bfloat16).to(device)
    return work, env


def _head_shape(module, stage) -> tuple[int, int]:
    """(vocab, hidden): the stage's one two-dimensional weight, the lm_head's."""
    return next(module.PLACEHOLDERS[p][2] for p in stage.params if len(module.PLACEHOLDERS[p][2]) == 2)


def _chunked(stage, module, work, env, device):
    """The runtime's chunked forward and backward: (loss, the input's gradient, the weights' gradients)."""
    from lazytrain.runtime.chunked import chunked_backward

    for t in work.values():
        t.grad = None
    loss, grads = chunked_backward(stage, env, lambda p: work[p] if p in work else env[p], work, module.PLACEHOLDERS,
                                   device, None)
    return loss, grads[stage.inputs[0]], {p: work[p].grad for p in stage.params}


def _liger(stage, module, work, env, device):
    """The stage's norm eager, then Liger's fused linear cross-entropy, summed and divided by the
    targets counted, as the chunked stage's mean is."""
    import torch
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    for t in work.values():
        t.grad = None
    norm_w, head_w = sorted((work[p] for p in stage.params), key=lambda t: t.dim())
    labels = env[next(p for p in stage.placeholders if module.PLACEHOLDERS[p][0] == "input")]
    target = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)  # the stage's label shift
    h = env[stage.inputs[0]].detach().requires_grad_(True)
    x = h.float()
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * norm_w
    out = LigerFusedLinearCrossEntropyFunction.apply(x.reshape(-1, x.shape[-1]), head_w, target, None, None, -100,
                                                     0.0, 0.0, "sum")
    loss = out[0] if isinstance(out, tuple) else out  # 0.8.5 returns (loss, z_loss, accuracy, predicted)
    count = (target != -100).sum()
    (loss / count).backward()
    return (loss / count).detach(), h.grad, {p: work[p].grad for p in stage.params}


def _measure(fn, warmup: int, repeat: int, device):
    """(median seconds, most bytes allocated beyond what was before, the last result); on the CPU
    the bytes are not read (None)."""
    import torch

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        out = fn()
    sync()
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) if cuda else None, out


def _off(a, b) -> float:
    """The largest elementwise difference of `a` from `b`, over the largest magnitude in `b`."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default=str(DEFAULT))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--ways", default="eager,compiled,liger")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the eager and compiled ways")
    args = p.parse_args(argv)
    import torch

    from lazytrain.runtime.fused import fuse
    from lazytrain.runtime.schedule import load_schedule

    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device(args.device)
    module = load_schedule(args.schedule)
    stage = next(s for s in module.STAGES if s.chunks > 1)
    work, env = _inputs(module, stage, device)
    weights = sum(t.numel() * t.element_size() for t in work.values())
    tokens = stage.tokens[0] * stage.tokens[1]
    vocab, hidden = _head_shape(module, stage)
    flops = 6 * tokens * hidden * vocab  # the lm_head's forward and backward
    print(f"[loss_head] {Path(args.schedule).name}: stage {stage.index} ({stage.name}), {stage.chunks} chunks of "
          f"{stage.chunk_len or 'whole rows'}, {tokens} tokens, lm_head {vocab} x {hidden}, weights "
          f"{weights / GiB:.2f} GiB, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, "
          f"torch {torch.__version__}", flush=True)
    ways = {
        "eager": lambda: _chunked(stage, module, work, env, device),
        "compiled": lambda: _chunked(compiled, module, work, env, device),
        "liger": lambda: _liger(stage, module, work, env, device),
    }
    compiled = fuse((stage,))[0]
    rows, reference = [], None
    for way in args.ways.split(","):
        start = time.perf_counter()
        try:
            secs, peak, out = _measure(ways[way], args.warmup, args.repeat, device)
        except Exception as exc:  # a way that cannot run here is a row that says why
            rows.append(f"| {way} | failed: {type(exc).__name__}: {str(exc)[:120]} | | | | |")
            print(f"[loss_head] {way}: failed: {exc}", flush=True)
            continue
        first = time.perf_counter() - start - secs * args.repeat
        if reference is None:
            reference = out
        loss, dx, dw = out
        offs = [_off(loss, reference[0]), _off(dx, reference[1])] + [_off(dw[p], reference[2][p]) for p in stage.params]
        peak_text = "-" if peak is None else f"{peak / GiB:.2f}"
        rows.append(f"| {way} | {secs * 1e3:.1f} | {flops / secs / 1e12:.0f} | {peak_text} | {first:.1f} | "
                    + ", ".join(f"{o:.1e}" for o in offs) + " |")
        print(f"[loss_head] {way}: {secs * 1e3:.1f} ms, peak {peak_text} GiB beyond inputs", flush=True)
    print("| way | ms (median) | TFLOPS (lm_head 6 x tokens x H x V) | peak GiB beyond inputs | warm-up s | "
          "off eager: loss, d hidden, d " + ", d ".join(stage.params) + " |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
