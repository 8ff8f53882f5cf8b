"""Data parallel on one box: tokens/s of N GPUs against one, in the same run.

    python bench/dp.py compile --model qwen2.5-7b --batch 32 --budget 24GiB --states 8bit --master bf16 --world 1,2
    python bench/dp.py run --model qwen2.5-7b --batch 32 --budget 24GiB --states 8bit --master bf16 --world 1,2

`compile` (here) writes one schedule per world size into .bench/dp/; `--batch` is one rank's batch,
so N ranks train on N times the tokens of one. `run` (on the GPU machine) runs each world size in
turn through torchrun, each rank on its own GPU with its own host copy of the model, and prints one
row per world size: the median step after warm-up, tokens/s of the global batch, and the speed-up
over the first world size listed. NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
CASES = HERE.parent / ".bench" / "dp"


def _name(args, world: int) -> str:
    return f"{args.model}_b{args.batch}_s{args.seq}_{args.budget}_{args.states}_{args.master}_w{world}"


def cmd_compile(args) -> None:
    import torch

    from bench.shapes import batch, meta_model
    from lazytrain import hardware
    from lazytrain.options import CompileOptions
    from lazytrain.pipeline import compile_model
    from lazytrain.units import parse_size

    hw = hardware.load(args.hardware)
    meta = meta_model(args.model, args.seq).to(torch.bfloat16)
    options = CompileOptions(budget="max" if args.budget == "max" else parse_size(args.budget),
                             optimizer_states=args.states, master_weights=args.master, clipping="off")  # the runs do not clip
    CASES.mkdir(parents=True, exist_ok=True)
    for world in map(int, args.world.split(",")):
        c = compile_model(meta, batch(args.model, args.batch, args.seq), hardware=hw, source=f"bench:{args.model}",
                          options=dataclasses.replace(options, world_size=world))
        (CASES / f"{_name(args, world)}.py").write_text(c.source_text)
        print(f"world {world}: predicted {c.plan.step_s:.3f} s a step, peak {c.plan.peak_bytes / 2**30:.1f} GiB a GPU")


def cmd_worker(args) -> None:
    """One rank, under torchrun: bind, train, and (rank 0) write the step times."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    import torch.distributed as dist

    from bench.shapes import batch, build
    from lazytrain.runtime.schedule import load_schedule

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5), device_id=device)
    torch.manual_seed(rank)  # each rank its own tokens
    data = batch(args.model, args.batch, args.seq, "cuda", seed=rank)
    model = build(args.model, args.seq, "cpu", torch.bfloat16 if args.master == "bf16" else torch.float32)
    module = load_schedule(CASES / f"{_name(args, world)}.py")
    trainer = module.bind(model, device="cuda", lr=1e-5)
    del model  # the trainer holds what it needs (the masters)
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(trainer.step(data).item())
        times.append(time.perf_counter() - start)
    # every rank's peak resident host memory: the ranks share one host
    hosts = [_vm_hwm_bytes()] * world
    if world > 1:
        dist.all_gather_object(hosts, hosts[0])
    if rank == 0:
        step = statistics.median(times[args.warmup:])
        tokens = world * args.batch * args.seq
        Path(args.result).write_text(json.dumps({
            "world": world, "step_s": step, "step_times_s": times[args.warmup:], "tokens_per_s": tokens / step,
            "predicted_step_s": module.PREDICTED_STEP_S, "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
            "host_peak_gib": [h / 2**30 for h in hosts],
            "predicted_host_gib": module.PREDICTED["host_bytes"] / 2**30,
            "losses": losses, "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "commit": os.environ.get("LAZYTRAIN_COMMIT", "unknown")}) + "\n")
    if world > 1:
        dist.destroy_process_group()


def _vm_hwm_bytes() -> float:
    """This process's peak resident host memory (the kernel's VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024.0
    return float("nan")


def cmd_run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for world in map(int, args.world.split(",")):
        result = out / f"{_name(args, world)}.json"
        # torchrun gives each of several ranks one OpenMP thread unless told otherwise, which starves
        # the host optimizer (7B, 32-bit states, 2 ranks: 9.9 s a step against 3.9 s): the cores are shared
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(HERE / "dp.py"), "worker", "--result", str(result), *_shape_args(args)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            print(f"world {world}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(result.read_text()))
    base = rows[0]["tokens_per_s"] if rows else None
    print(f"{'world':>5}{'step s':>9}{'pred s':>8}{'tokens/s':>11}{'speed-up':>10}{'GPU GiB':>9}"
          f"  host GiB a rank (pred.)")
    for r in rows:
        hosts = "/".join(f"{h:.1f}" for h in r.get("host_peak_gib", []))
        print(f"{r['world']:>5}{r['step_s']:>9.3f}{r['predicted_step_s']:>8.3f}{r['tokens_per_s']:>11.0f}"
              f"{r['tokens_per_s'] / base:>10.2f}{r['peak_gpu_gib']:>9.1f}  {hosts} ({r.get('predicted_host_gib', 0):.1f})")


def _shape_args(args) -> list[str]:
    return ["--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq), "--budget", args.budget,
            "--states", args.states, "--master-weights", args.master, "--steps", str(args.steps), "--warmup", str(args.warmup)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("compile", "run", "worker"):
        s = sub.add_parser(name)
        s.add_argument("--model", default="qwen2.5-7b")
        s.add_argument("--batch", type=int, default=32, help="one rank's batch")
        s.add_argument("--seq", type=int, default=1024)
        s.add_argument("--budget", default="24GiB", help="a size per GPU (e.g. 24GiB) or max")
        s.add_argument("--states", choices=["32bit", "8bit"], default="8bit")
        s.add_argument("--master", "--master-weights", dest="master", choices=["fp32", "bf16"], default="bf16")
        s.add_argument("--world", default="1,2", help="world sizes, comma-separated")
        s.add_argument("--hardware", default="h200")
        s.add_argument("--steps", type=int, default=4)
        s.add_argument("--warmup", type=int, default=2)
        s.add_argument("--out", default="bench/results/dp")
        s.add_argument("--result", default=None)
        s.add_argument("--timeout", type=float, default=560)
    args = p.parse_args(argv)
    {"compile": cmd_compile, "run": cmd_run, "worker": cmd_worker}[args.cmd](args)


if __name__ == "__main__":
    main()
