"""Everything a training run needs, checked before the compile (minutes on a 7B model).

Flags are range-checked by the argument parser (lazytrain/cli.py). Here: the run directory's state
against `--resume`, the model file (imported, its batch checked, built on the meta device), its
sequence length against its positions, the weights file, `--log` (a new run erases no existing file
but its run directory's own log unless told to) and `--export-hf` (never over the model trained
from, files that are no export, or the run's own outputs), the tokenizer and the data (tokenised,
checked against the model's vocabulary and laid out as the model can take it: run_data.py), and, when resuming, the checkpoint (read and its
digests checked; its fingerprint and structure need the compiled schedule and are checked right
after the compile, before anything is written). Every output's place is probed for writing
(`files.cannot_write`: an entry made and removed there); nothing else is written here.

On several ranks every rank runs this (each reads its own slice of the data); the model's batch is
the global batch, which the number of ranks must divide (NOTE: [Data across ranks] in data.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import re

import torch

from lazytrain import examples
from lazytrain import hardware as hw_profiles
from lazytrain.errors import CheckpointError, DataError
from lazytrain.files import cannot_write, nearest_existing
from lazytrain.ir.model_file import build_on_meta
from lazytrain.runtime.disk import check_directory
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.checkpoint_load import holds_checkpoints, load_latest
from lazytrain.train.data import PackedBatches, builtin_tokenizer, load_tokenizer
from lazytrain.train.evaluation import EvalSet
from lazytrain.train.export import EXPORT_MARKER, read_marker
from lazytrain.train.packing import Layout
from lazytrain.train.resume import LrSchedule, settle
from lazytrain.train.run_data import run_data, zeros
from lazytrain.train.source import RANDOM, ModelSource, resolve
from lazytrain.units import format_size

# Names of learned position tables (GPT-2's `wpe`, OPT's `embed_positions`, `position_embeddings`, ...).
_POSITION_TABLE = re.compile(r"(^|_)(wpe|pos|position|positions|positional)(_|$)")


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
    eval_set: EvalSet | None  # --eval-data
    layout: Layout  # how the rows are filled (NOTE: [Packing] in packing.py)
    inputs: tuple[str, ...]  # what the step takes: input_ids, labels[, position_ids]

    def batch(self, shape) -> dict[str, torch.Tensor]:
        """A batch of the step's inputs in `shape`, zeros: what it is compiled for."""
        return zeros(self.inputs, shape)

    @property
    def rank_batch(self) -> tuple[int, int]:
        """One rank's share of the global batch: the shape its schedule is compiled for."""
        rows, seq = self.source.batch_shape
        return rows // self.world, seq


def prepare(args, rank: int = 0, world: int = 1) -> Prepared:
    run_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if run_dir is not None:
        _check_run_dir(run_dir, args.resume)
    if args.offload_dir is not None:  # NOTE: [Disk-resident states] in solver/disk_model.py
        check_directory(args.offload_dir)
    if args.schedule and not Path(args.schedule).is_file():
        raise DataError(f"schedule {args.schedule} does not exist; pass a file written by `lazytrain compile`, "
                        "or drop --schedule to compile on the fly")
    if not args.schedule:
        hardware(args)
    if args.weights and args.weights != RANDOM:
        _check_weights(Path(args.weights))
    source = resolve(args.model or examples.DEFAULT, args.batch_size, args.seq_len, args.weights)
    _check_split(source, world)
    meta_model = build_on_meta(source.build_model)
    _check_positions(source, meta_model)
    if args.export_hf:
        _check_export(meta_model, Path(args.export_hf), source, args, run_dir)
    if args.log:
        _check_log(Path(args.log), run_dir, args.resume, args.overwrite_log)
    tokenizer = _tokenizer(args, source)
    data = run_data(args, source, meta_model, tokenizer, vocab_size(meta_model), rank, world, lambda: device_type(args))
    seq = source.batch_shape[1]
    said = (data.train.stats.describe(seq), data.train.packing.describe(seq, data.layout, data.train.stats.documents),
            data.eval.describe() if data.eval else None)
    for line in said:
        if line and rank == 0:
            print(line, flush=True)
    found = load_latest(run_dir / "checkpoints", None) if args.resume else None
    lr, notice = settle(args, found)
    return Prepared(source, meta_model, tokenizer, data.train, run_dir, found, lr, notice, world, data.eval, data.layout,
                    data.inputs)


def hardware(args):
    """The hardware profile a step is compiled for: --hardware, else h200 where a GPU is, else cpu."""
    return hw_profiles.load(args.hardware or ("h200" if torch.cuda.is_available() else "cpu"))


def device_type(args) -> str:
    """The device type the step runs and is captured for: the --schedule's, else the hardware profile's."""
    if args.schedule:
        from lazytrain.runtime.schedule import load_schedule

        return load_schedule(args.schedule).DEVICE
    return hardware(args).device


def _check_split(source: ModelSource, world: int) -> None:
    """The global batch splits evenly over the ranks."""
    rows = source.batch_shape[0]
    if rows % world:
        fits = ", ".join(str(n) for n in range(1, rows + 1) if rows % n == 0)
        how = "--batch-size" if source.path.is_dir() else f"example_batch() in {source.path}"
        raise DataError(f"the global batch of {rows} rows cannot be split evenly over {world} ranks; run on a number "
                        f"of ranks that divides {rows} ({fits}), or make the global batch a multiple of {world} rows "
                        f"({how}, e.g. {rows + world - rows % world})")


def _check_writable(flag: str, path: Path, where: Path, error: type, fix: str) -> None:
    """An entry can be made in `where` (or its nearest existing parent), where `flag`'s output goes."""
    where = nearest_existing(where)
    exc = cannot_write(where)
    if exc is not None:
        raise error(f"{flag} {path} cannot be written: making an entry in {where} fails "
                    f"({exc.strerror or type(exc).__name__}); {fix}")


def _within(path: Path, top: Path) -> bool:
    path, top = path.resolve(), top.resolve()
    return path == top or top in path.parents


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise CheckpointError(f"--checkpoint-dir {run_dir} is a file; pass a directory")
    _check_writable("--checkpoint-dir", run_dir, run_dir, CheckpointError, "pass a directory where you can write")
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


def _check_export(model: torch.nn.Module, out: Path, source: ModelSource, args, run_dir: Path | None) -> None:
    """An export replaces its directory whole (NOTE: [Directories replaced whole] in files.py), so it
    goes where nothing else is lost: never over the run's own outputs, and, unless
    --overwrite-export, not onto the --model directory, nor onto a directory that holds anything
    but an earlier export (the files its marker names)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise CheckpointError(f"--export-hf saves Hugging Face models only, and this model is a "
                              f"{type(model).__name__}; drop --export-hf (the checkpoints' {ckpt.MODEL_FILE} holds "
                              "the trained weights)")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--export-hf {out} is a file; pass a directory")
    fix = "pass a directory where you can write"
    _check_writable("--export-hf", out, out.parent, CheckpointError, fix)  # its temp directory goes beside it
    if out.is_dir():  # the old export's files are removed from it
        _check_writable("--export-hf", out, out, CheckpointError, fix)
    for flag, kept in (("--checkpoint-dir", run_dir), ("--log", args.log), ("--offload-dir", args.offload_dir)):
        if kept is not None and _within(Path(kept), out):
            raise CheckpointError(f"--export-hf {out} holds {flag} {kept}, which replacing the export would remove; "
                                  f"pass an --export-hf directory outside it")
    if args.overwrite_export:
        return
    if source.path.is_dir() and out.resolve() == source.path.resolve():
        raise CheckpointError(f"--export-hf {out} is the --model directory this run trains from: the export would "
                              "overwrite its weights and tokenizer; pass another directory, or --overwrite-export to "
                              "replace them")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and EXPORT_MARKER not in held:
        raise CheckpointError(f"--export-hf {out} holds {_names(held)}, and is not an earlier export (it has no "
                              f"{EXPORT_MARKER}); pass a new or empty directory, or --overwrite-export to replace it")
    written = (read_marker(out) or {}).get("files") if held else None
    others = [n for n in held if n != EXPORT_MARKER and n not in written] if isinstance(written, list) else []
    if others:
        raise CheckpointError(f"--export-hf {out} is an earlier export that also holds {_names(others)}, which it did "
                              "not write and replacing it would remove; move them out, or pass --overwrite-export to "
                              "replace them too")


def _names(held: list[str]) -> str:
    return ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")


def _check_log(log: Path, run_dir: Path | None, resume: bool, overwrite: bool) -> None:
    """--log goes in a writable directory; a new run writes its log from its first step, so an existing
    one that is not the run directory's own is refused unless --overwrite-log (a resumed run's log
    is its own, trimmed to the checkpoint's step)."""
    if log.is_dir() or not log.parent.is_dir():
        raise DataError(f"--log {log}: {'is a directory' if log.is_dir() else f'{log.parent} does not exist'}; "
                        "pass a file path in an existing directory")
    _check_writable("--log", log, log.parent, DataError, "pass a file in a directory where you can write")
    if resume or overwrite or not log.is_file() or log.stat().st_size == 0:
        return
    if run_dir is not None and log.resolve() == (run_dir / "log.jsonl").resolve():
        return
    raise DataError(f"--log {log} already holds {format_size(log.stat().st_size)}, which a new run would erase (it "
                    "writes its log from step 1); pass a new --log file, --overwrite-log to replace it, or --resume "
                    "to continue the run it logs")


def _check_positions(source: ModelSource, model: torch.nn.Module) -> None:
    """Refuse a sequence longer than a learned position table (it would index past it at the first
    step); say once where a rotary model runs past the positions its config says it was trained on."""
    seq = source.batch_shape[1]
    where = "--seq-len" if source.path.is_dir() else f"example_batch() in {source.path}"
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    config = getattr(model, "config", None)
    for name, module in model.named_modules():
        if not (isinstance(module, torch.nn.Embedding) and module is not inputs
                and _POSITION_TABLE.search(name.rsplit(".", 1)[-1])):
            continue
        limit = module.num_embeddings - getattr(module, "offset", 0)  # OPT keeps 2 rows ahead of position 0
        if seq > limit:
            key = getattr(config, "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")
            held = f" ({key} {limit} in {source.path / 'config.json'})" if source.path.is_dir() else ""
            raise DataError(f"{where} gives {seq} positions, and {type(model).__name__} learned {limit}{held}: its "
                            f"position embeddings ({name}) have no row for position {limit}; "
                            + (f"pass --seq-len {limit} or less" if source.path.is_dir()
                               else f"make example_batch()'s sequences {limit} tokens or shorter"))
        return
    trained = getattr(config, "max_position_embeddings", None)
    rotary = any("Rotary" in type(m).__name__ for m in model.modules())
    if rotary and isinstance(trained, int) and seq > trained:
        print(f"warning: {where} gives {seq} positions, past the {trained} that {type(model).__name__} was trained on "
              f"(max_position_embeddings in its config): its rotary embeddings run there {_rope_scaling(config, seq, trained)}, "
              f"but the model has not learnt those positions; use {trained} or fewer, or a model with a longer context",
              flush=True)


def _rope_scaling(config, seq: int, trained: int) -> str:
    """How the config's RoPE runs past its trained length: its scaling (`rope_parameters`, or
    `rope_scaling` before transformers 5), or none, with the setting that would add one."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = next(iter(params.values()))  # per layer type (Gemma3): the first type's
    kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
    if kind in (None, "default"):
        factor = -(-seq // trained)
        return (f"unscaled (no RoPE scaling in its config: rope_parameters with e.g. \"rope_type\": \"yarn\", "
                f"\"factor\": {factor}.0 would stretch the trained positions over {seq})")
    factor = params.get("factor")
    return f"with its config's RoPE scaling ({kind}" + (f", factor {factor}" if factor else "") + ")"


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
