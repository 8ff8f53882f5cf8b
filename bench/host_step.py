"""One block's optimizer step on the host, against the cost model's `cpu_step_s`.

A block stepped on the CPU (32-bit states, NOTE: [State precision per stage] in solver/formulation.py)
costs torch's fused AdamW plus, with bf16 masters, fp32 twins and stochastic rounding. This times
each part and the whole step as the runtime runs it, for one Qwen2.5-7B decoder layer by default:

    python bench/host_step.py --hidden 3584 --intermediate 18944 --kv 512

and prints the rates to put in a hardware profile (medians of 3 timed runs after a warm-up).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, reps=3) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def layer_shapes(hidden: int, intermediate: int, kv: int) -> list[tuple[int, ...]]:
    return [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (hidden,), (kv,), (kv,),
            (intermediate, hidden), (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]


def main():
    from lazytrain import hardware
    from lazytrain.runtime.optim import round_stochastic_, staged_optimizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--intermediate", type=int, default=18944)
    p.add_argument("--kv", type=int, default=512)
    p.add_argument("--hardware", default="h200")
    args = p.parse_args()
    shapes = layer_shapes(args.hidden, args.intermediate, args.kv)
    numel = sum(torch.Size(s).numel() for s in shapes)

    fp32 = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for t in fp32:
        t.grad = torch.randn_like(t) * 1e-3
    adamw = torch.optim.AdamW(fp32, lr=1e-5, fused=True)
    t_adamw = timed(adamw.step)

    src = torch.cat([t.detach().flatten() for t in fp32])
    dst = torch.empty_like(src, dtype=torch.bfloat16)
    t_round = timed(lambda: round_stochastic_(dst, src, seed=7))

    bf16 = [torch.nn.Parameter(t.detach().bfloat16()) for t in fp32]
    for t in bf16:
        t.grad = torch.randn_like(t) * 1e-3
    staged = staged_optimizer("32bit", [{"params": bf16, "fused": True, "states": "32bit"}], lr=1e-5)
    t_bf16 = timed(lambda: staged.step_group(0))
    fp32_staged = staged_optimizer("32bit", [{"params": fp32, "fused": True}], lr=1e-5)
    t_fp32 = timed(lambda: fp32_staged.step_group(0))
    # fp32 masters of bf16 weights, as the runtime steps them: the bf16 gradient into the fp32 one
    # AdamW reads, the step, the updated master into the bf16 copy the next prefetch sends
    grads16 = [t.grad.bfloat16() for t in fp32]
    copies16 = [t.detach().bfloat16() for t in fp32]
    buffers = [torch.empty_like(t) for t in fp32]

    def mixed_step():
        for t, b, g in zip(fp32, buffers, grads16):
            t.grad = b.copy_(g)
        fp32_staged.step_group(0)
        for c, t in zip(copies16, fp32):
            c.copy_(t.detach())
    t_mixed = timed(mixed_step)

    hw = hardware.load(args.hardware)
    rows = [("fused AdamW, fp32 (params/s)", numel / t_adamw, hw.cpu_adamw_params_per_s),
            ("stochastic rounding (params/s)", numel / t_round, hw.cpu_round_params_per_s)]
    print(f"{numel / 1e6:.0f} M parameters, {torch.get_num_threads()} threads")
    print(f"{'':<34}{'measured':>12}{'profile':>12}")
    for name, got, want in rows:
        print(f"{name:<34}{got:>12.3g}{want:>12.3g}")
    try:  # the model's prediction needs the solver's module (python-mip)
        from lazytrain.solver.footprint import cpu_step_s
    except ImportError:
        cpu_step_s = lambda *a: float("nan")  # noqa: E731
    print(f"{'host step, fp32 master (s)':<34}{t_fp32:>12.3f}{cpu_step_s(4 * numel, numel, hw, 4):>12.3f}")
    print(f"{'host step, bf16 master (s)':<34}{t_bf16:>12.3f}{cpu_step_s(2 * numel, numel, hw, 2):>12.3f}")
    print(f"{'host step, fp32 master, bf16 (s)':<34}{t_mixed:>12.3f}{cpu_step_s(2 * numel, numel, hw, 4):>12.3f}")


if __name__ == "__main__":
    main()
