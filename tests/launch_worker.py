"""Ranks of `lazytrain train` for test_launch.py, started without torchrun: each spawned process gets
the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and runs
`lazytrain.cli.main`, with its standard output and error in files. A module of its own so spawned
processes can import it by name. `fault` makes rank 1 die ("exit") or stop taking part ("stall")
when it reads its batch for step `at`, which torchrun's own launcher would not let happen on one
host (it stops the others), but a rank on another host, or a hung one, can.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, argv: list[str], out: str, fault: tuple[str, int] | None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(out, f"{name}{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
    if fault is not None and rank == 1:
        die_at(fault[1], fault[0])
    from lazytrain.cli import main

    code = main(argv)
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_at(at: int, mode: str = "exit", code: int = 7) -> None:
    """This process exits with `code` (mode "exit") or hangs ("stall") as it reads its `at`-th batch."""
    from lazytrain.train.data import PackedBatches

    original = PackedBatches.next_batch
    count = [0]

    def next_batch(self):
        count[0] += 1
        if count[0] == at:
            if mode == "exit":
                os._exit(code)
            time.sleep(600)
        return original(self)

    PackedBatches.next_batch = next_batch


def run_ranks(argv: list[str], out: Path, world: int = 2, fault: tuple[str, int] | None = None,
              deadline_s: float = 300.0) -> dict[int, tuple[int | None, str, str]]:
    """`lazytrain <argv>` on `world` ranks: {rank: (exit code or None if it was still running when
    rank 0 ended and was killed, stdout, stderr)}. Waits for rank 0 (at most `deadline_s`), then
    gives the others 5 s."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, argv, str(out), fault)) for r in range(world)]
    for p in procs:
        p.start()
    procs[0].join(deadline_s)
    for p in procs[1:]:
        p.join(5)
    results = {}
    for r, p in enumerate(procs):
        code = p.exitcode
        if p.is_alive():
            p.kill()
            p.join()
            code = None
        results[r] = (code, (out / f"out{r}.txt").read_text(), (out / f"err{r}.txt").read_text())
    return results
