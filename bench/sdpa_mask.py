"""Attention with the traced boolean causal mask against `is_causal=True`, at a bench layer's shape.

`torch.export` of a Hugging Face decoder materialises the causal mask as a bool tensor; with an
explicit mask, scaled_dot_product_attention cannot use its flash kernel. This measures what that
costs per layer (forward + backward), to size the `causal` pass's gain:

    python bench/sdpa_mask.py --batch 32 --seq 1024 --heads 28 --kv-heads 4 --head-dim 128
"""

import argparse

import torch
import torch.nn.functional as F


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def layer_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The attention shape of a bench layer (default: Qwen2.5-7B's at 32 x 1024 tokens)."""
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    return p


def main():
    a = layer_arguments(argparse.ArgumentParser()).parse_args()
    b, s, h, d = a.batch, a.seq, a.heads, a.head_dim
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = torch.ones(s, s, dtype=torch.bool, device="cuda").tril().expand(b, 1, s, s)
    grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    runs = {
        "bool mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(grad),
        "is_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad),
    }
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    new = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    print(f"max |difference| {(ref - new).abs().max().item():.3g}")
    for name, fn in runs.items():
        print(f"{name:<10} fwd+bwd {timed(fn):7.2f} ms per layer")


if __name__ == "__main__":
    main()
