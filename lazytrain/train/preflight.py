"""Everything a training run needs, checked before the compile (minutes on a 7B model).

Flags are range-checked by the argument parser (lazytrain/cli.py). Here: the run directory's state
against `--resume`, the model file (imported, its batch checked, built on the meta device), the
weights file, `--log` and `--export-hf`, the tokenizer and the data (tokenised and checked against
the model's vocabulary), and, when resuming, the checkpoint (read and its digests checked; its
fingerprint and structure need the compiled schedule and are checked right after the compile,
before anything is written). Nothing is written here.

On several ranks every rank runs this (each reads its own slice of the data); the model's batch is
the global batch, which the number of ranks must divide (NOTE: [Data across ranks] in data.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lazytrain import examples
from lazytrain import hardware as hw_profiles
from lazytrain.errors import CheckpointError, DataError
from lazytrain.ir.capture import build_on_meta
from lazytrain.runtime.disk import check_directory
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.checkpoint_load import holds_checkpoints, load_latest
from lazytrain.train.data import CORPUS_PATH, PackedBatches, builtin_tokenizer, load_tokenizer
from lazytrain.train.resume import LrSchedule, settle
from lazytrain.train.source import RANDOM, ModelSource, resolve


@dataclass(frozen=True)
class Prepared:
    source: ModelSource
    meta_model: torch.nn.Module  # names, shapes and dtypes of the model, no storage
    tokenizer: object  # --tokenizer, else the model directory's, else the shipped one
    data: PackedBatches
    run_dir: Path | None
    found: ckpt.Checkpoint | None  # the checkpoint to resume from (digests verified)
    lr: LrSchedule
    lr_notice: str | None  # set when --new-lr-schedule changed the recorded schedule
    world: int  # data-parallel ranks

    @property
    def rank_batch(self) -> tuple[int, int]:
        """One rank's share of the global batch: the shape its schedule is compiled for."""
        rows, seq = self.source.batch_shape
        return rows // self.world, seq


def prepare(args, rank: int = 0, world: int = 1) -> Prepared:
    run_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if run_dir is not None:
        _check_run_dir(run_dir, args.resume)
    if args.offload_dir is not None:  # NOTE: [Disk-resident states] in passes/disk_model.py
        check_directory(args.offload_dir)
    if args.schedule and not Path(args.schedule).is_file():
        raise DataError(f"schedule {args.schedule} does not exist; pass a file written by `lazytrain compile`, "
                        "or drop --schedule to compile on the fly")
    if not args.schedule:
        hw_profiles.load(args.hardware or ("h200" if torch.cuda.is_available() else "cpu"))
    if args.weights and args.weights != RANDOM:
        _check_weights(Path(args.weights))
    source = resolve(args.model or examples.DEFAULT, args.batch_size, args.seq_len, args.weights)
    _check_split(source, world)
    meta_model = build_on_meta(source.build_model)
    if args.export_hf:
        _check_export(meta_model, Path(args.export_hf))
    if args.log:
        log = Path(args.log)
        if log.is_dir() or not log.parent.is_dir():
            raise DataError(f"--log {log}: {'is a directory' if log.is_dir() else f'{log.parent} does not exist'}; "
                            "pass a file path in an existing directory")
    tokenizer = _tokenizer(args, source)
    data = _data(args, source, meta_model, tokenizer, rank, world)
    found = load_latest(run_dir / "checkpoints", None) if args.resume else None
    lr, notice = settle(args, found)
    return Prepared(source, meta_model, tokenizer, data, run_dir, found, lr, notice, world)


def _check_split(source: ModelSource, world: int) -> None:
    """The global batch splits evenly over the ranks."""
    rows = source.batch_shape[0]
    if rows % world:
        fits = ", ".join(str(n) for n in range(1, rows + 1) if rows % n == 0)
        how = "--batch-size" if source.path.is_dir() else f"example_batch() in {source.path}"
        raise DataError(f"the global batch of {rows} rows cannot be split evenly over {world} ranks; run on a number "
                        f"of ranks that divides {rows} ({fits}), or make the global batch a multiple of {world} rows "
                        f"({how}, e.g. {rows + world - rows % world})")


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise CheckpointError(f"--checkpoint-dir {run_dir} is a file; pass a directory")
    holds = holds_checkpoints(run_dir / "checkpoints")
    if resume and not holds:
        raise CheckpointError(f"{run_dir} holds no checkpoint to resume from; drop --resume to start a new run "
                              "there, or pass the --checkpoint-dir of the run to continue")
    if not resume and holds:
        raise CheckpointError(f"{run_dir} already holds checkpoints; pass --resume to continue that run (from its "
                              "newest complete checkpoint), or another --checkpoint-dir")


def _check_weights(path: Path) -> None:
    """The file exists and its safetensors header reads (no tensor is loaded); whether its tensors
    fit the model is the loader's check."""
    if not path.exists():
        raise DataError(f"weights file {path} does not exist; pass a .safetensors file saved for this model, "
                        "or drop --weights")
    if path.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as exc:  # SafetensorError, or OSError for an unreadable file
            raise DataError(f"weights file {path} is not a readable safetensors file ({type(exc).__name__}: "
                            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); pass a .safetensors "
                            "file saved for this model") from None


def _check_export(model: torch.nn.Module, out: Path) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise CheckpointError(f"--export-hf saves Hugging Face models only, and this model is a "
                              f"{type(model).__name__}; drop --export-hf (the checkpoints' {ckpt.MODEL_FILE} holds "
                              "the trained weights)")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--export-hf {out} is a file; pass a directory")


def vocab_size(model: torch.nn.Module) -> int | None:
    """The model's input vocabulary: Hugging Face's input embeddings, else the first nn.Embedding."""
    if hasattr(model, "get_input_embeddings"):
        return model.get_input_embeddings().num_embeddings
    return next((m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)


def _tokenizer(args, source: ModelSource):
    """--tokenizer, else the model directory's, else the shipped one (which only models built for it
    understand: a checkpoint directory without a tokenizer is refused)."""
    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if source.tokenizer_dir is not None:
        return load_tokenizer(source.tokenizer_dir)
    if source.weights is not None and source.path.is_dir():
        raise DataError(f"{source.path} holds weights but no tokenizer (tokenizer.json, tokenizer_config.json or "
                        "tokenizer.model); copy the checkpoint's tokenizer files there, or pass --tokenizer DIR")
    return builtin_tokenizer()


def _data(args, source: ModelSource, model: torch.nn.Module, tokenizer, rank: int, world: int) -> PackedBatches:
    paths = args.data or [CORPUS_PATH]
    data = PackedBatches(paths, tokenizer, *source.batch_shape, seed=args.seed, vocab_size=vocab_size(model),
                         rank=rank, world=world)
    stats = data.stats
    if stats.truncated or stats.skipped:
        print(f"data: {stats.truncated} of {stats.examples + stats.skipped} examples truncated to "
              f"seq_len {source.batch_shape[1]}, {stats.skipped} skipped (nothing left to learn)", flush=True)
    return data
