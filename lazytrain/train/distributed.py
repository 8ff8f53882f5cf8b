"""`lazytrain train` on several ranks: the launch, the process group, and ranks that fail together.

NOTE: [Launching]
`torchrun --nproc-per-node N -m lazytrain train ...` starts N ranks, each with RANK, WORLD_SIZE and
LOCAL_RANK in its environment; `lazytrain train --nproc-per-node N ...` starts the same through
torch's own launcher (`torch.distributed.run`, a standalone rendezvous on this host), so both run
one code path. A rank (`from_env`) joins the default process group (NCCL when the run is on a GPU,
gloo on the CPU) with a timeout on every collective (`--dist-timeout`), after setting its GPU from
LOCAL_RANK. For NCCL, NCCL_NVLS_ENABLE=0 is set unless the user set it: NVLink multicast (NVLS)
reserves fabric resources per communicator, and on a shared host a failure to get them has taken
every GPU of the host down; the all-reduces lazytrain issues do not need it.

torch's launcher gives each of several ranks one OpenMP thread unless OMP_NUM_THREADS is set,
which starves host optimizer steps (the 7B at 24 GiB, 32-bit states, on 2 H200 ranks of a 32-core
host: 9.9 s a step with one thread a rank, 3.9 s with 16). `--nproc-per-node` sets it to the
host's cores over the ranks unless the user set it; under torchrun, rank 0 says so when it finds
one thread a rank on a host with more cores.

Rank 0 prints, logs and writes the run directory's files; the others are quiet (their standard
output goes nowhere; errors still reach standard error). Steps that can fail on one rank for a
reason the others cannot see (reading the data, the compile, a checkpoint's files) run inside
`together`: at its end every rank learns whether any failed, and all stop, rank 0 saying why (once,
for the first rank that failed), so no rank goes on into a collective that would never be answered.
A rank that dies outright is caught by the launcher (torchrun stops the others) or, where it is
not, by the next collective, which fails when the connection closes or at the timeout.

When `together` stops every rank, the others must not exit before rank 0 has printed why: the
launcher stops the remaining ranks as soon as one exits with an error, and rank 0, stopped
mid-report, said nothing (a world size that does not divide the batch went unexplained in about 1
run of 4). Rank 0 marks the report in the process group's store once it is printed (`reported`);
the others wait for that mark, at most REPORT_WAIT_S, before they exit (`await_report`).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lazytrain.errors import DistributedError, LazytrainError
from lazytrain.host import host_cores

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
REPORTED = "lazytrain/rank0-reported"
REPORT_WAIT_S = 30.0  # NOTE: [Launching]: a bound, so a rank 0 that died of a bug holds no one up for long
_STORE = None  # the process group's store and this rank, kept past the group's teardown (the CLI reports after it)
_RANK = -1


class PeerFailed(DistributedError):
    """Raised on a rank other than 0 when some rank failed inside `together`: rank 0 says why, so
    this rank stops without repeating it (the CLI prints nothing for it)."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in a run on several ranks (the default process group)."""

    rank: int
    world: int
    local_rank: int
    backend: str

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched() -> bool:
    """Whether a launcher (torchrun) started this process as one of several ranks."""
    return all(k in os.environ for k in ENV) and int(os.environ["WORLD_SIZE"]) > 1


def from_env(nproc_per_node: int | None, device: str, timeout_s: float) -> Ranks | None:
    """Join the process group torchrun's environment describes (NOTE: [Launching]); None for a
    run of one process. `device` ("cuda" or "cpu") is where the run's schedule runs."""
    if not launched():
        return None
    rank, world, local = (int(os.environ[k]) for k in ENV)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if nproc_per_node is not None and nproc_per_node != local_world:
        raise DistributedError(f"--nproc-per-node {nproc_per_node} was given, but the launcher started {local_world} "
                               "ranks on this host; drop --nproc-per-node under torchrun (its own flag sets the ranks)")
    backend = "gloo"
    if device == "cuda":
        if not torch.cuda.is_available() or local >= torch.cuda.device_count():
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise DistributedError(f"rank {rank} has LOCAL_RANK {local} but this host has {have} GPUs; start at "
                                   f"most {have} ranks per host (--nproc-per-node), or compile for the CPU (--hardware cpu)")
        torch.cuda.set_device(local)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NOTE: [Launching]
        backend = "nccl"
    share = thread_share(local_world)
    if rank == 0 and share:  # NOTE: [Launching]
        print(f"lazytrain: warning: each rank uses one CPU thread (torchrun sets OMP_NUM_THREADS=1 for several ranks), "
              f"so optimizer steps on the host run far slower than planned; set OMP_NUM_THREADS={share} "
              f"(this host's cores over its {local_world} ranks) before torchrun, or use lazytrain train "
              "--nproc-per-node, which does", file=sys.stderr)
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # the rendezvous: torch raises several types for one cause
        raise DistributedError(f"rank {rank} of {world} could not join the process group ({type(exc).__name__}: "
                               f"{_first_line(exc)}); check MASTER_ADDR/MASTER_PORT (torchrun sets them) and that "
                               "every rank was started") from None
    global _STORE, _RANK
    if dist.is_initialized():
        _STORE, _RANK = dist.distributed_c10d._get_default_store(), rank
    return Ranks(rank, world, local, backend)


def quiet_others(ranks: Ranks | None) -> None:
    """Ranks other than 0 print nothing (NOTE: [Launching])."""
    if ranks is not None and not ranks.main:
        sys.stdout = open(os.devnull, "w")


def reported() -> None:
    """On rank 0, once its error is printed: the other ranks may exit (NOTE: [Launching])."""
    if _STORE is not None and _RANK == 0:
        with contextlib.suppress(Exception):  # the others are gone: nothing waits for the mark
            _STORE.set(REPORTED, "1")


def await_report() -> None:
    """On a rank that stops because another failed (`PeerFailed`): wait until rank 0 has said why,
    so the launcher does not stop rank 0 mid-report (NOTE: [Launching])."""
    if _STORE is not None:
        with contextlib.suppress(Exception):  # rank 0 exited, or took longer than the bound: stop anyway
            _STORE.wait([REPORTED], datetime.timedelta(seconds=REPORT_WAIT_S))


def relaunch(nproc: int, argv: list[str]) -> None:
    """`lazytrain <argv>` on `nproc` ranks of this host through torch's launcher; returns when all
    ranks exit, raising `DistributedError` if one failed (its own error is in the output above)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, host_cores() // nproc)))  # NOTE: [Launching]
    config = parse_args(["--standalone", f"--nproc-per-node={nproc}", "--module", "lazytrain", *argv])
    try:
        run(config)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise DistributedError(f"rank {rank} of {nproc} exited with code {failure.exitcode}, and the launcher stopped "
                               "the others; its own output is above") from None


def thread_share(local_world: int) -> int:
    """This rank's share of the host's cores where the launcher left it one thread (torchrun's default
    for several ranks) and the host has more to give; else 0 (NOTE: [Launching])."""
    share = host_cores() // local_world
    return share if torch.get_num_threads() == 1 and share > 1 else 0


def teardown(ranks: Ranks | None) -> None:
    if ranks is not None and dist.is_initialized():
        gc.collect()  # NOTE: [Leaving a rank]: what the run left in reference cycles goes while the group is alive
        dist.destroy_process_group()


# NOTE: [Leaving a rank] A rank of a finished run (its process group destroyed, its files written
# whole and synced) exits without the interpreter's finalization: torch's C++ objects that outlive
# the group (gloo's worker threads and the work and tensors they hold) are destroyed there in no
# particular order, and one of them aborted a finished rank now and then ("terminate called
# without an active exception", exit code -6; about 1 in 3 runs of a 2-rank test on the 2-core CI
# machine), which the launcher reports as a failed run. One process (no RANK, or WORLD_SIZE 1)
# exits as usual.
def leave(code: int | None) -> None:
    """Exit with `code`; a rank of several skips the interpreter's finalization (NOTE: [Leaving a rank])."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    sys.exit(code)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def _collective(ranks: Ranks, what: str):
    try:
        yield
    except RuntimeError as exc:  # gloo and NCCL raise RuntimeError (DistBackendError) subclasses
        raise DistributedError(
            f"rank {ranks.rank} of {ranks.world}: waiting for the other ranks after {what} failed "
            f"({type(exc).__name__}: {_first_line(exc)}); another rank exited or did not get there within "
            "--dist-timeout. Look at the other ranks' output first, then restart every rank (with --resume to go "
            "on from the last checkpoint)") from None


@contextlib.contextmanager
def together(ranks: Ranks | None, what: str):
    """Run the block on every rank; if it raised on any, raise on every rank (NOTE: [Launching]):
    on rank 0 the first failing rank's error (its type for lazytrain's errors, its rank in the
    message when not 0), on the others `PeerFailed`. An error that is not lazytrain's (a bug) is
    re-raised as it is on the rank that raised it, with its traceback."""
    if ranks is None:
        yield
        return
    failure = None
    try:
        yield
    except Exception as exc:
        failure = exc
    mine = None if failure is None else (type(failure).__name__, str(failure), isinstance(failure, LazytrainError))
    outcomes: list = [None] * ranks.world
    with _collective(ranks, what):
        dist.all_gather_object(outcomes, mine)
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if not failed:
        return
    first, (name, message, ours) = failed[0]
    if failure is not None and (not isinstance(failure, LazytrainError) or (ranks.main and first == ranks.rank)):
        raise failure
    if not ranks.main:
        raise PeerFailed(f"rank {first} failed in {what}") from None
    if ours:
        cls = _error_class(name)
        raise cls(f"rank {first} of {ranks.world}: {message}") from None
    raise DistributedError(f"rank {first} of {ranks.world} failed in {what} ({name}: {message.splitlines()[0] if message else ''}); "
                           "its traceback is in its output") from None


def _error_class(name: str) -> type[LazytrainError]:
    from lazytrain import errors

    cls = getattr(errors, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, LazytrainError) else DistributedError


def from_rank0(ranks: Ranks | None, fn, what: str):
    """`fn()` run on rank 0 only, its (picklable) result on every rank; a failure stops every rank
    as in `together`."""
    with together(ranks, what):
        value = fn() if ranks is None or ranks.main else None
    if ranks is None:
        return value
    box = [value]
    with _collective(ranks, what):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_rank0(ranks: Ranks, value, what: str) -> list | None:
    """Every rank's `value`, in rank order, on rank 0 (None elsewhere)."""
    out = [None] * ranks.world if ranks.main else None
    with _collective(ranks, what):
        dist.gather_object(value, out, dst=0)
    return out
