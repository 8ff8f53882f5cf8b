"""Grouped-query attention with k and v repeated per query head against `enable_gqa=True`.

A Hugging Face decoder exported by `torch.export` repeats each key-value head for its query heads
(`repeat_kv`: expand, then a reshape that copies) before scaled_dot_product_attention; the copies
are kept for backward. `enable_gqa=True` hands the kernel the unrepeated k and v. This measures both,
causal, forward + backward for one layer (bf16), at each of `--seqs` (batch 1): the median time of
`--reps` after warm-up, and the peak allocated beyond the inputs, forward and backward apart:

    python bench/gqa_attention.py --seqs 32768 131072 --heads 28 --kv-heads 4 --head-dim 128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package `bench`, not bench/bench.py
from bench.sdpa_mask import timed  # noqa: E402


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' repeat_kv: [b, kv, s, d] -> [b, kv * n_rep, s, d], a copy."""
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


def peaks(fn_forward, grad) -> tuple[float, float]:
    """GiB allocated at the forward's peak and at the backward's, beyond what was allocated before."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn_forward()
    torch.cuda.synchronize()
    forward = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad)
    torch.cuda.synchronize()
    backward = torch.cuda.max_memory_allocated() - base
    return forward / 2**30, backward / 2**30


def measure(s: int, a) -> list[dict]:
    """Both cases at `s` tokens: their rows, printed as they finish."""
    n_rep = a.heads // a.kv_heads

    def make(h):
        return torch.randn(1, h, s, a.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = make(a.heads), make(a.kv_heads), make(a.kv_heads)
    grad = torch.randn(1, a.heads, s, a.head_dim, device="cuda", dtype=torch.bfloat16)
    forwards = {
        "repeated": lambda: F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True),
        "enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }
    with torch.no_grad():
        diff = (forwards["repeated"]() - forwards["enable_gqa"]()).abs().max().item()
    rows = []
    for name, fwd in forwards.items():
        ms = timed(lambda fwd=fwd: fwd().backward(grad), reps=a.reps)
        for t in (q, k, v):
            t.grad = None
        f_peak, b_peak = peaks(fwd, grad)
        for t in (q, k, v):
            t.grad = None
        rows.append(dict(seq=s, case=name, ms=round(ms, 2), forward_peak_gib=round(f_peak, 3),
                         backward_peak_gib=round(b_peak, 3), max_abs_diff=diff))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    for s in a.seqs:
        rows += measure(s, a)
        torch.cuda.empty_cache()
    print(f"{'seq':>8} {'case':<11} {'fwd+bwd ms':>11} {'fwd peak GiB':>13} {'bwd peak GiB':>13}")
    for r in rows:
        print(f"{r['seq']:>8} {r['case']:<11} {r['ms']:>11.2f} {r['forward_peak_gib']:>13.3f} {r['backward_peak_gib']:>13.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
