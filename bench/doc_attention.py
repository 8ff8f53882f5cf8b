"""Document-masked attention at a bench layer's shape: the kernels that keep packed examples apart.

Rows of `--seq` tokens are packed (best fit decreasing, as `lazytrain train` packs) with examples
whose lengths follow a MetaMathQA-like chat set (log-normal, mean about 157 tokens, 30 to 409).
Each case runs attention forward + backward for one layer (bf16) and reports the median of
`--reps` timed runs after warm-up, beside full causal attention on the same tensors:

    python bench/doc_attention.py --batch 32 --seq 1024 --heads 28 --kv-heads 4 --head-dim 128

Cases: `causal` (flash, no document mask: the bound the plan prices), `sdpa bool mask` (the
traced mask, what a Hugging Face decoder exports: memory-efficient kernel, every block computed),
`lazytrain op` (the `lazytrain::document_attention` operator: FlexAttention, its block mask made
from the document ids once a batch; `block mask only` times making it), `flex (autograd)` (FlexAttention
with create_block_mask's mask, made once outside the timing) and `varlen`
(flash attention over cu_seqlens known in advance, k and v repeated for the heads). Each masked case is checked
against the bool-mask reference first.
"""

from __future__ import annotations

import argparse
import inspect
import json

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package `bench`, not bench/bench.py
from bench.sdpa_mask import layer_arguments, timed  # noqa: E402
from lazytrain.train.packing import best_fit_decreasing  # noqa: E402


def packed_positions(batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, float]:
    """position_ids of `batch` packed rows (restarting at 0 per example; a row's padding is one
    more sequence), and the mean example length."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(140), 0.5, batch * 60), 30, 409).astype(int).tolist()
    packed = best_fit_decreasing(lengths, seq)  # the first rows hold the longest examples: take a spread
    rows = packed[:: len(packed) // batch][:batch]
    pos = torch.zeros(batch, seq, dtype=torch.long)
    used = []
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            pos[r, at:at + lengths[i]] = torch.arange(lengths[i])
            at += lengths[i]
            used.append(lengths[i])
        pos[r, at:] = torch.arange(seq - at)
    return pos, float(np.mean(used))


def main():
    p = layer_arguments(argparse.ArgumentParser())
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from lazytrain.kernels import documents

    b, s, h, kv, d = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    pos, mean_len = packed_positions(b, s)
    pos = pos.cuda()
    dt = torch.bfloat16
    q = torch.randn(b, h, s, d, device="cuda", dtype=dt, requires_grad=True)
    k, v = (torch.randn(b, kv, s, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(2))
    grad = torch.randn(b, h, s, d, device="cuda", dtype=dt)
    doc = documents.document_ids(pos)
    mask = documents.document_mask(pos, None)[:, None]  # [B, 1, S, S]
    scale = d ** -0.5

    def sdpa_mask():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def causal():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    def operator():  # FlexAttention with a block mask made from the document ids, under its own autograd
        return torch.ops.lazytrain.document_attention(q, k, v, pos, scale, None)[0]

    cases = {"causal": causal, "sdpa bool mask": sdpa_mask, "lazytrain op": operator,
             "block mask only": lambda: documents.block_mask(documents.document_ids(pos), None).kv_num_blocks}  # as made
    try:  # flash attention over cu_seqlens, the exact document count known in advance (a host sync)
        from torch.nn.attention.varlen import varlen_attn

        starts = doc != F.pad(doc, (1, -1), value=-1)
        flat = torch.nonzero(starts.flatten()).flatten()
        cu = torch.cat([flat, flat.new_tensor([b * s])])
        longest = int(torch.diff(cu).max())
        cu = cu.to(torch.int32)
        rep = h // kv
        causal_kw = ({"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters
                     else {"window_size": (-1, 0)})

        def varlen():
            qf = q.transpose(1, 2).reshape(b * s, h, d)
            kf = k.repeat_interleave(rep, 1).transpose(1, 2).reshape(b * s, h, d)
            vf = v.repeat_interleave(rep, 1).transpose(1, 2).reshape(b * s, h, d)
            return varlen_attn(qf, kf, vf, cu, cu, longest, longest, scale=scale, **causal_kw).view(b, s, h, d).transpose(1, 2)

        cases["varlen (kv repeated)"] = varlen
    except Exception as e:  # noqa: BLE001 - report and measure the rest
        print(f"varlen unavailable: {type(e).__name__}: {e}")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)

        def mask_mod(bi, hi, qi, ki):
            return (doc[bi, qi] == doc[bi, ki]) & (ki <= qi)

        block = create_block_mask(mask_mod, b, None, s, s, device="cuda", _compile=True)
        cases["flex (autograd)"] = lambda: flex(q, k, v, block_mask=block, scale=scale, enable_gqa=True)
    except Exception as e:  # noqa: BLE001 - report and measure the rest
        print(f"flex unavailable: {type(e).__name__}: {e}")

    ref = sdpa_mask().float()
    rows = []
    for name, fn in cases.items():
        try:
            err = (fn().float() - ref).abs().max().item() if name != "block mask only" else 0.0
            ms_fwd = timed(lambda: fn(), a.reps)
            ms = timed(lambda: fn().backward(grad), a.reps) if name != "block mask only" else ms_fwd
            rows.append({"case": name, "fwd_ms": ms_fwd, "fwd_bwd_ms": ms, "max_err_vs_mask": err})
        except Exception as e:  # noqa: BLE001 - a kernel this torch lacks is reported, not fatal
            rows.append({"case": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    print(f"{b} x {s} tokens, {h} heads ({kv} kv) x {d}, bf16; examples of mean {mean_len:.0f} tokens; "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'case':<16}{'fwd ms':>9}{'fwd+bwd ms':>12}{'max |err|':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<16} {r['error']}")
        else:
            print(f"{r['case']:<16}{r['fwd_ms']:>9.2f}{r['fwd_bwd_ms']:>12.2f}{r['max_err_vs_mask']:>11.2g}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mean_example_tokens": mean_len, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
