"""Bytes and seconds per stage that the step model (pass `solve`) and pass `lower` share: what a
stage holds on the GPU and the host, and what its optimizer step costs, for each decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain.hardware import Hardware
from lazytrain.ir.placement import Placement, Tier
from lazytrain.ir.stages import STATE_BYTES, Stage, Stages
from lazytrain.sizes import ACT_RING_SIZE, STATE_RING_SIZE, TWIN_CHUNK, aligned, region_bytes

LOSS_BYTES = 4


CPU_STATE_BYTES = STATE_BYTES["32bit"]  # a host-stepped stage's AdamW states (NOTE: [State precision per stage] in formulation.py)
# A host step of a bf16 master reuses an fp32 twin, an fp32 gradient and int32 rounding noise of
# the largest tensor it meets (NOTE: [Host step buffers] in runtime/optim.py)
HOST_STEP_BYTES = 12
MASTER_BYTES = 4  # fp32 master weights, per parameter (`--master-weights bf16`: 2, NOTE: [Master weights])

# NOTE: [Master weights]
# `master` below is the bytes per parameter of the master weights the optimizer updates: 4 (fp32),
# or 2 (bf16 with stochastic rounding). A bf16 master *is* the bf16 compute copy: no second copy on
# the host, and nothing extra beside resident weights; its step runs through fp32 twins one tensor
# at a time (`resident_step_bytes`, NOTE: [Resident steps]).


def resident_bytes(param_bytes: int, numel: int, state_bytes: float, master: int = MASTER_BYTES) -> int:
    """A resident parameter set on the GPU for the whole step: weights and AdamW states; in mixed
    precision also the fp32 master copy (NOTE: [Parameter homes] in runtime/store.py). Its
    gradients come at its backward (`resident_grad_bytes`)."""
    mixed = master * numel if param_bytes != master * numel else 0
    return param_bytes + int(state_bytes * numel) + mixed


def resident_grad_bytes(param_bytes: int, numel: int, master: int = MASTER_BYTES) -> int:
    """A resident parameter set's gradients, from its backward to the next step's start (NOTE:
    [Resident steps]): in the compute dtype, or in mixed precision the fp32 ones its step makes of them."""
    return master * numel if param_bytes != master * numel else param_bytes


# NOTE: [Resident gradients freed at their step]
# Where a resident stage's step runs beside backward (clipping off or by the previous norm: NOTE:
# [Device steps beside compute] in hardware/__init__.py), its gradients need not wait for the next
# step (`Step.frees_grads`, a decision): its step must then be done by the end of B(s-2), and the
# gradients go there (`lower` frees them after that backward; the runtime drops them, their memory
# reused once the optimizer stream is done with them). A resident parameter then holds its gradient
# for three windows instead of from its backward to the tail: of the 12 bytes a parameter of fp32
# masters and 8-bit states holds, 4 are gone for most of backward and all of the tail. (On the 32B
# shape with fp32 masters at 32 x 1024, the smallest feasible budget fell from 206.5 to 162.1 GiB.)
# A decision, not a rule: where steps are slow against the windows (the deadline binds), keeping
# the gradients is the only plan. Not the first two stages, whose B(s-2) does not exist; not with
# exact clipping, whose steps wait for the global norm; not with sharded state, whose shards stay.
def can_free_grads(stages: Stages, hw: Hardware, s: int, n: int) -> bool:
    """Whether resident stage `s` may free its gradients after B(s-2) (NOTE: [Resident gradients
    freed at their step]); `n`: the ranks sharing state."""
    return n == 1 and s >= 2 and stages.clipping != "exact" and hw.gpu_step_pace > 0


# NOTE: [Resident weights cast on use]
# A resident stage with fp32 masters and 16-bit compute holds its weights twice: the master (the
# parameter's home, NOTE: [Parameter homes] in runtime/store.py) and the compute copy its step
# refreshes. With `cast` (a decision) it keeps no copy between uses: a weight slot is filled from the
# master by a cast on the compute stream before its forward and again before its backward, and
# freed after each, as a streamed stage's slot is after its prefetch. It costs two casts a step
# (`cast_s`: reading the master, writing the copy; a 32B block's 0.49 G parameters take about 1 ms
# at the H200's 2.8 TB/s, against its 0.05 s forward at 32 x 1024 tokens; the plan reports them as
# recompute: the copy is recomputed from the master) and saves the copy in every
# other window: 2 of the 8 bytes a resident parameter of fp32 masters and 8-bit states holds. It must
# recompute (internals autograd saved would keep the slot alive: as for a streamed stage) and cannot
# drop its outputs (their recompute at a later backward would find no weights). Not a chunked stage,
# whose forward runs inside its backward, nor with sharded state, whose weights are gathered.
def can_cast(stages: Stages, s: int, n: int) -> bool:
    """Whether resident stage `s` may cast its weights from the master on use (NOTE: [Resident
    weights cast on use]); `n`: the ranks sharing state."""
    g = stages[s]
    return n == 1 and g.chunks == 1 and 0 < g.param_bytes != stages.master_bytes * g.param_numel


def cast_s(g, hw: Hardware, master: int = MASTER_BYTES) -> float:
    """One cast of stage `g`'s weights from its master: reading the master, writing the copy."""
    return (master * g.param_numel + g.param_bytes) / hw.mem_bandwidth


def resident_step_bytes(param_bytes: int, numel: int, master: int = MASTER_BYTES, largest_numel: int = 0) -> int:
    """What a resident parameter set's GPU step holds beyond its gradients while it runs (NOTE:
    [Resident steps]): in mixed precision the compute-dtype gradients beside the master-dtype ones
    they become; for a bf16 master also the fp32 twin, fp32 gradient and rounding noise of its largest
    tensor, or of `TWIN_CHUNK` elements of it (`TWIN_BYTES`, NOTE: [Twin chunks] in sizes.py);
    for fp32 alone nothing (the fused step)."""
    ws = param_bytes if param_bytes != master * numel else 0
    return ws + (TWIN_BYTES * min(largest_numel, TWIN_CHUNK) if master != MASTER_BYTES else 0)


def cpu_step_s(param_bytes: int, numel: int, hw: Hardware, master: int = MASTER_BYTES) -> float:
    """A host optimizer step: AdamW itself, plus turning the compute-dtype gradient into the fp32
    one it reads and the updated master into the compute-dtype copy the next prefetch sends
    (measured on the H200 machine: these copies cost more than the fused step); a bf16 master
    goes to fp32 and back instead, and is rounded stochastically."""
    if param_bytes == MASTER_BYTES * numel:
        casts = param_bytes
    else:
        casts = 2 * (param_bytes + MASTER_BYTES * numel) + (2 * (master + MASTER_BYTES) * numel if master != MASTER_BYTES else 0)
    rounding = numel / hw.cpu_round_params_per_s if master != MASTER_BYTES else 0.0
    alone = numel / hw.cpu_adamw_params_per_s + casts / hw.host_memcpy_bandwidth + rounding
    return alone / hw.host_fraction  # NOTE: [Host steps in a running step] in hardware/__init__.py


def gpu_step_s(numel: int, tensors: int, hw: Hardware, master: int = MASTER_BYTES,
               state_bytes: float = STATE_BYTES["32bit"]) -> float:
    """A device optimizer step of `numel` parameters in `tensors` tensors: AdamW at the profile's rate
    for states of `state_bytes` a parameter (8-bit or 32-bit), and for a bf16 master its twins and
    rounding (NOTE: [Device steps of bf16 masters] in hardware/__init__.py)."""
    rate = hw.gpu_adamw8bit_params_per_s if state_bytes == STATE_BYTES["8bit"] else hw.gpu_adamw_params_per_s
    seconds = numel / rate
    if master != MASTER_BYTES:
        seconds += (numel / hw.gpu_round_params_per_s if hw.gpu_round_params_per_s else 0.0) + tensors * hw.gpu_round_tensor_s
    return seconds


def deferred_step_s(stages: Stages, device_s: float, tensors: int, hw: Hardware) -> float:
    """A resident (or shared) device step of `tensors` tensors taking `device_s` on the device:
    exactly clipped, it waits for the global norm and runs after backward as the host issues it, so
    it takes the longer of the two (NOTE: [Steps the host issues after backward] in
    hardware/__init__.py); otherwise the device's time."""
    if stages.clipping != "exact":
        return device_s
    return max(device_s, tensors * hw.gpu_step_issue_tensor_s)


DISK_RING = STATE_RING_SIZE  # the runtime's ring (NOTE: [Backward steps from disk] in disk_model.py)
ACT_RING = ACT_RING_SIZE  # the runtime's ring of outputs on disk (NOTE: [Activations on disk] in disk_model.py)


def can_put_outputs_on_disk(stages: Stages, s: int) -> bool:
    """Whether stage `s`'s outputs may go to disk: their read back is due by the window before their
    reload at B(cmax+1), which must be a window of backward, so their last reader is stage S-3 or
    earlier (NOTE: [Activations on disk] in disk_model.py)."""
    g = stages[s]
    return bool(g.consumers) and g.consumers[-1] <= len(stages) - 3


def disk_act_bytes(g: Stage) -> int:
    """Stage `g`'s outputs in the offload file and in a ring buffer, as the runtime carves them
    (NOTE: [Activations on disk] in disk_model.py)."""
    return region_bytes(g.out_bytes, len(g.outputs))


def disk_available(hw: Hardware) -> bool:
    """Whether the profile measured a disk the tier can plan with: space, and both rates."""
    return hw.disk_bytes > 0 and hw.disk_read_bandwidth > 0 and hw.disk_write_bandwidth > 0


def disk_state_bytes(numel: int) -> int:
    """A host-stepped stage's AdamW moments, which the disk tier may hold (NOTE: [Disk-resident
    states] in disk_model.py): fp32, as a host step keeps them."""
    return int(CPU_STATE_BYTES * numel)


def disk_io_s(nbytes: int, hw: Hardware) -> float:
    """Reading `nbytes` from the disk and writing them back: at the rate of both at once where the
    profile measured it (NOTE: [Disk reads and writes at once] in hardware/__init__.py), else one
    after the other."""
    if not nbytes:
        return 0.0
    if hw.disk_duplex_bandwidth > 0:
        return 2 * nbytes / hw.disk_duplex_bandwidth
    return nbytes / hw.disk_read_bandwidth + nbytes / hw.disk_write_bandwidth


def disk_step_s(numel: int, hw: Hardware) -> float:
    """Reading a disk-resident stage's moments before its host step and writing them back after."""
    return disk_io_s(disk_state_bytes(numel), hw)


def disk_gpu_state_bytes(numel: int, state_bytes: float) -> int:
    """A disk-stepped stage's optimizer states, which live in the offload file between its steps
    (NOTE: [Disk-stepped stages] in disk_model.py): in the precision a GPU step keeps them."""
    return int(state_bytes * numel)


def disk_master_bytes(g: Stage) -> int:
    """Stage `g`'s fp32 master, which the offload file may hold beside the states of its step in
    backward (NOTE: [Masters on disk] in disk_model.py)."""
    return MASTER_BYTES * g.param_numel


def disk_gpu_job_s(param_bytes: int, numel: int, tensors: int, hw: Hardware, state_bytes: float,
                   master: int = MASTER_BYTES) -> float:
    """One disk-stepped stage's job on the host worker, in series: its states read from disk, its
    master, states and gradient to the GPU, the step, new weights, master and states back, and the
    states written to disk (NOTE: [Disk-stepped stages] in disk_model.py)."""
    fetch = gpu_step_state_bytes(numel, state_bytes, master) + param_bytes
    out = gpu_step_out_bytes(param_bytes, numel, state_bytes, master)
    return (disk_io_s(disk_gpu_state_bytes(numel, state_bytes), hw) + fetch / hw.h2d_bandwidth
            + gpu_step_s(numel, tensors, hw, master, state_bytes) + out / hw.d2h_bandwidth)


def host_bytes_streamed(param_bytes: int, numel: int, state_bytes: float, master: int = MASTER_BYTES) -> int:
    """Host memory a streamed stage adds beyond its master: AdamW states, the page-locked gradient
    buffer and the gradient in the master's dtype (only a host step needs it: a step on the device
    subtracts it), and in mixed precision the compute-dtype copy to prefetch."""
    mixed = param_bytes if param_bytes != master * numel else 0
    return int(state_bytes * numel) + param_bytes + master * numel + mixed


# NOTE: [Weights from the master]
# A GPU-stepped streamed stage with fp32 masters and 16-bit compute (one process, or replicated data
# parallel) keeps no compute-dtype copy of its weights on the host: its prefetches read the fp32
# master into a staging region at the end of its weight slot, one tensor at a time, and cast it into
# the weights there, on the H2D stream. (Its forward prefetch after a step needs neither: the step
# writes the weights.) Its step's write-back sends the master in place of the new weights. Per
# parameter that takes the copy's 2 bytes off the host and 2 off D2H, and puts 2 on each plain
# prefetch's H2D; the slot grows by the largest tensor in fp32. For the 32B with fp32 masters it
# is 2 of the 10 bytes a parameter such a stage holds on the host (bench/README.md, Disk tier).
def weights_from_master(stages: Stages, s: int) -> bool:
    """Whether stage `s`, when streamed and GPU-stepped, prefetches from its fp32 master."""
    g = stages[s]
    mixed = stages.master_bytes == MASTER_BYTES and g.param_bytes != MASTER_BYTES * g.param_numel
    sharded = stages.sharded and stages.world_size > 1  # (shards.sharding, which imports this module)
    return mixed and g.param_numel > 0 and not sharded


def prefetches_from_master(stages: Stages, s: int, p: Placement) -> bool:
    """Whether stage `s`, under its placement `p`, prefetches from its fp32 master: a streamed stage
    stepped on the device, but not where the master lives on disk, which leaves the host the
    compute-dtype copy (NOTE: [Masters on disk] in disk_model.py)."""
    return p.kind in ("prefetch", "job", "backward") and weights_from_master(stages, s) and p.step.master is not Tier.DISK


def master_staging_bytes(g) -> int:
    """The staging region a stage that prefetches from its master adds to its weight slot: its
    largest tensor in fp32, with the slot's alignment (NOTE: [Weights from the master])."""
    return aligned(MASTER_BYTES * (g.largest_numel or g.param_numel))


def gpu_step_state_bytes(numel: int, state_bytes: float, master: int = MASTER_BYTES) -> int:
    """What a GPU-stepped streamed stage moves each way beyond its weights or gradient: the master
    and the optimizer states."""
    return master * numel + int(state_bytes * numel)


def gpu_step_out_bytes(param_bytes: int, numel: int, state_bytes: float, master: int = MASTER_BYTES) -> int:
    """What goes back to the host after a GPU step: new weights, master and states (a master in the
    compute dtype goes back once, as the weights)."""
    out = gpu_step_state_bytes(numel, state_bytes, master) + param_bytes
    return out - param_bytes if param_bytes == master * numel else out


# A bf16 master stepped on the GPU is rounded back with int32 noise of its size (NOTE: [bf16 master
# weights] in runtime/optim.py): one tensor at a time, so the largest tensor's, beside its fp32 twin
# and gradient. Uncounted, it was a fresh 2.9 GiB allocation (the 14B embedding) that ran a 40 GiB
# plan out of memory on the H200.
NOISE_BYTES = 4
# NOTE: [Resident steps]
# A resident stage's gradients appear at its backward and stay until the next step starts (its
# step reads them there, or, with gradient clipping, after backward ends). Its step itself holds:
#   - bf16 masters: per tensor, an fp32 twin, its fp32 gradient and int32 rounding noise, 12 bytes
#     per parameter of the largest tensor (measured on the H200: 12 for Qwen2.5-14B's 778 M-parameter
#     lm_head), or of `TWIN_CHUNK` (16.8 M) elements of a larger one, which steps in pieces (NOTE:
#     [Twin chunks] in sizes.py). Each tensor's twin dies before the next one's is made:
#     held one tensor longer, the 7B's equal 67.9 M-parameter MLP weights stepped at 16 (1.01 GiB
#     over the gradients);
#   - fp32 masters of bf16 weights: each fp32 gradient made beside the bf16 one it replaces.
# Counting the twins and the gradients from the step's start put every window of a 7B plan at
# 24 GiB 2.4 GiB over the measured one (the fidelity trace, 2026-11-30).
TWIN_BYTES = 2 * MASTER_BYTES + NOISE_BYTES


def gpu_step_bytes(param_bytes: int, numel: int, state_bytes: float, master: int = MASTER_BYTES,
                   largest_numel: int = 0) -> int:
    """The `opt:S` GPU buffer of a GPU-stepped streamed stage: master and states, the gradient as
    it arrives, the fp32 gradient the optimizer reads, and for a bf16 master its fp32 twin and the
    rounding noise of its largest tensor."""
    twin = MASTER_BYTES * numel + NOISE_BYTES * largest_numel if master != MASTER_BYTES else 0
    return gpu_step_state_bytes(numel, state_bytes, master) + param_bytes + MASTER_BYTES * numel + twin


# NOTE: [Backward step twins] A step in backward (NOTE: [Backward steps] in step_model.py) reads the
# gradient where its backward left it, and steps one tensor at a time through fp32 twins of that
# tensor alone (its master's, for a bf16 master, and its gradient's), reused tensor after tensor on
# the optimizer stream; a bf16 master's tensor larger than `TWIN_CHUNK` steps in pieces of it
# (NOTE: [Twin chunks] in sizes.py). A master in the compute dtype is the weights the stage's
# backward prefetch brought into its weight slot, and the step rounds into them there. So the
# `opt:S` buffer holds an fp32 master, the states, and twins of `TWIN_CHUNK` elements at most (of
# the largest tensor, for an fp32 master's gradient). Its buffer lives four windows, B(s+1) to B(s-2), so consecutive such stages hold up to
# four at once: with twins of the whole stage (a 72B layer's 0.88 G parameters, 12 bytes each) that
# was 7 GB a buffer more, and the 72B's least budget on the H200 box 159 GiB at 4 x 1024.
def backward_step_bytes(param_bytes: int, numel: int, state_bytes: float, master: int = MASTER_BYTES,
                        largest_numel: int = 0) -> int:
    """The `opt:S` GPU buffer of a stage stepped in backward: the master (none where it is the
    weights, which the weight slot holds), the states, and the fp32 twins and rounding noise a
    tensor steps through."""
    largest = largest_numel or numel
    twins = TWIN_BYTES * min(largest, TWIN_CHUNK) if master != MASTER_BYTES else MASTER_BYTES * largest
    weights = param_bytes if param_bytes == master * numel else 0
    return gpu_step_state_bytes(numel, state_bytes, master) - weights + twins


# NOTE: [Flushed updates] A GPU-stepped streamed stage's update waits for its next prefetch; anything
# that needs the weights before then (`sync_model`, a checkpoint, `model.state_dict()`) applies it at
# once, between steps, while the resident weights, states and gradients are held: a weight slot and
# an `opt:S` buffer beside the tail. Uncounted, calling `sync_model()` after a step of a 14B plan at
# 40 GiB asked for 3.86 GiB with 3 GiB free and ran out of memory on the H200 (2026-12-01).
def flush_bytes(stages: Stages, s: int) -> int:
    """What applying stage `s`'s pending GPU update between steps holds on the device."""
    g = stages[s]
    return g.param_bytes + gpu_step_bytes(g.param_bytes, g.param_numel, stages.state_bytes, stages.master_bytes,
                                          g.largest_numel)


def disk_step_slot(stages: Stages, s: int) -> int:
    """What stage `s`'s disk job holds on the GPU: it steps one tensor at a time, so the optimizer
    slot and new weights of its largest tensor (NOTE: [Disk-stepped stages] in disk_model.py)."""
    g = stages[s]
    numel = g.largest_numel or g.param_numel
    nbytes = -(-g.param_bytes * numel // max(1, g.param_numel))
    return nbytes + gpu_step_bytes(nbytes, numel, stages.state_bytes, stages.master_bytes, numel)


def disk_step_slot_bytes(stages: Stages, decisions) -> int:
    """The GPU buffer disk-stepped stages' jobs take turns in, held for the whole step: the largest
    `disk_step_slot` among them."""
    return max((disk_step_slot(stages, s) for s, p in enumerate(decisions) if p.kind == "job"), default=0)


@dataclass(frozen=True)
class Layout:
    """Window positions and the constant per-stage facts the model and `lower` share."""

    S: int

    def fw(self, s: int) -> int:
        return s

    def bw(self, s: int) -> int:
        return 2 * self.S - 1 - s

    def labels(self) -> list[str]:
        return [f"F{s}" for s in range(self.S)] + [f"B{s}" for s in reversed(range(self.S))]

    def weight_windows(self, s: int) -> set[int]:
        """Windows a streamed stage's weight buffer is live in."""
        w = {self.fw(s), self.bw(s)}
        if s > 0:
            w.add(self.fw(s - 1))
        if s < self.S - 1:
            w.add(self.bw(s + 1))
        else:
            w |= set(range(self.fw(s), self.bw(s) + 1))
        return w


def fixed_bytes(stages: Stages) -> int:
    """Resident for the whole step: the batch, buffers, the loss, and shared (tied) parameters."""
    return stages.fixed_bytes + LOSS_BYTES + resident_bytes(
        stages.shared_bytes, stages.shared_numel, stages.state_bytes, stages.master_bytes)


def shared_grad_bytes(stages: Stages) -> int:
    return resident_grad_bytes(stages.shared_bytes, stages.shared_numel, stages.master_bytes) if stages.shared_numel else 0


def shared_step_bytes(stages: Stages) -> int:
    if not stages.shared_numel:
        return 0
    return resident_step_bytes(stages.shared_bytes, stages.shared_numel, stages.master_bytes, stages.largest_shared_numel)


def step_bytes(stages: Stages, s: int) -> int:
    """`resident_step_bytes` of stage `s`."""
    g = stages[s]
    return resident_step_bytes(g.param_bytes, g.param_numel, stages.master_bytes, g.largest_numel)


def deferred_step_bytes(stages: Stages, resident) -> int:
    """The most any resident step (or the shared weights' step) holds: with gradient clipping they
    all run after backward, one after another (NOTE: [Resident steps])."""
    return max([shared_step_bytes(stages)] + [step_bytes(stages, s) for s, r in enumerate(resident) if r])
