"""`lazytrain train`: the main job. Compile (or load) a schedule, then train with progress,
a JSONL log, atomic checkpoints and exact resume.

Resume is exact on the CPU: a run killed at any moment and resumed from its last checkpoint
reaches bit-identical weights, because everything that decides the next step is checkpointed:
weights, optimizer state, LR-schedule position, data position and RNG states.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from lazytrain import examples
from lazytrain import hardware as hw_profiles
from lazytrain.errors import DataError
from lazytrain.ir.capture import build_on_meta
from lazytrain.runtime.schedule import load_schedule, load_source
from lazytrain.summary import summary
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.data import PackedBatches, builtin_tokenizer, load_tokenizer, CORPUS_PATH
from lazytrain.train.source import ModelSource, load_weights, resolve
from lazytrain.units import format_size


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warm-up to the peak LR, then cosine decay to `min_ratio` of it."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def _schedule(args, source: ModelSource, out: Path | None):
    if args.schedule:
        module = load_schedule(args.schedule)
        for flag, key, value in (("--optimizer-states", "OPTIMIZER_STATES", args.optimizer_states),
                                 ("--master-weights", "MASTER_WEIGHTS", args.master_weights)):
            compiled = getattr(module, key, {"OPTIMIZER_STATES": "32bit", "MASTER_WEIGHTS": "fp32"}[key])
            if value is not None and value != compiled:
                raise DataError(f"{args.schedule} was compiled with {flag} {compiled}, not {value}; recompile it "
                                f"with `lazytrain compile ... {flag} {value}`, or drop {flag}")
        return module
    from lazytrain.pipeline import compile_model, minimum_budget  # the solver: only to compile here

    default_hw = "h200" if torch.cuda.is_available() else "cpu"
    hw = hw_profiles.load(args.hardware or default_hw)
    batch = source.example_batch()
    meta_model = build_on_meta(source.build_model)
    opts = {"optimizer_states": args.optimizer_states or "32bit", "master_weights": args.master_weights or "fp32"}
    budget = args.budget if args.budget not in (None, "min", "max") else None
    if args.budget in (None, "min"):
        budget = minimum_budget(meta_model, batch, hw, **opts)
    elif args.budget == "max":
        budget = hw.max_budget
    print(f"compiling {source.path} for batch {list(source.batch_shape)} ...", flush=True)
    compiled = compile_model(meta_model, batch, budget, hw, source=str(source.path), time_limit=args.time_limit, **opts)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "schedule.py").write_text(compiled.source_text)
    return load_source(compiled.source_text, f"lazytrain_train_schedule_{id(compiled)}")


def vocab_size(model: torch.nn.Module) -> int | None:
    """The model's input vocabulary: Hugging Face's input embeddings, else the first nn.Embedding."""
    if hasattr(model, "get_input_embeddings"):
        return model.get_input_embeddings().num_embeddings
    return next((m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)


def _data(args, source: ModelSource, model: torch.nn.Module, seed: int) -> PackedBatches:
    vocab = vocab_size(model)
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    elif source.tokenizer_dir is not None:
        tokenizer = load_tokenizer(source.tokenizer_dir)
    else:
        tokenizer = builtin_tokenizer()
    paths = args.data or [CORPUS_PATH]
    data = PackedBatches(paths, tokenizer, *source.batch_shape, seed=seed, vocab_size=vocab)
    stats = data.stats
    if stats.truncated or stats.skipped:
        print(f"data: {stats.truncated} of {stats.examples + stats.skipped} examples truncated to "
              f"seq_len {source.batch_shape[1]}, {stats.skipped} skipped (nothing left to learn)", flush=True)
    return data


def _host_gib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def train(args) -> dict:
    source = resolve(args.model or examples.DEFAULT, args.batch_size, args.seq_len, args.weights)
    run_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    schedule = _schedule(args, source, run_dir)
    print(summary(schedule), end="", flush=True)

    torch.manual_seed(args.seed)
    model = source.build_model()
    if source.weights is not None:
        load_weights(model, source.weights)
    found = None
    if run_dir is not None and args.resume:
        found = ckpt.load_latest(run_dir / "checkpoints", schedule.FINGERPRINT)
        if found is not None:  # weights first: binding copies them to the GPU
            _restore_weights(found, model)
    elif run_dir is not None and (run_dir / "checkpoints" / ckpt.LATEST_FILE).exists():
        raise DataError(f"{run_dir} already holds checkpoints; pass --resume to continue that run, or another --checkpoint-dir")
    device = "cuda" if torch.cuda.is_available() else None
    trainer = schedule.bind(model, lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                            device=device)
    data = _data(args, source, model, args.seed)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lr_lambda(warmup, args.steps, args.min_lr_ratio))
    start = 0
    if found is not None:
        _restore_state(found, trainer, scheduler, data)
        start = found.step
        print(f"resumed from {found.path} at step {start}", flush=True)
    report = trainer.memory_report()
    print(f"runtime on {trainer.device}: weight and optimizer slots (at most) {format_size(report['slot_bytes'])}, "
          f"page-locked host buffers {format_size(report['pinned_bytes'])}", flush=True)

    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tokens = source.batch_shape[0] * source.batch_shape[1]
    log = open(args.log or run_dir / "log.jsonl", "a") if (args.log or run_dir) else None
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train", unit="step",
               disable=args.no_progress or not sys.stderr.isatty(), dynamic_ncols=True, mininterval=0.5)
    record = {}
    for step in bar:
        batch = next(data)
        trainer.record_timeline = run_dir is not None and step + 1 == args.steps  # time the last step's events
        t0 = time.perf_counter()
        loss = trainer.step(batch).item()
        if not math.isfinite(loss):
            raise DataError(f"step {step + 1}: the loss is {loss}; lower --lr or check the data")
        scheduler.step()
        seconds = time.perf_counter() - t0
        record = {
            "step": step + 1, "loss": loss, "lr": scheduler.get_last_lr()[0], "step_s": seconds,
            "tokens_per_s": tokens / seconds, "tflops": 6 * n_params * tokens / seconds / 1e12,
            "gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
            "host_gib": _host_gib(),
        }
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", tflops=f"{record['tflops']:.3f}",
                        gpu=f"{record['gpu_gib']:.2f}G", host=f"{record['host_gib']:.2f}G")
        if (step + 1) % args.print_every == 0 or step + 1 == args.steps or step == start:
            bar.write(f"step {step + 1:>5}  loss {loss:.4f}  {record['tokens_per_s']:.0f} tok/s  lr {record['lr']:.2e}")
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()
        done = step + 1
        if run_dir is not None and (done % args.checkpoint_every == 0 or done == args.steps):
            _save(run_dir, done, model, trainer, scheduler, data, schedule.FINGERPRINT)
    bar.close()
    if run_dir is not None and trainer.timeline:
        from lazytrain.timeline import save_measured

        save_measured(run_dir / "measured.json", trainer.timeline, schedule)
        print(f"measured timeline of the last step: {run_dir / 'measured.json'} "
              f"(lazytrain inspect {run_dir / 'schedule.py'} --measured {run_dir / 'measured.json'} --png step.png)")
    if log:
        log.close()
    if args.export_hf:
        trainer.sync_model()
        ckpt.export_hf(model, args.export_hf)
        print(f"exported to {args.export_hf}")
    return record


def _save(run_dir, step, model, trainer, scheduler, data, fingerprint):
    trainer.sync_model()  # weights stepped on the GPU back into the model's masters
    ckpt.save_checkpoint(
        run_dir / "checkpoints", step, model_state={k: v.detach() for k, v in model.state_dict().items()},
        optimizer_state=trainer.state_dict(), fingerprint=fingerprint,
        extra={"data": data.state_dict(), "scheduler": scheduler.state_dict()},
    )


def _restore_weights(found, model):
    with torch.no_grad():
        own = model.state_dict()
        for name, tensor in found.model_state.items():
            own[name].copy_(tensor)


def _restore_state(found, trainer, scheduler, data):
    trainer.load_state_dict(found.optimizer_state)
    scheduler.load_state_dict(found.extra["scheduler"])
    data.load_state_dict(found.extra["data"])
    ckpt.restore_rng(found)
