"""Shared test setup.

NOTE: [CBC deadlock guard]
python-mip reaches CBC through cffi's ABI mode, which resolves each C function on first use while
holding `ffi._lock`, and parses each new C type string under the same lock. `mip.Model` objects sit
in reference cycles, so the garbage collector frees them at arbitrary allocations; if the first
collection of a model happens while that lock is held, `Model.__del__` asks cffi for
`Cbc_deleteModel` (never resolved yet), re-enters the non-reentrant lock and the test process
hangs forever. Resolving `Cbc_deleteModel` once, up front, makes `__del__` lock-free. lazytrain
does this in solver/formulation.py; test_properties.py::test_solver_garbage_cannot_deadlock checks it.

NOTE: [Threads per worker]
Each pytest-xdist worker, and each process a test starts, ran torch on every core, so two workers on
the two-core CI machine ran four or more OpenMP threads on two cores. Giving each worker its share of
the cores (OMP_NUM_THREADS, which the processes a test starts inherit, unless already set) took the
suite from 622 s to 530 and 586 s on that machine (2026-12-06), the kill-and-resume test from 75 s to 24-31 s.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lazytrain.host import host_cores

sys.path.insert(0, str(Path(__file__).parent))  # `from models import ...` in every test file
os.environ.setdefault("LAZYTRAIN_NO_CACHE", "1")  # every test solves (test_plancache.py turns the cache on)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:  # NOTE: [Threads per worker]; as the launcher shares them (NOTE: [Launching])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, host_cores() // _workers)))


def _resolve_cbc_delete() -> None:
    try:
        from mip import cbc
    except Exception:  # no python-mip: the solver tests fail on their own
        return
    if getattr(cbc, "has_cbc", False):
        cbc.cbclib.Cbc_deleteModel  # noqa: B018  resolve the accessor outside any cffi lock


_resolve_cbc_delete()
