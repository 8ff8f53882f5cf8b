"""One stage of a schedule alone on the device: the memory its forward and backward hold.

    python bench/stage_memory.py .bench/<case>.py --stage model.layers.1   (on the GPU)

Runs the stage's own code (the captured graph, as the runtime runs it) on random weights and inputs
and prints, above what was allocated before each part:
  - forward without autograd: its peak (the plan's `peak_bytes`);
  - forward with autograd: its peak and what it leaves (the plan's `saving_peak_bytes`, and
    `saved_bytes` + `out_bytes`);
  - backward from a random output gradient: its peak over what forward left, with the operator
    running at that peak (the plan's `backward_bytes` - `saved_bytes`, NOTE: [Backward memory]),
    for the saving forward and for the recompute (`remat=True`).
With `--fused`, the stage's body runs compiled by Inductor, as a fused plan's runtime runs it.
Shapes come from the schedule's comments (`# bfloat16[1,65536,3584]`).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30
_SPEC = re.compile(r"^\s+(\w+) = .*#\s*(\w+)\[([\d,]*)\]\s*$")


class PeakOp(TorchDispatchMode):
    """The operator after which the allocator's peak last grew, and that peak."""

    def __init__(self):
        super().__init__()
        self.peak, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        now = torch.cuda.max_memory_allocated()
        if now > self.peak:
            self.peak, self.op = now, str(func)
        return out


def _specs(text: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    specs = {}
    for line in text.splitlines():
        m = _SPEC.match(line)
        if m:
            specs.setdefault(m.group(1), (m.group(2), tuple(int(d) for d in m.group(3).split(",") if d)))
    return specs


def _args(module, stage, specs):
    args = []
    for p in stage.placeholders:
        _, _, shape, dtype = module.PLACEHOLDERS[p]
        args.append(torch.nn.Parameter(torch.randn(shape, dtype=getattr(torch, dtype), device="cuda") * 0.02))
    for x in stage.inputs:
        dtype, shape = specs[x]
        t = torch.randn(shape, dtype=getattr(torch, dtype), device="cuda")
        args.append(t.requires_grad_(x in stage.grad_inputs))
    return args


def _measure(stage, args, remat: bool, compiled: bool = False) -> dict[str, float]:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = stage.fn("cuda", *args)
    torch.cuda.synchronize()
    row = {"forward_peak": torch.cuda.max_memory_allocated() - base}
    del out
    torch.cuda.reset_peak_memory_stats()
    outs = stage.fn("cuda", *args, **({"remat": remat} if stage.skips else {}))  # remat: only where it skips work
    outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if isinstance(o, torch.Tensor)]
    torch.cuda.synchronize()
    row["saving_peak"] = torch.cuda.max_memory_allocated() - base
    row["left"] = torch.cuda.memory_allocated() - base
    grads = [torch.randn_like(o) for o in outs if o.requires_grad]
    after = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    probe = PeakOp() if not compiled else contextlib.nullcontext()  # a compiled backward dispatches no operators
    with probe:
        torch.autograd.backward([o for o in outs if o.requires_grad], grads)
    torch.cuda.synchronize()
    row["backward_peak"] = torch.cuda.max_memory_allocated() - after
    row["backward_op"] = probe.op if not compiled else "compiled"
    for a in args:
        a.grad = None
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("schedule")
    ap.add_argument("--stage", default="model.layers.1")
    ap.add_argument("--fused", action="store_true", help="compile the stage's body as the runtime does (NOTE: [Fused stages])")
    args = ap.parse_args()
    from lazytrain.runtime.fused import fuse
    from lazytrain.runtime.schedule import load_schedule

    module = load_schedule(args.schedule)
    stage = next(s for s in module.STAGES if s.name == args.stage)
    if args.fused:
        stage = fuse([stage])[0]
    inputs = _args(module, stage, _specs(Path(args.schedule).read_text()))
    tokens = max(torch.Size(t.shape[:2]).numel() for t in inputs[len(stage.placeholders):])
    print(f"{args.schedule}: stage {stage.name}, {tokens} tokens, backend flags: flash "
          f"{torch.backends.cuda.flash_sdp_enabled()}, cudnn {torch.backends.cuda.cudnn_sdp_enabled()}, "
          f"mem-efficient {torch.backends.cuda.mem_efficient_sdp_enabled()}")
    print("| run | forward peak GiB | saving peak GiB | left GiB | backward peak GiB (B/token) | at |")
    print("|---|---|---|---|---|---|")
    for remat in (False, True, False):  # the first run warms the kernels up
        r = _measure(stage, inputs, remat, args.fused)
        print(f"| remat={remat} | {r['forward_peak'] / GiB:.3f} | {r['saving_peak'] / GiB:.3f} | {r['left'] / GiB:.3f} | "
              f"{r['backward_peak'] / GiB:.3f} ({r['backward_peak'] / tokens:.0f}) | {r['backward_op']} |")


if __name__ == "__main__":
    main()
