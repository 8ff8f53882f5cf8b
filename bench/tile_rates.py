"""The tiled operators' time against their tile size: what choosing a tile count would trade.

A tile costs its kernels' launches and, once it has few rows, the matmuls' rate; the plan prices
neither by tile (NOTE: [Tiled MLP] in lazytrain/kernels/tiled_mlp.py prices the products alone,
`op_overhead_s` once an operator). This measures `lazytrain::gated_mlp` and `lazytrain::rms_norm`,
forward and backward (bf16, a Qwen2.5-7B layer's widths by default), at each tile budget, beside
the untiled eager MLP and norm, median of `--reps` after warm-up:

    python bench/tile_rates.py --tokens 131072 --budgets 64MiB 256MiB 1GiB 4GiB

Runs on a GPU (wall time between device synchronisations) or, to check the script, on the CPU at
small sizes (`--tokens 512 --hidden 64 --intermediate 128 --budgets 16KiB 64KiB`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lazytrain.kernels import tiled_mlp, tiled_norm  # noqa: E402  (register lazytrain::gated_mlp, ::rms_norm)
from lazytrain.kernels.tiling import tiles_for  # noqa: E402
from lazytrain.units import format_size, parse_size  # noqa: E402


def median_ms(fn, device: torch.device, reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cases(tokens: int, hidden: int, inter: int, budgets: list[int], device, dtype):
    """(name, tiles, function running forward + backward once) for the MLP and the norm."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def param(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype).requires_grad_()
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    gate, up, down, w = param(inter, hidden), param(inter, hidden), param(hidden, inter), param(hidden, scale=1.0)
    grad = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    item = x.element_size()

    def run(forward):
        def once():
            for t in (x, gate, up, down, w):
                t.grad = None
            forward().backward(grad)
        return once

    def eager_norm():
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    yield "mlp eager", 1, run(lambda: F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down))
    for b in budgets:
        n = tiles_for(tokens, inter, item, b)
        yield f"mlp {format_size(b)}", n, run(lambda n=n: tiled_mlp.gated_mlp(x, gate, up, down, "silu", n))
    yield "norm eager", 1, run(eager_norm)
    for b in budgets:
        n = tiles_for(tokens, hidden, 4, b)  # the norm's tiles are of float32 rows (NOTE: [Tiled RMSNorm])
        yield f"norm {format_size(b)}", n, run(
            lambda n=n: tiled_norm.rms_norm(x, w, 1e-6, "weight_after_cast", n))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--intermediate", type=int, default=18944)
    p.add_argument("--budgets", nargs="+", default=["64MiB", "256MiB", "1GiB", "4GiB"])
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    budgets = [parse_size(b) for b in a.budgets]
    rows = []
    for name, tiles, fn in cases(a.tokens, a.hidden, a.intermediate, budgets, device, dtype):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        ms = median_ms(fn, device, a.reps)
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
        rows.append((name, tiles, ms, peak))
        print(f"{name:<14} tiles {tiles:>5}  {ms:9.2f} ms  peak {format_size(peak) if peak else '-'}", flush=True)
    print(f"\n{a.tokens} tokens, hidden {a.hidden}, intermediate {a.intermediate}, {dtype}, {device}; "
          "forward + backward, median of", a.reps)
    print("| case | tiles | ms | x eager | peak |\n|---|---|---|---|---|")
    base = {r[0].split()[0]: r[2] for r in rows if r[0].endswith("eager")}
    for name, tiles, ms, peak in rows:
        print(f"| {name} | {tiles} | {ms:.2f} | {ms / base[name.split()[0]]:.3f} | {format_size(peak) if peak else '-'} |")
    return rows


if __name__ == "__main__":
    main()
