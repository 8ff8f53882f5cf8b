"""A run's state on disk for `lazytrain train` (loop.py): checkpoints saved where they fit (NOTE:
[Checkpoint room] in room.py), the final weights exported, and a resume's weights and state put
back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from lazytrain.errors import LazytrainError
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.distributed import PeerFailed, Ranks, from_rank0, together
from lazytrain.train.export import export_hf
from lazytrain.train.finite import check_restored, labelled_state, param_names, refuse_nonfinite
from lazytrain.train.preflight import Prepared
from lazytrain.train.resume import LrSchedule, lr_lambda
from lazytrain.train.room import Room


def room_for(args, run_dir, model, schedule, start: int, lr: LrSchedule, ranks: Ranks | None) -> Room | None:
    """The checkpoints' disk checked before the first step (NOTE: [Checkpoint room] in room.py): a
    line for saves that will not fit, and a refusal where the final state fits nowhere."""
    if run_dir is None:
        return None
    room = Room.of(run_dir / "checkpoints", model, schedule, args.export_hf)
    saves = [d for d in range(start + 1, lr.steps + 1) if d % args.checkpoint_every == 0 or d == lr.steps]
    for line in from_rank0(ranks, lambda: room.check(saves, lr.steps), "checking the checkpoints' disk"):
        print(line, flush=True)
    return room


def save_in_room(room: Room, step: int, final: bool, ranks: Ranks | None, save) -> None:
    """`save()` where the checkpoint of `step` fits, else the line saying it is skipped."""
    skipped = from_rank0(ranks, lambda: room.final(step) if final else room.periodic(step), "making room for a checkpoint")
    if skipped:
        print(skipped, flush=True)
    else:
        save()


def export(args, model, trainer, prep: Prepared, ranks: Ranks | None, room: Room | None, step: int,
            save_final) -> None:
    """--export-hf: the weights, tokenizer and marker, written whole (export.py), then the final
    checkpoint (`save_final`; None without a run directory or a step trained). An export that
    fails leaves the final state to the checkpoint: it is saved as in a run without an export,
    then the export's error is raised, naming the checkpoint that holds the trained state."""
    out = Path(args.export_hf)
    trainer.sync_model()
    try:
        with together(ranks, "the export"):
            if ranks is None or ranks.main:
                if room is not None:
                    room.before_export()
                about = {"step": step, "model": str(prep.source.path), "checkpoint_dir": args.checkpoint_dir}
                refuse_nonfinite(step, model.state_dict().items(), "export")  # NOTE: [Finite state] in finite.py
                export_hf(model, out, tokenizer=prep.tokenizer, about=about)
    except Exception as failed:  # every rank: the final checkpoint is a collective save
        if room is None:
            raise
        held = f"the newest checkpoint in {room.root}"
        if save_final is not None:  # as in a run without an export: never skipped for it
            save_in_room(replace(room, export=None), step, True, ranks, save_final)
            held = f"the checkpoint {room.root / ckpt.dir_name(step)}"
        if not isinstance(failed, LazytrainError) or isinstance(failed, PeerFailed):
            raise
        raise type(failed)(f"{failed}; the trained state (step {step}) is in {held}: rerun with --resume to export it "
                           "from there") from None
    print(f"exported the weights of step {step} to {out}", flush=True)
    if save_final is not None:
        save_in_room(room, step, True, ranks, save_final)


def save(run_dir, step, model, trainer, scheduler, data, fingerprint, lr: LrSchedule, prep: Prepared,
          ranks: Ranks | None):
    extra = {"data": data.state_dict(), "scheduler": scheduler.state_dict(), "lr_schedule": lr.record(),
             "world_size": prep.world, "rank_batch": list(prep.rank_batch)}
    if ranks is not None:  # NOTE: [Distributed checkpoints]
        from lazytrain.train import dist_checkpoint

        dist_checkpoint.save(run_dir / "checkpoints", step, ranks, trainer=trainer, model=model, extra=extra,
                             fingerprint=fingerprint)
        return
    trainer.sync_model()  # weights stepped on the GPU back into the model's masters
    model_state, optimizer_state = {k: v.detach() for k, v in model.state_dict().items()}, trainer.state_dict()
    refuse_nonfinite(step, labelled_state(model_state, optimizer_state, param_names(trainer.m)))  # NOTE: [Finite state]
    ckpt.save_checkpoint(run_dir / "checkpoints", step, model_state=model_state, optimizer_state=optimizer_state,
                         fingerprint=fingerprint, extra=extra)


def restore_weights(found, model):
    with torch.no_grad():
        own = model.state_dict()
        for name, tensor in found.model_state.items():
            own[name].copy_(tensor)


def restore_state(found, trainer, scheduler, data, new_lr: LrSchedule | None, rank: int = 0):
    from lazytrain.train.dist_checkpoint import DEFERRED, SHARDED, restore_optimizer

    # First, so that a position over other data is refused before any state is set; it counts the
    # global rows consumed, the same at any world size.
    data.load_state_dict(found.extra["data"])
    restore_optimizer(trainer, found.optimizer_state, found.model_state)
    if DEFERRED in found.optimizer_state.get(SHARDED, {}):  # moments read only now: NOTE: [Finite state]
        check_restored(trainer, found.path)
    scheduler.load_state_dict(found.extra["scheduler"])
    if new_lr is not None:  # --new-lr-schedule: the new peak and curve from the checkpoint's step on
        scheduler.base_lrs = [new_lr.lr for _ in scheduler.base_lrs]
        factor = lr_lambda(new_lr.warmup_steps, new_lr.steps, new_lr.min_lr_ratio)(found.step)
        for group in trainer.optimizer.param_groups:
            group["initial_lr"], group["lr"] = new_lr.lr, new_lr.lr * factor
        scheduler._last_lr = [group["lr"] for group in trainer.optimizer.param_groups]
    ckpt.restore_rng(found, rank)
