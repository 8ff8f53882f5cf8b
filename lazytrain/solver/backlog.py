"""The workers the step model schedules work on besides the GPU's streams: the host worker (host
optimizer steps, disk-stepped jobs) and the disk (NOTE: [Backward steps from disk] in
disk_model.py). `backlog` spreads a worker's work over the windows it may run in; `job_intervals`
checks the host worker's jobs that are due in the reverse of their release order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mip

if TYPE_CHECKING:
    from lazytrain.solver.step_model import StepModel


# NOTE: [Jobs due in release order's reverse]
# The backlog (NOTE: [Host step backlog]) checks that by each window the host worker has had the
# time for what is due by then, whichever job it ran; that is the whole story only when no job
# released later is due sooner. A disk-stepped stage's job (NOTE: [Disk-stepped stages] in disk_model.py) is
# released at B(s-2) and due before its prefetch at F(s-2) of the next step: the last released is
# due first, and the worker runs the most urgent ready job (NOTE: [Host jobs by deadline] in
# runtime/streams.py). Work done before a job's release does not help it: on the H200 (7B at 24
# GiB, 6 disk-stepped blocks, 2026-12-01) the plan gave block 4's 0.55 s job the 0.25 s between
# B2 and F2, and the forward waited 0.4 s at its prefetch. So for each stage k, what stages 0..k
# hand the worker (released at or after k's job, due by its deadline, host steps among them) must
# fit in the windows from k's release to its deadline (`job_intervals`): by the processor-demand
# test, with the backlog's prefix, what a most-urgent-first worker needs. A job is not interrupted:
# one due sooner waits for the job running when it is released, so each interval also holds the
# longest disk-stepped job (`block`). Both measured: on the H200 (7B at 24 GiB, 2026-12-01, 211d9de)
# layer 3's job, released at B2 (stage 4's B(s-2)), waited 0.7 s for layer 20's (its GPU part 0.64 s
# behind backward's queued steps), and the forward waited 0.44 s at its prefetch. That plan
# predicted 3.95 s and measured 4.47; its decisions re-evaluate at 4.01 s with the intervals alone
# and 4.55 s with the running job; the 32B at max (104 GB host, 9 such blocks) at 11.73 s, measured
# 11.51, predicted 10.72 before.
def job_intervals(model: StepModel) -> list[tuple[object, list[int]]]:
    """Per stage k with the disk tier: the host worker seconds stages 0..k release at or after k's
    job, and the windows (in time order, through the tail into the next forward) from its release
    to its deadline (NOTE: [Jobs due in release order's reverse])."""
    T = len(model.cap) - 2
    PRE, TAIL = T, T + 1
    S = T // 2
    cycle = list(range(T)) + [TAIL, PRE] + list(range(S))  # this step's windows, then the next forward's
    out, work = [], 0.0
    for released, due, seconds, _ in model.host_jobs:
        work = work + seconds
        start = cycle.index(released)
        end = cycle.index(due, max(start, T) if due < S else start)
        out.append((work, cycle[start:end + 1]))
    return out


# NOTE: [Host step backlog]
# A host-stepped stage's AdamW may run in any window from B(s-2) (its gradient has landed) to the
# tail. Splitting each stage's seconds over its own windows took one variable per (stage, window):
# 3,322 of the 4,223 columns of the 72B shape's MIP. Every stage may run until the same last window,
# so a split exists exactly when no prefix of the windows runs more than was released by its end
# (the earliest-release-first order shows it), and a backlog carried from window to window says that
# with two variables per window: done[w] = backlog[w-1] + released[w] - backlog[w], all >= 0, nothing
# left after the tail. The same per-window loads are reachable, so no plan changes value; HiGHS
# searches the smaller model faster (72B at max: 1,062 columns).
def backlog(m: mip.Model, released: list, windows: list[int], scale: float, due: list | None = None) -> dict:
    """The host work done in each of `windows` (in time order), in seconds, where `released[w]` (seconds,
    a linear expression) may run in `w` or any later window (NOTE: [Host step backlog]), and with
    `due`, `due[w]` seconds of what was released must be done by the end of `w`. Jobs are taken
    first released, first due: a job released later is never due sooner, as the callers' are."""
    done, carried, pending = {}, None, None
    for i, w in enumerate(windows):
        if carried is None and not isinstance(released[w], mip.LinExpr):
            continue  # nothing released yet
        x = m.add_var(name=f"cpu_{w}", lb=0.0)  # in units of `scale` seconds
        done[w] = x * scale
        inflow = released[w] * (1.0 / scale) + (carried if carried is not None else 0.0)
        if i == len(windows) - 1:
            m += x == inflow
            continue
        carried = m.add_var(name=f"backlog_{w}", lb=0.0)
        m += carried == inflow - x
        if due is not None:  # released and not yet due: what may still be carried
            left = (pending if pending is not None else 0.0) + (released[w] - due[w]) * (1.0 / scale)
            pending = m.add_var(name=f"pending_{w}", lb=0.0)
            m += pending == left
            m += carried <= pending
    return done
