"""Where a stage's device time goes, per operator: the measured side of the cost model (passes/costs.py).

    python bench/opcost.py measure --out opcost.json     # on the GPU machine
    python bench/opcost.py compare opcost.json           # here: against the cost model's rules

`measure` runs, for each bench shape, one decoder layer's forward and backward and the loss stage
as the runtime runs it (512-row chunks of lm_head and an fp32 cross-entropy), under the profiler,
after a warm-up, and records every aten operator's own device time (the median over repeats) and,
for matmuls, their shapes. `compare` captures the same shapes on the meta device and sums the
cost model's forward and backward seconds per operator next to the measured ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = (("qwen2.5-1.5b", 16, 1024), ("qwen2.5-7b", 32, 1024), ("qwen2.5-14b", 8, 1024))
CHUNK_ROWS = 512  # the loss chunk the bench shapes compile to (passes/chunk.py)


def _profiled(fn, repeat: int) -> dict[str, float]:
    """Each aten operator's own device seconds per call of `fn`, the median of `repeat` runs."""
    import torch

    from bench.trace import profiled_ops

    fn()
    torch.cuda.synchronize()
    runs = [profiled_ops(fn) for _ in range(repeat)]
    keys = set().union(*runs)
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in sorted(keys)}


def _wall(fn, repeat: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def _case(name: str, batch: int, seq: int, repeat: int) -> dict:
    """One decoder layer's forward and backward, and the loss stage, of shape `name`."""
    import torch
    import torch.nn.functional as F
    from transformers.models.qwen2.modeling_qwen2 import (
        Qwen2DecoderLayer,
        Qwen2RotaryEmbedding,
    )

    from bench.shapes import config

    dev = torch.device("cuda")
    cfg = config(name, seq)
    layer = Qwen2DecoderLayer(cfg, 0).to(dev, torch.bfloat16)
    x = torch.randn(batch, seq, cfg.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(seq, device=dev)[None].expand(batch, -1)
    emb = Qwen2RotaryEmbedding(cfg).to(dev)(x, pos)

    def layer_step():
        out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=emb)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))

    tokens = batch * seq
    w = torch.randn(cfg.vocab_size, cfg.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(tokens, cfg.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, cfg.vocab_size, (tokens,), device=dev)

    def loss_step():
        for c in range(0, tokens, CHUNK_ROWS):
            logits = F.linear(h[c:c + CHUNK_ROWS], w)
            F.cross_entropy(logits.float(), labels[c:c + CHUNK_ROWS], reduction="sum").backward()

    return {"batch": batch, "seq": seq,
            "layer": {"wall_s": _wall(layer_step, repeat), "ops": _profiled(layer_step, repeat)},
            "loss": {"wall_s": _wall(loss_step, repeat), "ops": _profiled(loss_step, repeat)}}


def measure(out: str, repeat: int) -> None:
    import torch

    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    for name, batch, seq in CASES:
        c = result["cases"][name] = _case(name, batch, seq, repeat)
        torch.cuda.empty_cache()
        print(f"{name}: layer {c['layer']['wall_s'] * 1e3:.2f} ms, loss {c['loss']['wall_s'] * 1e3:.2f} ms", flush=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    for name, c in result["cases"].items():
        for part in ("layer", "loss"):
            top = sorted(c[part]["ops"].items(), key=lambda kv: -kv[1])[:8]
            print(f"{name} {part}: " + ", ".join(f"{k.removeprefix('aten::')} {v * 1e3:.2f}" for k, v in top))


def compare(path: str) -> None:
    import collections

    import torch

    from bench.shapes import meta_model
    from lazytrain import hardware
    from lazytrain.passes.costs import costs
    from lazytrain.pipeline import analyse

    measured = json.loads(Path(path).read_text())
    hw = hardware.load("h200")
    print("| shape | part | predicted ms (fwd+bwd) | measured ms | ratio |")
    print("|---|---|---|---|---|")
    for name, c in measured["cases"].items():
        model = meta_model(name, c["seq"]).to(torch.bfloat16)
        ids = torch.zeros(c["batch"], c["seq"], dtype=torch.long, device="meta")
        graph, stages = analyse(model, {"input_ids": ids, "labels": ids}, hw, optimizer_states="8bit", master_weights="bf16")
        table = costs(graph, hw)
        for part, stage in (("layer", stages[1]), ("loss", stages[len(stages) - 1])):
            per_op = collections.Counter()
            for n in stage.nodes:
                if n in table:
                    per_op[graph[n].target] += table[n].time_s + table[n].bwd_time_s
            predicted = stage.fwd_s + stage.bwd_s
            got = c[part]["wall_s"]
            print(f"| {name} | {part} | {predicted * 1e3:.2f} | {got * 1e3:.2f} | {got / predicted:.2f} |")
            for op, t in per_op.most_common(6):
                print(f"|  | {op} | {t * 1e3:.2f} | | |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", default="opcost.json")
    m.add_argument("--repeat", type=int, default=5)
    c = sub.add_parser("compare")
    c.add_argument("path")
    args = p.parse_args(argv)
    measure(args.out, args.repeat) if args.cmd == "measure" else compare(args.path)


if __name__ == "__main__":
    main()
