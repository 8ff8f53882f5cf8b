"""`lazytrain profile`: measure this machine into a hardware profile for the cost model.

Each rate is the median of several timed runs after a warm-up. Without a GPU, "device" transfers
are host copies and the device is the CPU, which is what the CPU runtime does. Under torchrun on 2 or
more GPUs (`torchrun --nproc-per-node 2 -m lazytrain.cli profile -o hw.json`) it also measures the
ranks' link (NOTE: [Link bandwidth] in hardware/__init__.py); rank 0 writes the profile.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch

from lazytrain.files import free_bytes
from lazytrain.hardware import Hardware
from lazytrain.host import host_memory


def _median_time(fn, repeat: int = 5, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _total_host_memory() -> int:
    """The host memory plans may count on: the machine's, or its container's limit (`host_memory`)."""
    return host_memory() or 16 * 2**30


def _as_rank() -> None:
    """Under torchrun with several ranks on this host: this rank's own GPU (LOCAL_RANK), and its share
    of the host's cores where the launcher left it one thread, as `lazytrain train --nproc-per-node`
    gives it (NOTE: [Launching] in train/distributed.py): the rates are those a rank trains at."""
    from lazytrain.train.distributed import thread_share

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if local_world < 2:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if share := thread_share(local_world):
        torch.set_num_threads(share)


def profile(output: str | Path, quick: bool = False, offload_dir: str | Path | None = None) -> Hardware:
    """Measure this machine and write its profile to `output`; the disk rates and free space are
    those of `offload_dir` (default: the system temp directory), where the offload tier will write."""
    _as_rank()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    offload_dir = Path(offload_dir if offload_dir is not None else tempfile.gettempdir())
    probe, regions = (256 * 2**20, 4 if quick else 16) if cuda else ((8 if quick else 32) * 2**20, 4 if quick else 8)
    disk_w, disk_r, disk_both, direct = _disk_rates(offload_dir, probe, regions)  # first: a bad --offload-dir fails at once
    n = (2048 if quick else 4096) if cuda else (512 if quick else 1024)
    flops = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(n, n, device=dev, dtype=dtype)
        t = _median_time(lambda a=a: a @ a, sync=sync)
        flops[str(dtype).removeprefix("torch.")] = 2 * n**3 / t
    flops["float16"] = flops["bfloat16"]

    nbytes = (256 if quick else 1024) * 2**20 if cuda else (64 if quick else 256) * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    mem_bw = 2 * nbytes / _median_time(lambda: dst.copy_(src), sync=sync)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    host2 = torch.empty(nbytes, dtype=torch.uint8)
    h2d = nbytes / _median_time(lambda: src.copy_(host, non_blocking=True), sync=sync)
    d2h = nbytes / _median_time(lambda: host.copy_(src, non_blocking=True), sync=sync)
    pageable = nbytes / _median_time(lambda: src.copy_(host2), sync=sync)
    memcpy = nbytes / _median_time(lambda: host2.copy_(host))
    if cuda:
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def both():
            with torch.cuda.stream(s1):
                src.copy_(host, non_blocking=True)
            with torch.cuda.stream(s2):
                host.copy_(dst, non_blocking=True)
        duplex = nbytes / _median_time(both, sync=sync)
    else:
        duplex = memcpy / 2

    def adamw_rate(device) -> float:
        numel = (2**22 if quick else 2**24)
        p = torch.nn.Parameter(torch.randn(numel, device=device))
        p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW([p], fused=True if device.type == "cuda" else None)
        return numel / _median_time(opt.step, sync=sync if device.type == "cuda" else (lambda: None))

    def round_rate() -> float:
        from lazytrain.runtime.optim import round_stochastic_

        numel = 2**22 if quick else 2**24
        src, dst = torch.randn(numel), torch.empty(numel, dtype=torch.bfloat16)
        return numel / _median_time(lambda: round_stochastic_(dst, src, seed=1))

    runtime, reserve = 0, 0
    if cuda:  # NOTE: [Allocator reserve] in hardware/__init__.py
        runtime, reserve = max(_library_workspaces(), 256 << 20), 2 << 30

    cpu_adamw = adamw_rate(torch.device("cpu"))
    gpu_adamw = adamw_rate(dev)
    hw = Hardware(
        name=f"measured-{dev.type}", device=dev.type,
        description=f"measured by `lazytrain profile` on {time.strftime('%Y-%m-%d')} ({torch.cuda.get_device_name() if cuda else 'CPU only'}"
        + (")" if direct else f"; disk rates through the page cache of {offload_dir}, upper bounds)"),
        gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory if cuda else _total_host_memory(),
        host_memory_bytes=_total_host_memory(), disk_bytes=free_bytes(offload_dir) or 0, flops=flops, achieved_fraction=1.0,
        mem_bandwidth=mem_bw, op_overhead_s=5e-6 if cuda else 2e-6, h2d_bandwidth=h2d, d2h_bandwidth=d2h,
        duplex_bandwidth=duplex, pageable_h2d_bandwidth=pageable, host_memcpy_bandwidth=memcpy,
        cpu_adamw_params_per_s=cpu_adamw, gpu_adamw_params_per_s=gpu_adamw,
        cpu_adamw8bit_params_per_s=cpu_adamw / 50, gpu_adamw8bit_params_per_s=gpu_adamw / 3,
        cpu_round_params_per_s=round_rate(),
        disk_write_bandwidth=disk_w, disk_read_bandwidth=disk_r, disk_duplex_bandwidth=disk_both,
        estimated=("op_overhead_s", "cpu_adamw8bit_params_per_s", "gpu_adamw8bit_params_per_s")
        + (() if direct else ("disk_write_bandwidth", "disk_read_bandwidth", "disk_duplex_bandwidth"))
        + (("allocator_reserve_bytes", "gpu_round_params_per_s", "gpu_round_tensor_s", "gpu_step_issue_tensor_s")
           if cuda else ("duplex_bandwidth",)),
        runtime_bytes=runtime, allocator_reserve_bytes=reserve, link_bandwidth=_link_bandwidth(quick) if cuda else 0.0,
        # NOTE: [Device steps of bf16 masters]: the H200's ratios (bench/gpu_step.py measures them)
        gpu_round_params_per_s=0.64 * gpu_adamw if cuda else 0.0, gpu_round_tensor_s=1.4e-4 if cuda else 0.0,
        # NOTE: [Steps the host issues after backward]: the H200 box's (bench/step_issue.py measures it)
        gpu_step_issue_tensor_s=4.7e-4 if cuda else 0.0,
    )
    if cuda:  # NOTE: [Fused stage prices] in passes/fusion.py
        hw = dataclasses.replace(hw, fused_elementwise_factor=fused_factor(hw, quick))
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(output).write_text(json.dumps(asdict(hw), indent=1) + "\n")
    return hw


# A Qwen2.5-1.5B decoder layer (hidden, intermediate, heads, kv heads) with a small vocabulary, so
# the loss stage is a small part of the step measured
FUSED_LAYER = (1536, 8960, 12, 2)


def fused_factor(hw: Hardware, quick: bool) -> float:
    """The profile's `fused_elementwise_factor` (NOTE: [Fused stage prices] in passes/fusion.py): a
    one-layer bf16 model's forward and backward on this GPU eager and compiled by Inductor, with the
    element-wise share of its eager time that the cost model gives it on `hw`; 1.0 (not known) where
    the compile fails."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lazytrain.passes.fusion import elementwise_share, factor_from_times
    from lazytrain.pipeline import analyse

    hidden, inter, heads, kv = FUSED_LAYER
    rows, seq = (4 if quick else 8), 1024
    config = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=512, max_position_embeddings=seq, use_cache=False,
                         attn_implementation="sdpa")
    with torch.device("meta"):
        meta = Qwen2ForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(rows, seq, dtype=torch.long, device="meta")
    _, stages = analyse(meta, {"input_ids": ids, "labels": ids}, hw, fuse_stages=False)
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (rows, seq), device="cuda")
    step = lambda m: m(input_ids=ids, labels=ids).loss.backward()  # noqa: E731
    eager = _median_time(lambda: step(model), sync=torch.cuda.synchronize)
    try:
        compiled = torch.compile(model, dynamic=False)
        fused = _median_time(lambda: step(compiled), sync=torch.cuda.synchronize)
    except Exception as exc:  # noqa: BLE001  (any compile failure: the factor stays unknown)
        print(f"profile: fused stage bodies not measured, the compile failed: {type(exc).__name__}")
        return 1.0
    return factor_from_times(eager, fused, elementwise_share(stages))


def _link_bandwidth(quick: bool) -> float:
    """The ranks' all-gather and reduce-scatter of a large bf16 buffer, as algorithm bandwidth (the
    buffer's bytes over the slower one's time on the slowest rank), when this process is one of 2 or
    more torchrun ranks, one GPU each; else 0 (not measured)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) < 2:
            return 0.0
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    world = dist.get_world_size()
    if world < 2:
        return 0.0
    numel = (128 if quick else 1024) * 2**20 // 2  # bf16 elements of the whole buffer
    numel -= numel % world
    full = torch.zeros(numel, dtype=torch.bfloat16, device="cuda")
    mine = torch.zeros(numel // world, dtype=torch.bfloat16, device="cuda")
    sync = torch.cuda.synchronize
    seconds = max(_median_time(lambda: dist.all_gather_into_tensor(full, mine), sync=sync),
                  _median_time(lambda: dist.reduce_scatter_tensor(mine, full), sync=sync))
    slowest = torch.tensor([seconds], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return 2 * numel / slowest.item()


def _library_workspaces() -> int:
    """What the CUDA libraries keep from the caching allocator once matmuls ran on the streams a
    schedule computes and steps on (cuBLAS: a workspace per stream and handle); at least the
    H200's 256 MiB is planned (`profile` takes the larger)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    held = torch.cuda.memory_allocated() - before
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream):
            (a @ a).float().sum().item()
    torch.cuda.synchronize()
    return max(0, torch.cuda.memory_allocated() - before - held)


class DiskRates(NamedTuple):
    """Per region, bytes a second through the offload file: written, read, and read and written at
    once (two regions' bytes over their time together); whether they bypassed the page cache."""
    write: list[float]
    read: list[float]
    both: list[float]
    direct: bool


def disk_region_rates(directory: Path, nbytes: int, count: int) -> DiskRates:
    """`count` regions of `nbytes` each moved one after another through the offload tier's file in
    `directory`: each written, each read back, then half of them written while the other half are
    read, a pair at a time (NOTE: [Disk reads and writes at once] in hardware/__init__.py). Without
    O_DIRECT every rate is the page cache's, an upper bound (NOTE: [Offload files] in
    runtime/disk.py). The buffers are page-aligned, and page-locked on a GPU machine, as the tier's
    buffers are.
    NOTE: [Sustained disk rates] A disk absorbs a burst faster than a stream: on the H200 box, 5
    writes of the same 256 MiB ran at 2.86 GB/s, 24 different regions at 2.16, and the disk tier's
    steps ran at the slower rate. So each region is new, and the median over many is taken."""
    from lazytrain.runtime.disk import OffloadFile, aligned_empty

    out, back = (aligned_empty(nbytes, pin=torch.cuda.is_available()) for _ in range(2))
    out.fill_(1)
    with OffloadFile(directory, {f"r{i}": nbytes for i in range(count)}) as disk:
        def timed(*ops) -> float:
            start = time.perf_counter()
            for f in [op() for op in ops]:
                f.result()
            return len(ops) * nbytes / (time.perf_counter() - start)

        write = [timed(lambda i=i: disk.write(f"r{i}", out)) for i in range(count)]
        read = [timed(lambda i=i: disk.read(f"r{i}", back)) for i in range(count)]
        half = max(1, count // 2)
        both = [timed(lambda i=i: disk.write(f"r{i}", out), lambda i=i: disk.read(f"r{(i + half) % count}", back))
                for i in range(half)]
        return DiskRates(write, read, both, disk.direct)


def _disk_rates(directory: Path, nbytes: int, count: int = 16) -> tuple[float, float, float, bool]:
    """Median sustained write, read, and reads and writes at once rates of `disk_region_rates`, and
    whether they went direct."""
    r = disk_region_rates(directory, nbytes, count)
    return statistics.median(r.write), statistics.median(r.read), statistics.median(r.both), r.direct
