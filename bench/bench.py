"""The benchmark: lazytrain against resident PyTorch and a fixed-policy streaming trainer.

Two phases, because the GPU machine has no solver:
  python bench/bench.py compile --model qwen2.5-7b --batch 32 --seq 1024 --budget 24GiB   (here)
      writes .bench/<case>.py (lazytrain's plan) and .bench/<case>.fixed.py (the fixed policy)
  python bench/bench.py run --model qwen2.5-7b --batch 32 --seq 1024 --budget 24GiB       (on the GPU)
      runs each system in its own process (clean memory peaks), writes bench/results/*.json
  python bench/bench.py table                                                            (anywhere)
      rewrites the results table in bench/README.md

Figures follow DESIGN.md's protocol: TFLOPS = 6 * params * tokens / step time (rows also carry
`tflops_with_attention`, attention's work added: NOTE: [Model FLOPs]), the median of
--steps timed steps after --warmup steps; peaks from torch.cuda.max_memory_allocated and the
process's VmHWM.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

CASES = ROOT / ".bench"
RESULTS = HERE / "results"
FIXED_POLICY = "stream every block, checkpoint every block"


def case_name(args) -> str:
    states = "" if getattr(args, "states", "32bit") == "32bit" else f"_{args.states}"
    master = "" if getattr(args, "master", "fp32") == "fp32" else f"_{args.master}master"
    disk = "_disk" if getattr(args, "disk", False) else ""
    tile = f"_tile{args.tile_bytes}" if getattr(args, "tile_bytes", "0") != "0" else ""
    return f"{args.model}_b{args.batch}_s{args.seq}_{args.budget}{states}{master}{disk}{tile}"


def cmd_compile(args):
    import torch

    from bench.shapes import batch, meta_model
    from lazytrain import hardware
    from lazytrain.codegen.render import render
    from lazytrain.errors import PlanError
    from lazytrain.passes.lower import lower
    from lazytrain.solver.solve import evaluate, heuristics
    from lazytrain.passes.verify import verify
    from lazytrain.options import CompileOptions
    from lazytrain.pipeline import analyse, compile_model
    from lazytrain.units import parse_size

    hw = hardware.load(args.hardware)
    meta = meta_model(args.model, args.seq).to(torch.bfloat16)
    b = batch(args.model, args.batch, args.seq)
    options = CompileOptions(budget="max" if args.budget == "max" else parse_size(args.budget), time_limit=args.time_limit,
                             optimizer_states=args.states, master_weights=args.master, clipping="off",  # runs do not clip
                             disk=args.disk, tile_bytes=0 if args.tile_bytes == "0" else parse_size(args.tile_bytes))
    CASES.mkdir(exist_ok=True)
    # one plan priced eager (system lazytrain) and one priced fused (system fused, NOTE: [Fused stage
    # prices] in lazytrain/passes/fusion.py): each run is held to the plan of the bodies it runs
    for suffix, fuse in (("", False), (".fused", True)):
        compiled = compile_model(meta, b, hardware=hw, options=dataclasses.replace(options, fuse_stages=fuse),
                                 source=f"bench:{args.model}")
        (CASES / f"{case_name(args)}{suffix}.py").write_text(compiled.source_text)
        print(f"lazytrain plan{suffix or ''}: predicted {compiled.plan.step_s:.3f} s, "
              f"peak {compiled.plan.peak_bytes / 2**30:.1f} GiB")
    budget = compiled.plan.budget
    if args.states != "32bit" or args.master != "fp32":
        return  # the fixed-policy baseline is the 32-bit one
    graph, stages = analyse(meta, b, hw)
    try:
        fixed = evaluate(stages, hw, budget, heuristics(stages)[FIXED_POLICY], status="fixed policy")
    except PlanError as exc:  # e.g. the host cannot hold fp32 AdamW states for every block
        print(f"fixed policy: no plan ({exc})")
        return
    schedule = lower(stages, fixed, hw)
    verify(schedule)
    (CASES / f"{case_name(args)}.fixed.py").write_text(render(graph, stages, fixed, schedule, b, hw.name))
    print(f"fixed policy: predicted {fixed.step_s:.3f} s, peak {fixed.peak_bytes / 2**30:.1f} GiB")


def _vm_hwm_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _commit() -> str:
    if os.environ.get("LAZYTRAIN_COMMIT"):  # the GPU machine gets a copy of the tree without .git
        return os.environ["LAZYTRAIN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def cmd_run_one(args):
    # Slots and activations share the caching allocator's pool (NOTE: [Slots]); with fixed-size
    # segments its reserved memory measured 3x the allocated peak on the 7B bench.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    from bench.shapes import batch, build, n_params
    from lazytrain.runtime.schedule import load_schedule

    torch.backends.cuda.matmul.allow_tf32 = True
    data = batch(args.model, args.batch, args.seq, "cuda")
    t_build = time.perf_counter()
    predicted = {}
    if args.system == "resident":
        model = build(args.model, args.seq, "cuda", torch.bfloat16)
        build_s = time.perf_counter() - t_build
        model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

        def step():
            loss = model(**data).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        # bf16 masters: build in bf16 (an fp32 build of 14B alone takes 59 GB of host memory)
        model = build(args.model, args.seq, "cpu", torch.bfloat16 if args.master == "bf16" else torch.float32)
        build_s = time.perf_counter() - t_build  # the model ready; binding (pinning, device copies) is timed apart
        path = CASES / f"{case_name(args)}{ {'fixed': '.fixed', 'fused': '.fused'}.get(args.system, '')}.py"
        module = load_schedule(path)
        # "fused": lazytrain's plan with its stage bodies compiled (NOTE: [Fused stages] in runtime/fused.py)
        trainer = module.bind(model, device="cuda", lr=1e-5, serial_optimizer=args.system == "fixed",
                              cap_memory=not args.no_cap, fuse_stages=args.system == "fused")
        predicted = {"predicted_step_s": module.PREDICTED_STEP_S, "predicted_peak_gib": module.PREDICTED_PEAK / 2**30}

        def step():
            return trainer.step(data)
    bind_s = time.perf_counter() - t_build - build_s  # lazytrain: pinning and device copies; resident: the optimizer
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    last = time.perf_counter()
    for i in range(args.warmup + args.steps):
        if args.system != "resident" and i == args.warmup + args.steps - 1:
            trainer.record_timeline = True
        loss = step().item()
        now = time.perf_counter()
        times.append(now - last)
        losses.append(loss)
        last = now
    if not all(math.isfinite(x) for x in losses):  # a fast wrong run is not a result
        raise SystemExit(f"{args.system}: losses not finite ({losses}); no result written")
    measured = times[args.warmup:]
    step_s = statistics.median(measured)
    params = n_params(model)
    tokens = args.batch * args.seq
    attention = _attention_flops(model, args.batch, args.seq)
    exposed = None
    if args.system != "resident" and trainer.timeline:
        busy = [(a, b) for i, a, b in trainer.timeline if module.EVENTS[i].stream.value == "compute"]
        covered, end = 0.0, 0.0
        for a, b in sorted(busy):
            if b > end:
                covered += b - max(a, end)
                end = b
        exposed = max(0.0, end - covered)
    result = {
        "system": {"resident": "pytorch-resident", "fixed": "fixed-policy", "lazytrain": "lazytrain",
                   "fused": "lazytrain-fused"}[args.system]
        + ("-8bit" if args.states == "8bit" and args.system in ("lazytrain", "fused") else "")
        + ("-bf16master" if args.master == "bf16" and args.system in ("lazytrain", "fused") else ""),
        "model": args.model, "batch": args.batch, "seq": args.seq,
        "budget_gib": None if args.budget == "max" or args.system == "resident" else float(args.budget.removesuffix("GiB")),
        "tflops": 6 * params * tokens / step_s / 1e12, "tokens_per_s": tokens / step_s,
        # NOTE: [Model FLOPs] in lazytrain/train/flops.py: causal attention's own work beside 6N
        "tflops_with_attention": (6 * params * tokens + attention) / step_s / 1e12,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30, "reserved_gpu_gib": torch.cuda.max_memory_reserved() / 2**30,
        "peak_host_gib": _vm_hwm_gib(), "step_s": step_s, "step_times_s": measured, "losses": losses,
        "exposed_s": exposed, "build_s": build_s, "bind_s": bind_s, "params": params,
        **({"stage_compile_s": _compile_seconds()} if args.system == "fused" else {}),
        **({"slot_gib": trainer.memory_report()["slot_bytes"] / 2**30,
            "pinned_host_gib": trainer.memory_report()["pinned_bytes"] / 2**30} if args.system != "resident" else {}),
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "commit": _commit(),
        **predicted,
    }
    out = Path(args.out or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{case_name(args)}_{args.system}.json"
    (out / name).write_text(json.dumps(result, indent=1) + "\n")
    if args.system != "resident" and trainer.timeline:  # where the time goes: `lazytrain inspect --measured`
        from lazytrain.timeline import save_measured

        save_measured(out / f"{case_name(args)}_{args.system}.timeline.json", trainer.timeline, module)
    print(json.dumps({k: v for k, v in result.items() if k not in ("step_times_s", "losses")}))


def _attention_flops(model, rows: int, seq: int) -> int:
    """Causal attention's training FLOPs over `rows` full rows of `seq` tokens (one sequence each)."""
    import numpy as np

    from lazytrain.train.flops import attention_flops, attention_layers

    layers = attention_layers(model)
    return attention_flops(layers, np.full(rows, seq)) if layers is not None else 0


def _compile_seconds() -> float:
    from lazytrain.runtime.fused import compile_seconds

    return compile_seconds()


def cmd_run(args):
    rows = []
    for system in args.systems.split(","):
        cmd = [sys.executable, str(HERE / "bench.py"), "run-one", "--system", system, "--model", args.model,
               "--batch", str(args.batch), "--seq", str(args.seq), "--budget", args.budget, "--states", args.states,
               "--master", args.master, *(["--no-cap"] if args.no_cap else []), *(["--disk"] if args.disk else []),
               "--tile-bytes", args.tile_bytes,
               "--steps", str(args.steps),
               "--warmup", str(args.warmup)] + (["--out", args.out] if args.out else [])
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        line = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else None
        if line is None:
            print(f"{system}: failed after {time.perf_counter() - start:.0f} s\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(line))
    print(f"{'system':<18}{'TFLOPS':>8}{'+attn':>8}{'tok/s':>10}{'step s':>9}{'pred s':>8}{'GPU GiB':>9}{'host GiB':>9}{'exposed':>9}")
    for r in rows:
        print(f"{r['system']:<18}{r['tflops']:>8.1f}{r.get('tflops_with_attention', 0):>8.1f}{r['tokens_per_s']:>10.0f}{r['step_s']:>9.3f}"
              f"{r.get('predicted_step_s') or float('nan'):>8.3f}{r['peak_gpu_gib']:>9.1f}{r['peak_host_gib']:>9.1f}"
              f"{r['exposed_s'] if r['exposed_s'] is not None else float('nan'):>9.3f}")


def cmd_table(args):
    rows = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json")) if not p.name.endswith(".timeline.json")]
    lines = ["| system | model | batch×seq | budget GiB | TFLOPS | tokens/s | step s (pred.) | peak GPU GiB (pred.) "
             "| reserved GPU GiB | peak host GiB | exposed s | date, device, commit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred_s = f" ({r['predicted_step_s']:.2f})" if r.get("predicted_step_s") else ""
        pred_m = f" ({r['predicted_peak_gib']:.1f})" if r.get("predicted_peak_gib") else ""
        exposed = f"{r['exposed_s']:.2f}" if r.get("exposed_s") is not None else "-"
        reserved = f"{r['reserved_gpu_gib']:.1f}" if "reserved_gpu_gib" in r else "-"
        lines.append(f"| {r['system']} | {r['model']} | {r['batch']}×{r['seq']} | {r['budget_gib'] or '-'} | {r['tflops']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['step_s']:.2f}{pred_s} | {r['peak_gpu_gib']:.1f}{pred_m} | "
                     f"{reserved} | "
                     f"{r['peak_host_gib']:.1f} | {exposed} | {r['date']}, {r['device']}, {r['commit']} |")
    readme = HERE / "README.md"
    text = readme.read_text()
    start, end = text.index("<!-- results -->"), text.index("<!-- /results -->")
    readme.write_text(text[:start] + "<!-- results -->\n" + "\n".join(lines) + "\n" + text[end:])
    print("\n".join(lines))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, fn in (("compile", cmd_compile), ("run", cmd_run), ("run-one", cmd_run_one), ("table", cmd_table)):
        s = sub.add_parser(name)
        s.set_defaults(fn=fn)
        if name == "table":
            continue
        s.add_argument("--model", default="qwen2.5-7b")
        s.add_argument("--batch", type=int, default=32)
        s.add_argument("--seq", type=int, default=1024)
        s.add_argument("--budget", default="24GiB", help="a size in GiB (e.g. 24GiB) or max")
        s.add_argument("--states", choices=["32bit", "8bit"], default="32bit", help="lazytrain's optimizer states")
        s.add_argument("--master", choices=["fp32", "bf16"], default="fp32", help="lazytrain's master weights")
        s.add_argument("--disk", action="store_true", help="lazytrain may keep host-stepped states on disk (in the temp directory)")
        s.add_argument("--tile-bytes", default="0", help="lazytrain's gated MLPs and RMSNorms in tiles of this size (0: untiled)")
        if name == "compile":
            s.add_argument("--hardware", default="h200")
            s.add_argument("--time-limit", type=float, default=120.0)
        else:
            s.add_argument("--steps", type=int, default=5)
            s.add_argument("--warmup", type=int, default=2)
            s.add_argument("--out", default=None)
            s.add_argument("--no-cap", action="store_true", help="leave the allocator uncapped (NOTE: [Memory cap])")
        if name == "run":
            s.add_argument("--systems", default="resident,fixed,lazytrain")
            s.add_argument("--timeout", type=float, default=400)
        if name == "run-one":
            s.add_argument("--system", choices=["resident", "fixed", "lazytrain", "fused"], required=True)
    args = p.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
