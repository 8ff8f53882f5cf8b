"""What a device optimizer step costs beside compute (NOTE: [Optimizer stream] in runtime/stepping.py).

The runtime runs device steps on the default stream while the layers' forward and backward run on a
stream of their own. This times, on one Qwen2.5 decoder layer of each size at 16 x 1024 tokens
(bf16, sdpa) and that layer's AdamW step as the runtime runs it (`step_group`):
  - `compute`: the layer's forward and backward, `n` times, on a side stream, alone;
  - `step`: the layer's step, `k` times, on the default stream, alone;
  - `both`: the two launched together; when each stream's work ended.
From these: the share of the step's time that compute loses beside it (`lost` = (both's compute -
compute) / step) and the step's speed beside compute (`pace` = step / both's step end, when the
steps end first). Medians of 5 runs after a warm-up.

    python bench/step_overlap.py            (on the GPU machine)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_step import LAYERS  # noqa: E402
from bench.host_step import layer_shapes  # noqa: E402

CONFIGS = (("8bit", "bf16"), ("32bit", "fp32"))


def _layer(name: str, tokens: int):
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    hidden, inter, kv = LAYERS[name]
    heads = hidden // 128
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv // 128, attn_implementation="sdpa", use_cache=False)
    layer = Qwen2DecoderLayer(cfg, 0).to("cuda", torch.bfloat16)
    rope = Qwen2RotaryEmbedding(cfg).to("cuda")
    seq = 1024
    x = torch.randn(tokens // seq, seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(seq, device="cuda")[None]
    emb = rope(x, pos)

    def run():
        out = layer(x, position_embeddings=emb, attention_mask=None, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
    return run


def _stepper(name: str, states: str, master: str):
    from lazytrain.runtime.optim import staged_optimizer

    hidden, inter, kv = LAYERS[name]
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    params = [torch.nn.Parameter((torch.randn(s, device="cuda") * 0.02).to(dtype)) for s in layer_shapes(hidden, inter, kv)]
    for p in params:
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3).to(dtype)
    opt = staged_optimizer(states, [{"params": params, "fused": True, "states": states}], lr=1e-5)
    return lambda: opt.step_group(0)


def _timed(compute, step, n: int, k: int, side: torch.cuda.Stream) -> tuple[float, float]:
    """Seconds until the compute and the step work end, launched together (either may be None)."""
    default = torch.cuda.default_stream()
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t0.record(default)
    side.wait_event(t0)
    c_end, s_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # interleave the launches as the runtime does: one layer's work, then a step
    for i in range(max(n if compute else 0, k if step else 0)):
        if compute and i < n:
            with torch.cuda.stream(side):
                compute()
        if step and i < k:
            step()
    c_end.record(side)
    s_end.record(default)
    torch.cuda.synchronize()
    return t0.elapsed_time(c_end) / 1e3, t0.elapsed_time(s_end) / 1e3


def measure(name: str, states: str, master: str, n: int, k: int) -> dict:
    compute, step = _layer(name, 16 * 1024), _stepper(name, states, master)
    side = torch.cuda.Stream()
    for _ in range(2):
        _timed(compute, step, n, k, side)
    alone_c = statistics.median(_timed(compute, None, n, 0, side)[0] for _ in range(5))
    alone_s = statistics.median(_timed(None, step, 0, k, side)[1] for _ in range(5))
    runs = [_timed(compute, step, n, k, side) for _ in range(5)]
    both_c, both_s = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    return {"layer": name, "states": states, "master": master, "steps": k, "passes": n, "compute_ms": alone_c / n * 1e3,
            "step_ms": alone_s / k * 1e3, "both_compute_ms": both_c / n * 1e3, "both_step_end_ms": both_s * 1e3,
            "lost": (both_c - alone_c) / alone_s, "pace": alone_s / both_s if both_s < both_c else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--n", type=int, default=8, help="layer forward+backward passes a run")
    args = p.parse_args()
    rows = []
    for name in args.layers.split(","):
        for states, master in CONFIGS:
            for k in (args.n // 4, args.n // 2, args.n):
                rows.append(measure(name, states, master, args.n, k))
                torch.cuda.empty_cache()
    print(f"{'layer':<14}{'states/master':<14}{'steps':>6}{'compute ms':>11}{'step ms':>9}{'both ms':>9}{'lost':>7}{'pace':>7}")
    for r in rows:
        print(f"{r['layer']:<14}{r['states'] + '/' + r['master']:<14}{r['steps']:>6}"
              f"{r['compute_ms']:>11.2f}{r['step_ms']:>9.2f}{r['both_compute_ms']:>9.2f}{r['lost']:>7.2f}"
              f"{(r['pace'] if r['pace'] is not None else float('nan')):>7.2f}")


if __name__ == "__main__":
    main()
