"""Is the plan the truth on the device? Measured against predicted, per configuration and window.

Three phases, because the GPU machine has no solver:
  python bench/fidelity.py compile [--only PATTERN]       (here) every configuration of CASES into
                                                          .bench/fidelity/; a refused compile is a row too
  python bench/fidelity.py run [--only PATTERN]           (on the GPU) builds each model once, binds each
                                                          of its schedules in turn, writes bench/results/fidelity/
  python bench/fidelity.py table                          rewrites the fidelity table in bench/README.md

Per configuration it records the step time (median of --steps timed steps after --warmup) against
the plan's prediction, the allocator's allocated and reserved peaks against the budget and the
predicted peak, the process's host memory (its peak RSS while the schedule ran, cleared before each
one) against the plan's host bytes plus the host reserve, and per window the most memory allocated
while its events were issued (the caching allocator allocates as work is issued) and the time from
the window's first compute to the next window's, against the plan. The checks (DESIGN.md): reserved
peak within the budget; predicted peak within 5% of the allocated peak; predicted step within 10%.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from bench.bench import _commit  # noqa: E402  (the GPU machine's copy has no .git: LAZYTRAIN_COMMIT)
from bench.fidelity_cases import CASE_DIR, RESULTS, Case, GiB, _selected  # noqa: E402
from bench.fidelity_table import _line, _table, cmd_table  # noqa: E402
from bench.fidelity_readings import (_clear_host_peak, _io_bytes, _segments, _status_kib, _time_disk_jobs,  # noqa: E402
                                     _time_evaluations)
from bench.fidelity_windows import _window_of, _windows  # noqa: E402


# ---- compile (here) ---------------------------------------------------------------------------------

def cmd_compile(args) -> None:
    import torch

    from bench.shapes import batch, meta_model
    from lazytrain import hardware
    from lazytrain.errors import LazytrainError
    from lazytrain.options import CompileOptions
    from lazytrain.pipeline import compile_model, minimum_budget
    from lazytrain.units import format_size, parse_size

    hw = hardware.load(args.hardware)
    CASE_DIR.mkdir(parents=True, exist_ok=True)
    for case in _selected(args.only):
        start = time.perf_counter()
        hw_case = dataclasses.replace(hw, host_memory_bytes=parse_size(case.host)) if case.host else hw
        meta = meta_model(case.model, case.seq).to(torch.bfloat16)
        b = batch(case.model, case.batch, case.seq)
        tile_bytes = parse_size(case.tile) if case.tile else 0
        # the case's tiles (none unless it names a size): a "min" budget searched over tiles would be
        # one its untiled plan cannot meet (the 7B at 1 x 65,536: 11.0 GiB tiled, 23.6 untiled)
        precision = CompileOptions(optimizer_states=case.states, master_weights=case.master, tile_bytes=tile_bytes)
        refused = CASE_DIR / f"{case.name}.refused.json"
        refused.unlink(missing_ok=True)

        def options(fuse: bool) -> CompileOptions:
            # "min": the smallest budget at the case's precision and pricing (a plan priced fused needs
            # less than one priced eager: the 7B at 1 x 65,536 24.4 GiB against 25.9), with the default
            # clipping and no disk tier
            priced = dataclasses.replace(precision, fuse_stages=fuse)
            budget = minimum_budget(meta, b, hw_case, options=priced) if case.budget == "min" else (
                "max" if case.budget == "max" else parse_size(case.budget))
            return dataclasses.replace(priced, budget=budget, time_limit=args.time_limit, clipping=case.clipping,
                                       disk=bool(case.host))

        try:
            compiled = None if args.fused_only else compile_model(meta, b, hardware=hw_case, options=options(False),
                                                                  source=f"bench:{case.model}")
            if compiled is not None:
                (CASE_DIR / f"{case.name}.py").write_text(compiled.source_text)
            # NOTE: [Fused stage prices] in lazytrain/passes/fusion.py: `run --fuse-stages` is held to a
            # plan priced fused, the plain run to one priced eager
            fused = compile_model(meta, b, hardware=hw_case, options=options(True), source=f"bench:{case.model}")
        except LazytrainError as exc:  # a refused compile is an honest answer: it is recorded, and the next case runs
            refused.write_text(json.dumps({"case": asdict(case), "refused": str(exc), "commit": _commit()}) + "\n")
            print(f"{case.name}: refused: {exc}")
            continue
        (CASE_DIR / f"{case.name}_fused.py").write_text(fused.source_text)
        plan = (compiled or fused).plan
        print(f"{case.name}: predicted {plan.step_s:.3f} s, peak {format_size(plan.peak_bytes)}, "
              f"host {format_size(plan.host_bytes)}, compiled in {time.perf_counter() - start:.0f} s")


# ---- run (on the GPU) ---------------------------------------------------------------------------------

def _run_schedule(case: Case, path: Path, model, data, args, masters=None) -> dict:
    import torch

    from lazytrain.runtime.schedule import load_schedule

    module = load_schedule(path)
    torch.cuda.empty_cache()
    current: list = [None]  # the event being issued: where an out-of-memory error happened
    cleared = _clear_host_peak()
    t0 = time.perf_counter()
    trainer = module.bind(model, device="cuda", lr=1e-5, max_grad_norm=None if module.CLIPPING == "off" else 1.0,
                          disk_masters=masters, fuse_stages=args.fuse_stages)
    bind_s = time.perf_counter() - t0
    issue = trainer.streams.run

    def tracked(e, fn, on=None):
        current[0] = e
        issue(e, fn, on=on)
    trainer.streams.run = tracked
    try:
        return _measure(case, module, trainer, data, args, bind_s, cleared)
    except torch.cuda.OutOfMemoryError as exc:
        e = current[0]
        where = (f"event {e.id} {e.kind.value} stage {e.stage} {e.phase.value if e.phase else ''} in window "
                 f"{_window_of(module, e.start_s)} (predicted {dict((w[0], w[1]) for w in module.WINDOWS)[_window_of(module, e.start_s)] / GiB:.2f} GiB)"
                 if e is not None else "outside events")
        raise RuntimeError(f"out of memory at {where}: {str(exc).splitlines()[0]}") from None


def _measure(case: Case, module, trainer, data, args, bind_s: float, cleared: bool) -> dict:
    import torch

    from lazytrain.train.report import allocator_retries  # NOTE: [Allocator retries]

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    retries = allocator_retries()
    times, losses, step_retries = [], [], []
    jobs = _time_disk_jobs(trainer) if args.events else None
    io = None
    for i in range(args.warmup + args.steps):
        trainer.record_timeline = i == args.warmup + args.steps - 1
        if i == args.warmup:
            io = _io_bytes()
        start = time.perf_counter()
        if jobs is not None:
            jobs.append(("step", i, start, start))
        before = allocator_retries()
        losses.append(trainer.step(data).item())
        times.append(time.perf_counter() - start)
        step_retries.append(allocator_retries() - before)
        # a long row's steps take minutes: each is reported as it ends, so a run cut short still says them
        print(f"[fidelity] {case.name} step {i + 1} of {args.warmup + args.steps}: {times[-1]:.2f} s, "
              f"loss {losses[-1]:.4f}, allocated peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB, "
              f"allocator retries {step_retries[-1]}", flush=True)
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    io_after = _io_bytes()
    # storage read and written per timed step (its last writes may land after it: `synchronize` drains them)
    disk_io = [(b - a) / args.steps for a, b in zip(io, io_after)] if io and io_after else None
    # the allocator freed its cache and retried (a device-wide sync): a plan at its cap stalls there
    retries = allocator_retries() - retries
    segments = _segments(trainer)
    windows = _windows(module, trainer.timeline)
    kinds = {e.id: e for e in module.EVENTS}
    events = [{"id": i, "kind": kinds[i].kind.value, "stream": kinds[i].stream.value, "stage": kinds[i].stage,
               "device": kinds[i].device, "start_s": a, "end_s": b, "predicted_start_s": kinds[i].start_s,
               "predicted_s": kinds[i].duration_s} for i, a, b in trainer.timeline] if args.events else None
    step_s = statistics.median(times[args.warmup:])
    from lazytrain.hardware import FUSED_HOST_RESERVE, HOST_RESERVE
    from lazytrain.runtime.fused import compile_seconds

    row = {
        "case": asdict(case), "budget_bytes": module.BUDGET, "predicted_peak_bytes": module.PREDICTED_PEAK,
        "predicted_step_s": module.PREDICTED_STEP_S, "predicted_host_bytes": module.PREDICTED["host_bytes"],
        # NOTE: [Compiler's host memory]: a plan priced fused leaves Inductor its share besides
        "host_reserve_bytes": HOST_RESERVE + (FUSED_HOST_RESERVE if getattr(module, "FUSED", False) else 0),
        "step_s": step_s, "step_times_s": times[args.warmup:], "losses": list(losses), "bind_s": bind_s,
        "allocated_peak_bytes": allocated, "reserved_peak_bytes": reserved,
        "host_peak_bytes": _status_kib("VmHWM") * 1024 if cleared else None,
        "alloc_retries": retries, "step_alloc_retries": step_retries, "segments": segments, "pinned_bytes": trainer.pinned.reserved, "rss_bytes": _status_kib("VmRSS") * 1024,
        "predicted_disk_bytes": module.PREDICTED.get("disk_bytes", 0),
        "disk_read_bytes_per_step": disk_io[0] if disk_io else None,
        "disk_written_bytes_per_step": disk_io[1] if disk_io else None,
        "fused_stages": args.fuse_stages, "stage_compile_s": compile_seconds(),
        "windows": windows, **({"events": events} if events is not None else {}),
        **({"disk_jobs": jobs} if jobs else {}), "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "commit": _commit(),
    }
    if not args.windows:
        _time_evaluations(trainer, data, args, row)
        trainer.sync_model()
        return row
    # The timed steps' row, written before the untimed step below: a run cut short there (a time
    # limit; a 7B row at 40 GiB on 2026-12-04) keeps its timed steps. The full row replaces it.
    _write_row(case, args, Path(args.out or RESULTS), {**row, "partial": "the untimed windows step did not finish"})
    # one more step, untimed, with the allocator read as each event is issued (`--no-windows` leaves
    # it out: at 1 x 524,288 tokens a step is about 8 minutes)
    from bench.trace import event_memory

    loss, rows = event_memory(trainer, data)
    row["losses"].append(loss)
    starts = {e.id: e.start_s for e in module.EVENTS}
    seen: dict[str, int] = {}
    for event_id, _, peak, _ in rows:
        label = _window_of(module, starts[event_id])
        seen[label] = max(seen.get(label, 0), peak)
    for w in windows:
        w["measured_bytes"] = seen.get(w["window"])
    # per event of that step: (id, allocated before it was issued, the most while it was, after), so a
    # window off the plan names its event without another run (`verify`'s trace is the plan's side)
    row["event_bytes"] = [list(r) for r in rows]
    row["host_peak_bytes"] = _status_kib("VmHWM") * 1024 if cleared else None
    if args.trace:  # the trace reads the per-event memory of the step above
        from bench.trace import traced_step

        trace = traced_step(trainer, data, rows)
        (Path(args.out or RESULTS) / f"{case.name}.trace.json").write_text(json.dumps(trace) + "\n")
    _time_evaluations(trainer, data, args, row)
    trainer.sync_model()
    return row


def _write_row(case: Case, args, out: Path, row: dict) -> None:
    (out / f"{_row_name(case, args)}.json").write_text(json.dumps(row, indent=1) + "\n")


def _schedule_path(case: Case, args) -> Path:
    """The case's schedule: the one priced fused for `--fuse-stages` (`cmd_compile`)."""
    return CASE_DIR / f"{_row_name(case, args)}.py"


def cmd_run(args) -> None:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    from bench.shapes import batch, for_schedule
    from lazytrain.runtime.disk_masters import DiskMasters, masters_on_disk
    from lazytrain.runtime.schedule import load_schedule

    torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    cases = [c for c in _selected(args.only) if _schedule_path(c, args).is_file()]
    if len(cases) > 1 and not args.in_process:  # each case in a process of its own (`_one_per_process`)
        print("\n".join(_table(_one_per_process(cases, args, out))))
        return
    rows = []
    for case in cases:
        path = _schedule_path(case, args)
        # each case's model is built in its schedule's tiers (resident masters straight onto the GPU):
        # the host never holds what the plan does not count on it
        start = time.perf_counter()
        torch.cuda.set_per_process_memory_fraction(1.0)  # the last case's trainer capped the allocator at its budget
        module = load_schedule(path)  # NOTE: [Masters on disk] in solver/disk_model.py: built straight into their file
        masters = DiskMasters(module) if masters_on_disk(module) else None
        model = for_schedule(module, case.model, case.seq, torch.bfloat16 if case.master == "bf16" else torch.float32,
                             masters=masters)
        print(f"[fidelity] built {case.model} ({case.master} masters) in {time.perf_counter() - start:.0f} s", flush=True)
        data = batch(case.model, case.batch, case.seq, "cuda")
        try:
            row = _run_schedule(case, path, model, data, args, masters)
        except Exception as exc:  # an OOM is the finding this bench exists for: record it
            row = {"case": asdict(case), "failed": f"{type(exc).__name__}: {str(exc)[:400]}", "commit": _commit(),
                   "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name()}
        del model, masters
        gc.collect()  # the trainer (and, after a failure, the frames that held it) is gone
        torch.cuda.empty_cache()
        _write_row(case, args, out, row)
        rows.append(row)
        print(f"[fidelity] {_line(row)}", flush=True)
    print("\n".join(_table(rows)))


def _row_name(case: Case, args) -> str:
    """A row's file: the case's name, and `_fused` when its stage bodies ran compiled."""
    return case.name + ("_fused" if args.fuse_stages else "")


def _one_per_process(cases, args, out: Path) -> list[dict]:
    """`run` of each case in a child process: a host peak measured after another case in the same
    process carries what that case left behind (the 1.5B clipped by previous-norm on the H200 box,
    2026-12-02: 7.4 GiB after another case, 3.7 GiB alone, against 4.1 planned)."""
    rows = []
    for case in cases:
        argv = [sys.executable, __file__, "run", "--in-process", "--only", case.name, "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--out", str(out)] + ["--events"] * args.events + ["--trace"] * args.trace \
            + ["--fuse-stages"] * args.fuse_stages + ["--no-windows"] * (not args.windows) + ["--eval", str(args.eval)]
        done = subprocess.run(argv)
        row = out / f"{_row_name(case, args)}.json"
        if done.returncode == 0 and row.is_file():
            rows.append(json.loads(row.read_text()))
        else:
            print(f"[fidelity] {case.name}: its process exited with {done.returncode}", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, fn in (("compile", cmd_compile), ("run", cmd_run), ("table", cmd_table)):
        s = sub.add_parser(name)
        s.set_defaults(fn=fn)
        if name == "table":
            continue
        s.add_argument("--only", default=None, help="globs over case names, comma-separated, e.g. 'qwen2.5-7b_*_24GiB_*'")
        if name == "compile":
            s.add_argument("--hardware", default="h200")
            s.add_argument("--time-limit", type=float, default=120.0)
            s.add_argument("--fused-only", action="store_true", help="compile only the plan priced fused (`_fused.py`)")
        else:
            # the first two steps make the optimizer's states (the host's page-locked ones are registered
            # then: 0.3 s a GiB): they are warm-up, never timed
            s.add_argument("--steps", type=int, default=3)
            s.add_argument("--warmup", type=int, default=2)
            s.add_argument("--out", default=None)
            s.add_argument("--events", action="store_true", help="also keep the timed step's events (every stream, "
                           "the optimizer's too) in the row")
            s.add_argument("--trace", action="store_true", help="also write <case>.trace.json: per-event memory and "
                           "times, and what is live at the peak (bench/trace.py)")
            s.add_argument("--fuse-stages", action="store_true", help="run the stage bodies compiled by torch.compile "
                           "(NOTE: [Fused stages] in lazytrain/runtime/fused.py); rows are <case>_fused.json")
            s.add_argument("--eval", type=int, default=0, help="time this many evaluations of the batch after the "
                           "steps (`Trainer.loss`, after one untimed); 0: none")
            s.add_argument("--no-windows", dest="windows", action="store_false", help="leave out the untimed "
                           "step that reads the allocator at every event (each window's measured bytes)")
            s.add_argument("--in-process", action="store_true", help="run every case in this process (default: "
                           "each in a process of its own, so that no case's host peak carries an earlier one's)")
    args = p.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
