"""The disk tier's part of the step model (NOTE: [The step model] in formulation.py): what the plan keeps
in the offload file (optimizer states, stage outputs between forward and backward), the host memory
that takes off and the buffers it passes through there, the GPU slot disk-stepped jobs share, and
the disk's own seconds per window, which `formulation._exposure` prices as it prices the PCIe directions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mip

from lazytrain.solver import boundary
from lazytrain.solver.backlog import backlog
from lazytrain.solver.footprint import (
    ACT_RING,
    DISK_RING,
    can_put_outputs_on_disk,
    disk_gpu_state_bytes,
    disk_io_s,
    disk_master_bytes,
    disk_state_bytes,
    disk_step_slot,
)

if TYPE_CHECKING:
    from lazytrain.solver.step_model import StepModel


def disk_tier(model: StepModel, disk_ok: bool, TAIL: int) -> None:
    """Adds to `model`: `disk` (bytes in the offload file), `disk_io` (the disk's seconds per window),
    and the host bytes and GPU slot of the disk's kinds; with no disk tier, bounds them at none."""
    st, m, v, unit = model.st, model.m, model.v, model.unit
    disk, dst, bdk, adk, mdk = v["disk"], v["dstep"], v["bdisk"], v["adisk"], v["mdisk"]
    # NOTE: [Disk-resident states] the moments on disk, and the one staging buffer they pass through
    on_disk = [disk_state_bytes(g.param_numel) * disk[s] + disk_gpu_state_bytes(g.param_numel, st.state_bytes) * dst[s]
               for s, g in enumerate(st)]
    # NOTE: [Backward steps from disk]: their states, which pass through the ring, not the staging buffer
    in_ring = [disk_gpu_state_bytes(g.param_numel, st.state_bytes) * bdk[s] for s, g in enumerate(st)]
    states = mip.xsum(x * (1.0 / unit) for x in on_disk + in_ring) * unit  # all of it leaves the host
    masters = mip.xsum(disk_master_bytes(g) * mdk[s] for s, g in enumerate(st))  # NOTE: [Masters on disk]
    acts = [boundary.outputs_on_disk(model.v, s, g) for s, g in enumerate(st)]  # NOTE: [Activations on disk], by the tile
    model.disk = states + masters + mip.xsum(on for on, _ in acts)
    model.disk_io = [0.0] * (TAIL + 1)  # seconds of disk reads and writes in a window
    if not disk_ok:
        for x in bdk + adk + mdk:
            m += x == 0
        return
    model.floors.append(model.disk * (1.0 / unit))  # among equally fast plans, the least on disk
    staging = m.add_var("disk_staging", lb=0.0)  # in units of `unit` bytes
    model.floors.append(staging)
    for x in on_disk:
        m += staging >= x * (1.0 / unit)
    # NOTE: [Disk reads ahead] in runtime/disk_states.py: the next job's, disk-stepped
    ahead = m.add_var("disk_staging_ahead", lb=0.0)  # in units of `unit` bytes
    model.floors.append(ahead)
    for s, g in enumerate(st):
        m += ahead >= (disk_gpu_state_bytes(g.param_numel, st.state_bytes) / unit) * dst[s]
    # the host gives up what went to disk (outputs: only what offloading them had put there)
    model.host = model.host + (staging + ahead) * unit - states - mip.xsum(left for _, left in acts)
    # NOTE: [Disk-stepped stages] one GPU slot the jobs take turns in, for the whole step
    slot = m.add_var("disk_step_slot", lb=0.0)  # in units of `unit` bytes
    model.floors.append(slot)
    for s in range(len(st)):
        m += slot >= (disk_step_slot(st, s) / unit) * dst[s]
    model.mem = [t + slot * unit for t in model.mem]
    model.tail = model.tail + slot * unit
    on_disk_acts = [on for on, _ in acts]
    _rings(model, bdk, on_disk_acts, mdk)
    _disk_worker(model, bdk, on_disk_acts, mdk, TAIL)


def _rings(model: StepModel, bdk, acts, mdk) -> None:
    """The page-locked buffers on the host that states stepped in backward (NOTE: [Backward steps
    from disk]), with their masters where those are on disk too (NOTE: [Masters on disk]), and
    outputs on disk (NOTE: [Activations on disk]) pass through: a ring of each, its buffers as
    large as the largest of what passes."""
    st, m, unit = model.st, model.m, model.unit
    for name, size, passing in (
            ("disk_ring", DISK_RING, lambda s, g: disk_gpu_state_bytes(g.param_numel, st.state_bytes) * bdk[s]
             + disk_master_bytes(g) * mdk[s]),
            ("act_ring", ACT_RING, lambda s, g: acts[s])):
        ring = m.add_var(name, lb=0.0)  # one buffer, in units of `unit` bytes
        model.floors.append(ring)
        for s, g in enumerate(st):
            m += ring >= passing(s, g) * (1.0 / unit)
        model.host = model.host + (size * unit) * ring


def _disk_worker(model: StepModel, bdk, acts, mdk, TAIL: int) -> None:
    """The disk as a worker of its own (`backlog`): outputs written in the forward, each by the time
    the ring needs its buffer again; states and outputs read (and states written) in backward, each
    by the window before the one that needs it (NOTE: [Backward steps from disk], NOTE: [Activations
    on disk]); and the reads and writes of the host worker's jobs (NOTE: [One disk])."""
    st, L, S, hw = model.st, model.L, len(model.st), model.hw
    released, due = [0.0] * (TAIL + 1), [0.0] * (TAIL + 1)
    for s, g in enumerate(st):
        io = (disk_io_s(disk_gpu_state_bytes(g.param_numel, st.state_bytes), hw) * bdk[s]
              + disk_io_s(disk_master_bytes(g), hw) * mdk[s])  # NOTE: [Masters on disk]
        released[L.bw(S - 1)] += io
        due[L.bw(min(s + 2, S - 1))] += io
        if can_put_outputs_on_disk(st, s):  # `formulation._vars` allows no other
            last = g.consumers[-1]
            write = acts[s] * (1.0 / hw.disk_write_bandwidth)
            released[L.fw(s + 1)] += write
            due[L.fw(min(s + ACT_RING, S - 1))] += write
            read = acts[s] * (1.0 / hw.disk_read_bandwidth)
            released[L.bw(S - 1)] += read
            due[L.bw(last + 2)] += read
    windows = list(range(S)) + [L.bw(w) for w in range(S - 1, -1, -1)] + [TAIL]
    for w, done in backlog(model.m, released, windows, model.unit_s, due).items():
        model.disk_io[w] = model.disk_io[w] + done
    # NOTE: [One disk]: the host worker's jobs' reads and writes, in the windows those jobs may run in
    # (into the next forward: the same windows, a step later)
    for w, done in backlog(model.m, model.job_disk_released, model.hosted, model.unit_s, model.job_disk_due).items():
        model.disk_io[w] = model.disk_io[w] + done


# NOTE: [Masters on disk]
# A stage stepped in backward from disk (NOTE: [Backward steps from disk]) with fp32 masters of
# 16-bit weights may keep its master in the offload file too (`mdisk`, a placement stepped by
# `Step.in_backward(Tier.DISK, Tier.DISK)`). The master then passes through the ring with the
# states: the disk thread reads both into a ring buffer before the step, the H2D beside the backward
# prefetch takes the master from there, and the write-back after the step returns it there before
# both are written back. Its prefetches cannot read the master (NOTE: [Weights from the master] in
# footprint.py), so the host keeps the compute-dtype copy they read, which the step's write-back
# refreshes: per parameter the host gives up the master's 4 bytes for the copy's 2, the disk holds 4
# more and moves 8 more a step (read and written), a ring buffer grows by 4, H2D carries 2 fewer on
# each prefetch and D2H 2 more after the step, and the weight slot needs no staging region. Between
# steps the master is the file: the model's parameter is the region, mapped (NOTE: [Mapped regions]
# in runtime/disk.py), so `state_dict`, checkpoints, `sync_model` and exports read it there and
# resuming writes into it. bf16 masters are not put on disk: there the master is the weights the
# prefetches read, so a streamed block's weights would cross the disk three times a step (two reads,
# a write), about 3 s for a 72B layer on the H200 box's disk against its 0.2 s of compute at
# 8 x 1024 tokens.
# NOTE: [Activations on disk]
# A stage's offloaded outputs (Outputs.OFFLOAD: to host memory during F(s+1)..F(cmax), back during
# B(cmax+1)) may go on to the offload file (`adisk`, Outputs.DISK), where host memory binds and
# nothing else fits: they are searched where steps in backward are (NOTE: [Backward steps where
# nothing else fits] in formulation.py). The GPU side and its PCIe copies are an offload's; on the host
# they pass through a ring of ACT_RING page-locked buffers (runtime/disk_acts.py), each as large as
# the largest such stage's outputs carved at 4 KiB (`disk_act_bytes`), instead of a host buffer
# each: the host gives up `out_bytes` a stage and keeps the ring. A writer thread writes each
# stage's outputs once their D2H copy has landed, and the offload ACT_RING stages later needs the
# buffer back, so each write is due by the end of F(s + ACT_RING). After the last such offload a
# reader thread reads them back in the order backward reloads them; the reload at B(cmax+1) waits
# for its read before it issues its copy (and, on the replay thread, the compute after it), so each
# read is due by the end of B(cmax+2), which must be a window of backward: only outputs whose last
# reader is stage S-3 or earlier go to disk. These are jobs of the disk worker, with the states of
# steps in backward from disk (NOTE: [Backward steps from disk]); the disk's seconds enter each
# window's exposure. The disk's other users (host-stepped and disk-stepped stages' jobs) count on
# the host worker and on the disk (NOTE: [One disk]). On the H200 box (2026-12-02, 0dd0794, bench/
# README.md) the 7B at 1 x 65536, 40 GiB, with a 36 GB host kept 12 blocks' outputs (470 MB each)
# on disk beside other disk kinds, 12.21 GB read and written a step as planned, and took 14.34 s
# against 13.98 predicted; with the whole host (outputs in host memory) 14.35 against 13.92.
# NOTE: [One disk]
# Every kind of the tier reads and writes the same disk, so the disk's seconds in a window are the
# sum of all of them, and a window lasts at least that long (`formulation._exposure`): the outputs and the
# states of steps in backward, which the disk worker schedules (`_disk_worker`), and the reads and
# writes inside the host worker's jobs (host-stepped and disk-stepped stages'), spread by a backlog
# of their own over the windows those jobs may run in, released and due with them. Those jobs still
# count whole on the host worker too: each job's disk time holds the worker, and the same time holds
# the disk. Counted on the host worker alone, the disk seemed free beside them: the 7B at 1 x 65536
# with a 36 GB host on the H200 (2026-12-02, eaa5899; 3 host-stepped blocks' moments, 11 steps in
# backward from disk and 8 blocks' outputs on disk, 14.1 GB read and 14.1 written a step, measured
# with /proc/self/io to the plan's byte) was planned at 13.97 s with 14.62 s of disk time in it, and
# took 17.01 s, the backward waiting at the reloads of outputs whose reads queued behind the host
# steps' moments.
# NOTE: [Backward steps from disk]
# A stage stepped in backward (NOTE: [Backward steps] in step_model.py) may keep its optimizer states in the offload
# file (`bdisk`, a placement stepped by `Step.in_backward(Tier.DISK)`): they come into host memory only
# around the step, into one of DISK_RING page-locked buffers (footprint.py), which the H2D beside
# the backward prefetch reads and the write-back after the step fills; a disk thread reads them in
# before B(s+1), in the order backward needs them, and writes them back once the write-back has
# landed, so the host holds neither the gradient (as any step in backward) nor the states: only the
# weights (the master, for bf16 masters). Of the 4 bytes a parameter a streamed stage in backward
# keeps on the host with 8-bit states and bf16 masters, that takes 2 to the disk. It is the only
# state kind whose disk bytes leave host memory altogether: a disk-stepped or host-stepped stage keeps a
# gradient buffer for its job, as large as the states a bf16 master's 8-bit step moves to the disk.
# The disk's time is counted as a worker of its own (`backlog`): every such stage's read and write
# is released as backward starts, and by the end of B(s+2) the disk must have done the reads and
# writes of stages s and up (a write happens after its step, a read of a later stage before it: the
# total, which is what binds, is the disk's). Reads the ring lets run during the forward are not
# counted (at most DISK_RING of them). A state read and written back moves at the rate of reads and
# writes at once (`disk_io_s`, NOTE: [Disk reads and writes at once] in hardware/__init__.py): counted
# in series at the profile's read and write rates, the 72B shape at 8 x 1024 on the H200 box (32
# such blocks, 57 GB read and written a step) measured 57.82 s against 62.76 predicted, and the
# fp32-masters-on-disk 7B 25.4 s against 29.04 (bench/README.md); that 7B plan priced at 2.16 GB/s
# together is 26.47 s.
# NOTE: [Disk-stepped stages]
# The disk tier for streamed stages whose optimizer steps on the GPU (`dstep`, a placement whose
# step is `Step.job()`): their optimizer states (8-bit or 32-bit, as a GPU step keeps them) live
# in the offload file. A GPU step at the next prefetch (`gstep`) cannot use the disk: the
# prefetch windows of a forward are short (a 32B layer's at 32 x 1024 tokens, 0.06 s), and
# reading a layer's states takes far longer (1 GB at 2 GB/s), so every state would sit in host
# memory from a read long before its window to a write long after it. Instead such a stage's step
# is a job on the host worker. It may start once its gradient has landed (after backward with exact
# clipping) and must end before its next prefetch, which waits for it; unlike a host step it may
# run on into the next forward whatever the clipping, as it is I/O and holds no CPU the launching
# thread needs (NOTE: [Host step deadlines] in runtime/stepping.py). The job reads the states into
# the staging buffer (page-locked), sends master, states and gradient to one GPU slot
# (`disk_step_slot`, held for the whole step), one tensor at a time, steps it there on the
# optimizer stream, brings the new weights (and a separate master) back to the host copies
# the prefetches read and the states to the staging buffer, and writes them to disk. All of it in
# series (the next job's read may overlap it: NOTE: [Disk reads ahead] in runtime/disk_states.py, not
# counted), so its seconds (`disk_gpu_job_s`, mostly the disk's) enter the host backlog; the step
# itself runs beside compute, which loses `Hardware.step_lost` of it. The job's own PCIe copies (a 32B
# layer's 3 GB in and 2 GB out take 0.1 s against its disk's 1 s) are not in the windows' link
# rows. The host keeps the master, the compute copy (none with fp32 masters: NOTE: [Weights from the
# master] in footprint.py) and the gradient buffer; the disk the states.
# Measured on the 1-GPU H200 box's disk (a virtio block device, bench/disk_engines.py, 2026-12-01:
# 4.3 GB a pass of 256 MiB regions, direct, page-locked), 16 threads of 8 MiB chunks wrote 2.94 GB/s
# and read 1.96, and the two at once moved 2.30 GB/s together: each byte of state read and written
# back a step costs about 0.85 s per GB, so a step of P seconds hides about P / 0.85 GB of it.
# NOTE: [Disk-resident states]
# The third tier, for host-stepped streamed stages (`Stages.disk`, `lazytrain compile --disk`): such a
# stage's fp32 AdamW moments (8 bytes a parameter, `disk_state_bytes`) may live in the offload file
# (runtime/disk.py) instead of host memory. Its host step reads them into one page-aligned staging
# buffer, steps, and writes them back before the next host step starts (runtime/disk_states.py), so
# host memory holds the largest such stage's moments once (`disk_staging`) and the disk holds the
# rest, within the profile's `disk_bytes`. The reads and writes run in series with the step, on the
# host worker: the job's seconds grow by the moments' round trip (`disk_io_s`), and so enter the
# host backlog and its windows like the step itself. (On the H200 box's disk, 2.16 GB/s for reads
# and writes at once, a 7B layer's 1.87 GB of moments take 1.7 s to read and write back against
# its step's 0.05 s: the solver keeps them on disk only where host memory binds. A
# 1.5B plan with 5 such blocks measured within 6 % of its step with the box's own disk rates.)
# Sharded data parallel keeps them in host memory (each rank's share is already 1/N).
