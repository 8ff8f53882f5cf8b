"""Data parallel over a `torch.distributed` process group: gradients averaged over the ranks.

NOTE: [Data parallel]
A schedule compiled with `--world-size N` runs on N ranks, each replaying the same plan on its own
batch (`example_batch()` is one rank's batch; the plan, its memory and its predicted step are a
rank's). Each stage's gradients are averaged over the ranks (summed, then divided by N) before
anything reads them, and every rank ends each step with the same weights: one process's on the
concatenated global batch.
The loss is a mean over learnt targets, and the ranks' batches may hold very different numbers of
them (chat data: labels -100 on most tokens, unevenly per row), so the mean of the ranks' means
(DDP's) is not the global batch's mean. A loss stage that returns its sum and its count of targets
(`Stage.loss_sum`: a mean cross-entropy, chunked or not; NOTE: [Chunked loss] in chunked.py)
all-reduces the counts once per step, before any gradient is reduced, and makes its loss the sum
times N / (the ranks' count): every rank's gradient is then weighted by its share of the targets,
their average is the global mean's gradient, clipping sees its norm, and the mean of the ranks'
losses, which `step` and `forward_backward` return, is the global mean. A rank without a learnt
target adds a zero sum and zero gradients. Another loss (not a cross-entropy, or weighted) is
averaged as DDP does: exact with the same number of targets on every rank.
The collectives of a rank come in the schedule's event order, the same on every rank, so they pair
up without extra synchronisation; none is issued from the host optimizer's thread.

Two modes, fixed at compile time (`SHARDED`):
  - sharded (the default for N > 1, 32-bit or 8-bit states): ZeRO-2, NOTE: [Sharded state] in
    sharding.py. The schedule's REDUCE events reduce-scatter each stage's gradients on a COMM
    stream while the next stage's backward runs, each rank steps its 1/N of the state, and GATHER
    events all-gather the new weights; the plan counts their memory and their time on the link.
    By default each rank's host also keeps only its piece of the streamed weights, gathered at
    every prefetch (`SHARDED_WEIGHTS`, NOTE: [Sharded host weights] in host_weights.py).
  - replicated (`--replicate-state`): the schedule has no REDUCE events; each
    stage's gradients are all-reduced in place in `_grads_done` (replay.py) as its backward ends, on
    the compute stream (the plan counts their time there: NOTE: [Replicated all-reduce] in
    solver/step_model.py), tensor by tensor in the compute
    dtype (bf16 compute: bf16 sums, as DDP over bf16 parameters), so the runtime allocates nothing
    the plan does not count. Shared (tied) parameters collect gradients from several stages, so
    they are reduced with stage 0's, whose backward is the last. Every rank steps the whole state.
`forward_backward` (no step) all-reduces in both modes, leaving the full averaged gradients in `.grad`.
The backend's own buffers (NCCL's among them) are outside the plan.

Failures: every collective runs under the process group's timeout, which the user sets with
`torch.distributed.init_process_group(..., timeout=datetime.timedelta(...))` (or `new_group`'s
`timeout`). A rank that exits or stalls makes the others' next collective fail (gloo: at once for
a closed connection, else after the timeout); the failure is raised as `DistributedError`, naming
what was being reduced. With NCCL, the backend's watchdog may also tear the process down after
the timeout (`TORCH_NCCL_ASYNC_ERROR_HANDLING`), which likewise ends the run instead of hanging.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist

from lazytrain.errors import DistributedError, ScheduleMismatch


# torch 2.13 names the flat-buffer collectives `*_single` (the older names warn)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _who(stage: int) -> str:
    return "the shared parameters" if stage < 0 else f"stage {stage}"


def _timeout(group) -> str:
    """The group's collective timeout, in words, where torch says it."""
    try:
        backend = group._get_backend(torch.device("cpu") if dist.get_backend(group) == "gloo" else torch.device("cuda"))
        return f"{backend.options._timeout.total_seconds():g} s"
    except Exception:  # private API: the message does without it
        return "its timeout"


class DataParallel:
    """Collectives of one trainer over `group`. `for_schedule` checks the schedule against the
    process and returns None where there is nothing to reduce (one process)."""

    def __init__(self, group, device: torch.device):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = device
        self.timeout = _timeout(group)

    @classmethod
    def for_schedule(cls, module, process_group, device: torch.device) -> DataParallel | None:
        """Refuse a schedule compiled for another number of ranks than the group has."""
        compiled = getattr(module, "WORLD_SIZE", 1)
        where = f"schedule {module.SOURCE or '<in memory>'}"
        initialised = dist.is_available() and dist.is_initialized()
        if not initialised:
            if process_group is not None:
                raise ScheduleMismatch(f"{where} was bound with a process_group, but torch.distributed is not initialised; "
                                       "call torch.distributed.init_process_group first")
            if compiled > 1:
                raise ScheduleMismatch(
                    f"{where} was compiled for {compiled} data-parallel ranks (--world-size {compiled}), but this process "
                    f"is not part of a process group (torch.distributed is not initialised): launch it on {compiled} ranks "
                    f"(`torchrun --nproc-per-node {compiled} train.py`, which calls torch.distributed.init_process_group()), "
                    "or recompile it with --world-size 1 to train in one process")
            return None
        group = process_group if process_group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        if world != compiled:
            raise ScheduleMismatch(
                f"{where} was compiled for {compiled} data-parallel rank{'s' if compiled > 1 else ''} (--world-size "
                f"{compiled}) and is bound in a process group of {world} ranks; recompile it with `lazytrain compile "
                f"{module.SOURCE or 'model.py'} --world-size {world}`")
        if dist.get_backend(group) == "nccl" and device.type != "cuda":
            raise ScheduleMismatch(f"{where} is bound on {device.type} in an NCCL process group, which reduces GPU "
                                   "tensors only; bind it on a GPU, or use a gloo group")
        if world == 1:
            return None
        return cls(group, device)

    @contextlib.contextmanager
    def _collective(self, what: str):
        try:
            yield
        except RuntimeError as exc:  # gloo and NCCL raise RuntimeError (DistBackendError) subclasses
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DistributedError(
                f"data parallel: {what} failed on rank {self.rank} of {self.world} ({type(exc).__name__}: {cause}). "
                f"Another rank exited, failed, or did not reach the same point within the process group's timeout "
                f"({self.timeout}); look at the other ranks' output first. The timeout is set with "
                f"torch.distributed.init_process_group(timeout=datetime.timedelta(...)). This trainer cannot go on: "
                f"restart every rank (from the last checkpoint)") from exc

    def reduce_grads(self, stage: int, grads: list[torch.Tensor]) -> None:
        """Average `grads` (one stage's, or the shared parameters' with stage 0) over the ranks, in
        place. All launched at once, so gloo and NCCL can pipeline them."""
        if not grads:
            return
        what = f"the gradient all-reduce of stage {stage}" + (" and the shared parameters" if stage == 0 else "")
        with self._collective(what):
            works = [dist.all_reduce(g, group=self.group, async_op=True) for g in grads]
            for w in works:
                w.wait()
        torch._foreach_mul_(grads, 1.0 / self.world)

    def reduce_scatter(self, stage: int, layout, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's pieces of the ranks' average of the full `grads` (NOTE: [Sharded state] in
        sharding.py), in their dtype, on their device. Nothing for a stage without parameters."""
        if not grads:
            return {}
        some = next(iter(grads.values()))
        flat = layout.pack(grads, torch.empty(self.world * layout.region, dtype=some.dtype, device=some.device))
        mine = torch.empty(layout.region, dtype=some.dtype, device=some.device)
        with self._collective(f"the gradient reduce-scatter of {_who(stage)}"):
            _reduce_scatter(mine, flat, group=self.group)
        mine.mul_(1.0 / self.world)
        return {p: layout.region_of(mine, p) for p in grads}

    def all_gather(self, stage: int, layout, pieces: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
        """Every rank's `pieces` (this rank's part of each parameter) into the full `targets`."""
        if not targets:
            return
        some = next(iter(targets.values()))
        mine = torch.zeros(layout.region, dtype=some.dtype, device=some.device)
        for p, t in pieces.items():
            layout.region_of(mine, p).copy_(t)
        flat = torch.empty(self.world * layout.region, dtype=some.dtype, device=some.device)
        with self._collective(f"the weight all-gather of {_who(stage)}"):
            _all_gather(flat, mine, group=self.group)
        layout.unpack(flat, targets)

    def total(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over the ranks (the squared gradient norm of every rank's shards)."""
        out = value.detach().to(self.device, torch.float32).clone()
        with self._collective("the gradient norm all-reduce"):
            dist.all_reduce(out, group=self.group)
        return out

    def loss_scale(self, count: torch.Tensor) -> torch.Tensor:
        """world / the ranks' total of learnt targets (`count`: this rank's), fp32: the factor of this
        rank's loss sum and its gradients (NOTE: [Data parallel])."""
        total = count.detach().to(self.device, torch.int64).clone()  # exact, however many tokens
        with self._collective("the learnt-token count all-reduce"):
            dist.all_reduce(total, group=self.group)
        return total.to(torch.float32).reciprocal().mul_(self.world)

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of the ranks' losses: the global batch's loss (NOTE: [Data parallel])."""
        out = loss.detach().clone()
        with self._collective("the loss all-reduce"):
            dist.all_reduce(out, group=self.group)
        return out.div_(self.world)

    def check_agree(self, checksum: str, params: dict[str, torch.Tensor]) -> None:
        """At bind, on every rank: the same schedule and the same starting weights (a few values of
        each parameter), so ranks that would drift apart or pair the wrong collectives are refused.
        Also a barrier: no rank starts its step before every rank has bound. A parameter given as None
        (a rank's piece alone: NOTE: [Sharded host weights] in host_weights.py) is not compared, but
        keeps its place, so that ranks of different schedules reduce samples of one length."""
        digest = int(hashlib.sha256(checksum.encode()).hexdigest()[:12], 16)  # 48 bits: exact in float64
        names = sorted(params)
        samples = [torch.tensor([float(digest)], dtype=torch.float64, device=self.device)]
        for p in names:
            if params[p] is None:
                samples.append(torch.full((3,), float("nan"), dtype=torch.float64, device=self.device))
                continue
            flat = params[p].detach().reshape(-1)
            idx = torch.tensor([0, flat.numel() // 2, flat.numel() - 1], device=flat.device)
            samples.append(flat[idx].to(self.device, torch.float64))
        mine = torch.cat(samples)
        low, high = mine.clone(), mine.clone()
        with self._collective("the check that every rank bound the same schedule and weights"):
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
        differ = (low != high) & ~(mine.isnan())
        if differ[0]:
            raise ScheduleMismatch(
                f"the ranks bound different schedules (this is rank {self.rank}, with schedule checksum {checksum}); "
                "every rank must load the same schedule file")
        if differ.any():
            first = names[(int(differ[1:].nonzero()[0]) // 3)]
            raise DistributedError(
                f"the ranks start from different weights ({first} differs, on rank {self.rank} of {self.world}); "
                "every rank must start from the same weights: seed identically (torch.manual_seed) before building "
                "the model, or load the same checkpoint on every rank")
