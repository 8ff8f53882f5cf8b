"""What `bench/fidelity.py run` reads beside the steps' times: the process's host memory and storage
traffic, the caching allocator's segments, disk-stepped jobs' phases, and evaluations' time."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.fidelity_cases import GiB


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return -1


def _io_bytes() -> tuple[int, int] | None:
    """Bytes this process has read from and written to storage so far (/proc/self/io's read_bytes
    and write_bytes: what reached the block layer, so direct transfers count and page-cache hits
    do not); None where the kernel does not say."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def _clear_host_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def stream_names(trainer) -> dict[int, str]:
    """The trainer's CUDA streams by the name the plan gives them (the default stream: "optimizer")."""
    names = {trainer.streams.aside.cuda_stream: "optimizer"}
    names.update({s.cuda_stream: k.value for k, s in trainer.streams.streams.items()})
    return names


def _segments(trainer) -> dict[str, dict[str, int]]:
    """What the caching allocator holds after the timed steps, per stream and pool: reserved bytes
    beyond allocated ones are what a plan at its cap loses to the allocator (its retries)."""
    import torch

    names = stream_names(trainer)
    out: dict[str, dict[str, int]] = {}
    for seg in torch.cuda.memory_snapshot():
        key = f"{names.get(seg['stream'], seg['stream'])}/{seg['segment_type']}"
        o = out.setdefault(key, {"segments": 0, "reserved": 0, "allocated": 0})
        o["segments"] += 1
        o["reserved"] += seg["total_size"]
        o["allocated"] += seg["allocated_size"]
    return out


def _time_disk_jobs(trainer) -> list | None:
    """Disk-stepped stages' jobs timed in their phases (NOTE: [Disk-stepped stages] in
    solver/disk_model.py): the states' read, the GPU part as issued, the write back; rows (phase,
    stage, start, end) on `time.perf_counter`, beside each step's start. From the GPU part's issue
    to the write back, the job waits for the GPU part."""
    if getattr(trainer, "disk_stepper", None) is None or not trainer.disk_stepper.params:
        return None
    log: list = []

    def wrap(obj, name, phase):
        inner = getattr(obj, name)

        def timed(stage, *a, **k):
            t = time.perf_counter()
            out = inner(stage, *a, **k)
            log.append((phase, stage, t, time.perf_counter()))
            return out
        setattr(obj, name, timed)
    wrap(trainer.disk_states, "load", "load")
    wrap(trainer.disk_states, "store", "store")
    wrap(trainer.disk_stepper, "step_from_disk", "gpu_issue")
    return log


def _time_evaluations(trainer, data, args, row: dict) -> None:
    """With --eval N: N evaluations of the batch (`Trainer.loss`: the forwards alone, NOTE:
    [Forward-only evaluation] in lazytrain/runtime/forward_only.py) after one untimed (its compiles),
    their median seconds and the most memory allocated while they ran, after every step measured (an
    evaluation applies the pending updates, which the next step's prefetches would have)."""
    import torch

    if not args.eval:
        return
    trainer.loss(data)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.eval):
        start = time.perf_counter()
        trainer.loss(data).item()
        times.append(time.perf_counter() - start)
    row["eval_s"], row["eval_times_s"] = statistics.median(times), times
    row["eval_allocated_peak_bytes"] = torch.cuda.max_memory_allocated()
    # what the plan prices the step's forward computes at: an evaluation's floor, its transfers hidden
    from lazytrain.ir.events import Kind, Phase
    row["plan_forward_s"] = sum(e.duration_s for e in trainer.replay.events if e.kind is Kind.COMPUTE and e.phase is Phase.FWD)
    print(f"[fidelity] {row['case']['model']} evaluation: {row['eval_s']:.3f} s a batch (a step {row['step_s']:.3f}; "
          f"the plan's forward computes {row['plan_forward_s']:.3f}), {row['eval_allocated_peak_bytes'] / GiB:.1f} GiB "
          "allocated at most", flush=True)
