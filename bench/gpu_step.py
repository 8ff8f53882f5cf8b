"""One block's optimizer step on the GPU, as the runtime runs it, against the cost model.

A resident (or GPU-stepped streamed) block steps on the device: torch's fused AdamW for 32-bit
states, bitsandbytes' 8-bit AdamW one tensor at a time for 8-bit states, and with bf16 masters an
fp32 twin and stochastic rounding per tensor (NOTE: [bf16 master weights] in runtime/optim.py).
This times `step_group` on one Qwen2.5 decoder layer of each size (medians of 5 timed runs after a
warm-up), whole and with each matrix cut into 4 tensors, and fits time = parameters / rate +
tensors * per-tensor cost per configuration:

    python bench/gpu_step.py            (on the GPU machine; prints a table and the fitted figures)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host_step import layer_shapes  # noqa: E402

LAYERS = {"qwen2.5-1.5b": (1536, 8960, 256), "qwen2.5-7b": (3584, 18944, 512), "qwen2.5-14b": (5120, 13824, 1024)}
CONFIGS = (("32bit", "fp32"), ("32bit", "bf16"), ("8bit", "fp32"), ("8bit", "bf16"))


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_seconds(shapes, states: str, master: str) -> float:
    from lazytrain.runtime.optim import staged_optimizer

    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    params = [torch.nn.Parameter((torch.randn(s, device="cuda") * 0.02).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3).to(dtype)
    opt = staged_optimizer(states, [{"params": params, "fused": True, "states": states}], lr=1e-5)
    seconds = timed(functools.partial(opt.step_group, 0))
    del opt, params
    torch.cuda.empty_cache()
    return seconds


def _split(shape: tuple[int, ...], parts: int) -> list[tuple[int, ...]]:
    """A matrix as `parts` row blocks (the same parameters in more tensors); vectors whole."""
    if len(shape) < 2 or parts == 1:
        return [shape]
    return [(shape[0] // parts, *shape[1:])] * parts


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Least squares of seconds = numel / rate + tensors * per_tensor: (rate, per_tensor)."""
    a = torch.tensor([[float(n), float(t)] for n, t, _ in points], dtype=torch.float64)
    b = torch.tensor([[s] for _, _, s in points], dtype=torch.float64)
    per_param, per_tensor = torch.linalg.lstsq(a, b).solution.flatten().tolist()
    return (1 / per_param if per_param > 0 else float("inf")), per_tensor


def main() -> None:
    from lazytrain import hardware

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hardware", default="h200")
    args = p.parse_args()
    hw = hardware.load(args.hardware)
    rates = {"32bit": hw.gpu_adamw_params_per_s, "8bit": hw.gpu_adamw8bit_params_per_s}
    print(f"{'states/master':<14}{'layer':<14}{'M params':>9}{'tensors':>8}{'ms':>9}{'profile ms':>11}")
    fitted = {}
    for states, master in CONFIGS:
        points = []
        for (name, (hidden, inter, kv)), parts in ((layer, parts) for layer in LAYERS.items() for parts in (1, 4)):
            shapes = [piece for s in layer_shapes(hidden, inter, kv) for piece in _split(s, parts)]
            numel = sum(torch.Size(s).numel() for s in shapes)
            t = step_seconds(shapes, states, master)
            points.append((numel, len(shapes), t))
            print(f"{states + '/' + master:<14}{name:<14}{numel / 1e6:>9.1f}{len(shapes):>8}{t * 1e3:>9.2f}"
                  f"{numel / rates[states] * 1e3:>11.2f}")
        fitted[(states, master)] = fit(points)
    print(f"\n{'states/master':<14}{'params/s':>12}{'per tensor ms':>15}")
    for (states, master), (rate, per_tensor) in fitted.items():
        print(f"{states + '/' + master:<14}{rate:>12.3g}{per_tensor * 1e3:>15.3f}")


if __name__ == "__main__":
    main()
