"""`lazytrain train`: the main job. Check every input (preflight.py), compile (or load) a
schedule, then train with progress, a JSONL log, atomic checkpoints and exact resume.

Resume is exact on the CPU: a run killed at any moment and resumed from its last checkpoint
reaches bit-identical weights, because everything that decides the next step is checkpointed:
weights, optimizer state, LR schedule and its position, data position and RNG states.

On several ranks (NOTE: [Launching] in distributed.py) the model's batch is the global batch: each
rank trains on its share (NOTE: [Data across ranks] in data.py) with a schedule compiled once, on
rank 0, for that share and the world size; checkpoints go through torch.distributed.checkpoint
(NOTE: [Distributed checkpoints] in dist_checkpoint.py) and resume at any world size.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from lazytrain.errors import CheckpointError, DataError
from lazytrain.files import write_atomic
from lazytrain.ir.placement import Outputs, Tier
from lazytrain.options import FUSE_STAGES, CompileOptions, check_budget
from lazytrain.runtime.capacity import check_budget_room, check_host, check_room, other_gpu, smaller_host
from lazytrain.runtime.disk_masters import DiskMasters, masters_on_disk
from lazytrain.runtime.fused import compile_seconds
from lazytrain.runtime.optim import master_dtype
from lazytrain.runtime.schedule import load_schedule, load_source
from lazytrain.runtime.store import resident_targets
from lazytrain.summary import summary
from lazytrain.train.checkpoint_load import check_fingerprint
from lazytrain.train import distributed
from lazytrain.train.distributed import PeerFailed, Ranks, from_rank0, together
from lazytrain.train.lock import RunLock
from lazytrain.train.preflight import Prepared, device_type, hardware, prepare
from lazytrain.train.finite import check_loaded
from lazytrain.train.resume import check_structure, lr_lambda, trim_log
from lazytrain.train import report, run_state
from lazytrain.train.boundaries import POSITIONS
from lazytrain.train.evaluation import evaluate
from lazytrain.train.flops import attention_layers
from lazytrain.train.packing import UNPACKED
from lazytrain.train.run_data import zeros
from lazytrain.train.source import ModelSource
from lazytrain.units import format_size


def _schedule_text(args, options: CompileOptions, prep: Prepared) -> tuple[str, bool]:
    """On rank 0 only: the schedule's source text, and whether it was compiled here (False for
    --schedule)."""
    if args.schedule:
        module = load_schedule(args.schedule)
        for flag, key, value in (("--optimizer-states", "OPTIMIZER_STATES", args.optimizer_states),
                                 ("--master-weights", "MASTER_WEIGHTS", args.master_weights)):
            compiled = getattr(module, key, {"OPTIMIZER_STATES": "32bit", "MASTER_WEIGHTS": "fp32"}[key])
            if value is not None and value != compiled:
                raise DataError(f"{args.schedule} was compiled with {flag} {compiled}, not {value}; recompile it "
                                f"with `lazytrain compile ... {flag} {value}`, or drop {flag}")
        if getattr(module, "SHARDED", False) and getattr(module, "OPTIMIZER_STATES", "32bit") == "8bit":
            raise DataError(f"{args.schedule} shards 8-bit optimizer states over the ranks, whose checkpoints lazytrain "
                            "train cannot write yet (NOTE: [State in train]); recompile it with `lazytrain compile ... "
                            "--replicate-state`, or with --optimizer-states 32bit")
        return Path(args.schedule).read_text(), False
    from lazytrain.pipeline import compile_model  # the solver: only to compile here
    from lazytrain.progress import reporting

    hw = hardware(args)
    batch = prep.batch(prep.rank_batch)
    shard = hw.link_bandwidth > 0 and options.optimizer_states == "32bit"  # NOTE: [State in train]
    options = replace(options, master_weights=args.master_weights or default_masters(prep.meta_model),
                      world_size=prep.world, shard_state=None if shard else False)
    if prep.world > 1 and not hw.link_bandwidth > 0:
        print(f"note: hardware profile '{hw.name}' has no link_bandwidth, so the optimizer state is kept whole on every "
              "rank; `torchrun --nproc-per-node 2 -m lazytrain.cli profile -o hw.json` measures it", flush=True)
    check_budget(options, hw)
    if hw.device == "cuda" and torch.cuda.is_available():  # NOTE: [Room on the GPU] in runtime/capacity.py
        device = torch.device("cuda", torch.cuda.current_device())
        check_budget_room(options.budget, hw, device)
        for note in (other_gpu(hw, device), smaller_host(hw)):
            if note:
                print(note, flush=True)
    each = f" on each of {prep.world} ranks" if prep.world > 1 else ""
    print(f"compiling {prep.source.path} for batch {list(prep.rank_batch)}{each} ...", flush=True)
    with reporting():  # NOTE: [Compile progress] in progress.py
        compiled = compile_model(prep.meta_model, batch, hardware=hw, options=options, source=str(prep.source.path))
    return compiled.source_text, True


# NOTE: [State in train]
# `lazytrain train` on several ranks shards the master weights and 32-bit optimizer states (NOTE:
# [Sharded state] in runtime/sharding.py) and replicates them otherwise (a --schedule compiled with
# --replicate-state, or a hardware profile without the ranks' link bandwidth, which a sharded plan
# needs). 8-bit states stay replicated here though the compiler shards them by default: sharded,
# they are cut on quantisation blocks, which the checkpoints below do not hold yet (the
# checkpoint refuses them, `ShardedCheckpoint`), and a --schedule that shards them is refused. The run's
# checkpoints (NOTE: [Distributed checkpoints]) hold either layout, and a resumed run reads either,
# at any world size.


def default_masters(model: torch.nn.Module) -> str:
    """--master-weights when not given: bf16 for a model built in bf16 (most checkpoints' config
    dtype), as its weights came, else fp32 (NOTE: [Masters in the schedule's dtype] in runtime/optim.py)."""
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return "bf16" if floating and all(d == torch.bfloat16 for d in floating) else "fp32"


def _checkpoint_fingerprint(prep: Prepared, found, schedule) -> str:
    """The fingerprint `found` must have: this schedule's, or, when the checkpoint's ranks ran
    another batch shape (another world size), the model's at that shape (a capture, no solve).
    The global batch must be the run's own."""
    theirs = tuple(found.extra.get("rank_batch", prep.source.batch_shape))
    world = found.extra.get("world_size", 1)
    was = (theirs[0] * world, theirs[1])
    if was != tuple(prep.source.batch_shape):
        raise CheckpointError(f"{found.path} was trained on a global batch of {list(was)} ({world} rank"
                              f"{'s' if world > 1 else ''} of {list(theirs)}), this run's is "
                              f"{list(prep.source.batch_shape)}; resume with the run's batch (--batch-size, or "
                              "example_batch()), on any number of ranks that divides it")
    if theirs == tuple(schedule.BATCH["input_ids"][0]):
        return schedule.FINGERPRINT
    from lazytrain.ir.capture import capture
    from lazytrain.pipeline import rewritten

    return rewritten(capture(prep.meta_model, zeros(schedule.BATCH, theirs), str(prep.source.path),
                             schedule.DEVICE)).fingerprint()


def _check_schedule(args, schedule, prep: Prepared) -> None:
    """A --schedule fits the run: compiled for its world size and one rank's share of its batch."""
    where = args.schedule or "the schedule"
    compiled = getattr(schedule, "WORLD_SIZE", 1)
    shape = tuple(schedule.BATCH["input_ids"][0]) if "input_ids" in schedule.BATCH else None
    if compiled != prep.world or shape != prep.rank_batch:
        raise DataError(
            f"{where} was compiled for {compiled} rank{'s' if compiled > 1 else ''} and a batch of {list(shape or ())} "
            f"per rank; this run has {prep.world} rank{'s' if prep.world > 1 else ''} sharing a global batch of "
            f"{list(prep.source.batch_shape)}, {list(prep.rank_batch)} per rank. Drop --schedule to compile the right "
            f"one (the run directory keeps it as schedule.py), or compile {list(prep.rank_batch)} with --world-size "
            f"{prep.world}")
    if POSITIONS in prep.inputs and POSITIONS not in schedule.BATCH:  # NOTE: [Packing] in packing.py
        raise DataError(
            f"{where} was compiled without position_ids, and this run packs several sequences into a row, which only "
            f"they keep apart; compile it with position_ids in example_batch(), drop --schedule to compile here, or "
            f"pass {UNPACKED.flags()}")


def _materialize(source: ModelSource, schedule, disk: DiskMasters | None = None) -> torch.nn.Module:
    """The model with its starting weights, loaded in the masters' dtype (NOTE: [Loading weights]
    in weights.py), masters on disk straight into `disk` (runtime/disk_masters.py); casts are said once."""
    masters = master_dtype(schedule, torch.float32)  # NOTE: [Masters in the schedule's dtype] in runtime/optim.py
    device = torch.device(schedule.DEVICE)
    places = {}  # NOTE: [Masters built in place] in runtime/store.py
    if device.type != "cpu" and not getattr(schedule, "SHARDED", False):
        places = dict.fromkeys(resident_targets(schedule), device)
    for p in disk.layout if disk is not None else ():
        places[schedule.PLACEHOLDERS[p][1]] = disk.place(p)
    model, casts = source.materialize(masters, places)
    if source.weights is not None:
        files = len(set(source.weights.files.values()))
        print(f"loaded {len(source.weights.files)} tensors from {source.weights.origin}"
              + (f" ({files} shards)" if files > 1 else "") + "".join(f"; {c}" for c in casts), flush=True)
    return model


def train(args, options: CompileOptions) -> dict:
    """Train as `args` (`lazytrain train`'s flags) say; a schedule compiled here is compiled with
    `options` (cli.train_options), completed with the run's ranks and model."""
    ranks = distributed.from_env(args.nproc_per_node, _device(args), args.dist_timeout)  # NOTE: [Launching]
    distributed.quiet_others(ranks)
    try:
        with contextlib.ExitStack() as held:  # the run directory's lock, released as the run ends
            return _train(args, options, ranks, held)
    finally:
        distributed.teardown(ranks)


def _device(args) -> str:
    """Where the run's schedule runs, for the process group's backend; preflight reports bad input."""
    try:
        return device_type(args)
    except Exception:  # noqa: BLE001 -- the same input fails again, inside preflight, with its own error
        return "cuda" if torch.cuda.is_available() else "cpu"


def _train(args, options: CompileOptions, ranks: Ranks | None, held: contextlib.ExitStack) -> dict:
    main = ranks is None or ranks.main
    locked = False
    with together(ranks, "checking the inputs"):  # every input checked before the compile; nothing written yet
        if main and args.checkpoint_dir and Path(args.checkpoint_dir).is_dir():  # NOTE: [Run lock] in lock.py
            held.callback(RunLock.take(Path(args.checkpoint_dir)).release)
            locked = True
        prep = prepare(args, ranks.rank if ranks else 0, ranks.world if ranks else 1)
    source, run_dir, found, lr, data = prep.source, prep.run_dir, prep.found, prep.lr, prep.data
    schedule_text, compiled_here = from_rank0(ranks, lambda: _schedule_text(args, options, prep), "the compile")
    with together(ranks, "checking the schedule"):  # the same schedule on every rank; bind checks its checksum
        schedule = load_source(schedule_text, f"lazytrain_train_schedule_{id(prep)}", args.schedule or None)
        _check_schedule(args, schedule, prep)
        if schedule.DEVICE == "cuda" and torch.cuda.is_available():  # before the weights load: bind checks again
            check_host(schedule)
            check_room(schedule, torch.device("cuda", torch.cuda.current_device()))
        if found is not None and main:  # the checkpoint fits this schedule and model before anything is written
            check_fingerprint(found, _checkpoint_fingerprint(prep, found, schedule))  # (every rank read it)
            check_structure(found, prep, schedule)
        if run_dir is not None and main:
            run_dir.mkdir(parents=True, exist_ok=True)
            if not locked:  # a new run directory: locked as it is made, before anything is written there
                held.callback(RunLock.take(run_dir).release)
            if compiled_here:
                write_atomic(run_dir / "schedule.py", schedule_text, ", or pass another --checkpoint-dir")
    print(summary(schedule), end="", flush=True)
    if prep.lr_notice:
        print(prep.lr_notice, flush=True)

    torch.manual_seed(args.seed)  # every rank: the same starting weights
    offload_dir = _offload_dir(args, run_dir, schedule)
    masters = DiskMasters(schedule, offload_dir) if masters_on_disk(schedule) else None  # loaded straight there
    model = _materialize(source, schedule, masters)
    if found is not None:  # weights first: binding copies them to the GPU
        run_state.restore_weights(found, model)
    elif source.weights is not None:  # NOTE: [Finite state] in finite.py
        check_loaded(model, source.weights.origin)
    trainer = schedule.bind(model, lr=lr.lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                            device=schedule.DEVICE,  # where its stages were captured for; over the default group
                            offload_dir=offload_dir, disk_masters=masters,
                            # NOTE: [Fused stages] in runtime/fused.py
                            fuse_stages=FUSE_STAGES[args.fuse_stages])
    scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lr_lambda(lr.warmup_steps, lr.steps, lr.min_lr_ratio))
    start = 0
    if found is not None:
        with together(ranks, "restoring the checkpoint"):  # a refusal on one rank stops every rank
            run_state.restore_state(found, trainer, scheduler, data, lr if prep.lr_notice else None,
                                    ranks.rank if ranks else 0)
        start = found.step
        was = found.extra.get("world_size", 1)
        print(f"resumed from {found.path} at step {start}" + (f" (saved on {was} rank{'s' if was > 1 else ''})"
              if was != prep.world else "") + (" (the run is complete)" if start >= lr.steps else ""), flush=True)
    memory = trainer.memory_report()
    on = f" (each of {prep.world} ranks)" if ranks else ""
    print(f"runtime on {trainer.device}{on}: weight and optimizer slots (at most) {format_size(memory['slot_bytes'])}, "
          f"page-locked host buffers {format_size(memory['pinned_bytes'])}", flush=True)
    room = run_state.room_for(args, run_dir, model, schedule, start, lr, ranks)  # NOTE: [Checkpoint room] in room.py

    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers = attention_layers(prep.meta_model)  # NOTE: [Model FLOPs] in flops.py
    feed = lambda batch: {k: batch.inputs[k] for k in schedule.BATCH}  # noqa: E731 -- what the step takes
    log_path = Path(args.log) if args.log else run_dir / "log.jsonl" if run_dir else None
    if log_path is not None and main:
        trim_log(log_path, start)  # one record per step across resumes
    log = open(log_path, "a") if log_path is not None and main else None
    bar = tqdm(range(start, lr.steps), initial=start, total=lr.steps, desc="train", unit="step",
               disable=args.no_progress or not sys.stderr.isatty() or not main, dynamic_ncols=True, mininterval=0.5)
    record, told_retries = {}, False
    for step in bar:
        batch = data.next_batch()
        trainer.record_timeline = run_dir is not None and step + 1 == lr.steps  # time the last step's events
        t0, compiling, retries = time.perf_counter(), compile_seconds(), report.allocator_retries()
        loss = trainer.step(feed(batch)).item()  # on several ranks, the mean of their losses (the global batch's)
        compiling = compile_seconds() - compiling  # fused stage bodies compiled in this step: not its time
        retries = report.allocator_retries() - retries  # NOTE: [Allocator retries] in report.py
        if not math.isfinite(loss):
            error = DataError if main else PeerFailed  # the same loss on every rank: rank 0 says it
            raise error(f"step {step + 1}: the loss is {loss}; lower --lr or check the data")
        scheduler.step()
        record = report.step_record(step + 1, loss, scheduler.get_last_lr()[0], time.perf_counter() - t0 - compiling,
                                    batch, n_params, layers)  # NOTE: [Honest throughput] in report.py
        if retries:
            record["alloc_retries"] = retries
            if step >= start + 2 and not told_retries:  # the first two steps warm up
                told_retries = True
                bar.write(report.retries_notice(step + 1, retries, schedule.BUDGET, schedule.PREDICTED_PEAK,
                                                schedule.HARDWARE))
        if compiling > 0:
            record["compile_s"] = compiling
            bar.write(f"step {step + 1}: compiled fused stage bodies in {compiling:.1f} s (not counted in its time)")
        bar.set_postfix(**report.postfix(record))
        if (step + 1) % args.print_every == 0 or step + 1 == lr.steps or step == start:
            bar.write(report.line(record))
        if prep.eval_set is not None and ((step + 1) % (args.eval_every or lr.steps) == 0 or step + 1 == lr.steps):
            held = evaluate(trainer, prep.eval_set, feed)  # NOTE: [Evaluation through the training step]
            record["eval_loss"] = held.loss
            bar.write(f"eval at step {step + 1}: loss {held.loss:.4f} over {held.learnt} learnt tokens "
                      f"({held.batches} batch{'es' if held.batches != 1 else ''})")
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()
        done = step + 1
        if run_dir is not None and (done % args.checkpoint_every == 0 or done == lr.steps):
            if done < lr.steps or not args.export_hf:  # with an export, the final weights go there first
                run_state.save_in_room(room, done, done == lr.steps, ranks, lambda: run_state.save(
                    run_dir, done, model, trainer, scheduler, data, schedule.FINGERPRINT, lr, prep, ranks))
    bar.close()
    if run_dir is not None and trainer.timeline and main:
        from lazytrain.timeline import save_measured

        save_measured(run_dir / "measured.json", trainer.timeline, schedule)
        print(f"measured timeline of the last step: {run_dir / 'measured.json'} "
              f"(lazytrain inspect {run_dir / 'schedule.py'} --measured {run_dir / 'measured.json'} --png step.png)")
    if log:
        log.close()
    if args.export_hf:
        final = None if run_dir is None or start >= lr.steps else (
            lambda: run_state.save(run_dir, lr.steps, model, trainer, scheduler, data, schedule.FINGERPRINT, lr, prep, ranks))
        run_state.export(args, model, trainer, prep, ranks, room, max(start, lr.steps), final)
    return record


def _offload_dir(args, run_dir, schedule) -> str | None:
    """Where a schedule with optimizer states or stage outputs on disk keeps them (NOTE: [Disk-resident
    states], NOTE: [Activations on disk] in solver/disk_model.py): --offload-dir, else the run
    directory's `offload/`, else the temp directory."""
    if args.offload_dir is not None or not any(s.placement.step.states is Tier.DISK or s.placement.outputs is Outputs.DISK
                                               for s in schedule.STAGES):
        return args.offload_dir
    if run_dir is None:
        return None
    (run_dir / "offload").mkdir(parents=True, exist_ok=True)
    return str(run_dir / "offload")
