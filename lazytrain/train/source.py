"""Where a training run's model comes from: a model file, or a Hugging Face model directory.

A model file follows the convention (`build_model()`, `example_batch()`). A directory with a
`config.json` builds `AutoModelForCausalLM.from_config` (no download), with the batch shape from
`--batch-size`/`--seq-len` (and `position_ids` where packed rows need them: preflight.py); its
weights are the directory's safetensors (one file, or shards with
their index), or the file `--weights` names (`--weights random`: a fresh initialisation), and its
tokenizer is the directory's when it has one. Everything is checked here, before compiling: the
config, the weights' headers against the model built on the meta device (weights.py), and the
tokenizer files' presence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lazytrain.errors import DataError, TraceError, one_line
from lazytrain.ir.capture import check_batch
from lazytrain.ir.model_file import build_on_meta, load_model_file
from lazytrain.train import weights as ckpt_weights

RANDOM = "random"  # --weights random: train from a fresh initialisation
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class ModelSource:
    path: Path
    build_model: Callable[[], torch.nn.Module]
    batch_shape: tuple[int, int]
    weights: ckpt_weights.Weights | None  # checked against the model; loaded after building it
    tokenizer_dir: Path | None  # a tokenizer that ships with the model, if any
    # a model file's example_batch() holds position_ids (NOTE: [Packing] in packing.py); None for a
    # directory, whose batch has them where its rows need them
    file_positions: bool | None = None

    def example_batch(self) -> dict:
        ids = torch.zeros(self.batch_shape, dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}

    def materialize(self, dtype: torch.dtype | None = None,
                    places: dict[str, torch.device] | None = None) -> tuple[torch.nn.Module, list[str]]:
        """The model with its weights: streamed from the checkpoint (NOTE: [Loading weights] in
        weights.py), floating parameters in `dtype` (default: the model's), those `places` names
        on its devices, with the casts done; or freshly initialised (in host memory) when there are
        no weights."""
        if self.weights is None:
            return self.build_model(), []
        with ckpt_weights.parameters_on_meta():
            model = self.build_model()
        return model, ckpt_weights.load(model, self.weights, dtype, places)


def resolve(model: str | Path, batch_size: int | None, seq_len: int | None, weights: str | None) -> ModelSource:
    path = Path(model)
    if not path.exists():
        raise TraceError(f"model {path} does not exist; pass a model file (.py) or a Hugging Face model directory")
    if path.is_dir():
        return _resolve_dir(path, batch_size, seq_len, weights)
    build_model, example_batch = load_model_file(path)
    batch = check_batch(example_batch())
    if "input_ids" not in batch or batch["input_ids"].dim() != 2:
        raise TraceError(f"{path}: example_batch() must hold a 2-D input_ids tensor [batch, seq] to train on text")
    shape = tuple(batch["input_ids"].shape)
    if (batch_size and batch_size != shape[0]) or (seq_len and seq_len != shape[1]):
        raise DataError(f"{path} compiles for batch {list(shape)}; --batch-size/--seq-len apply to model directories only")
    positions = batch.get("position_ids")
    if positions is not None and (tuple(positions.shape) != shape or positions.dtype != torch.long):
        raise TraceError(f"{path}: example_batch()'s position_ids are {str(positions.dtype).removeprefix('torch.')}"
                         f"{list(positions.shape)}; make them int64 {list(shape)}, the shape of input_ids (they "
                         "restart at 0 where each packed sequence starts)")
    found = None
    if weights and weights != RANDOM:
        found = ckpt_weights.read(Path(weights))
        ckpt_weights.check(found, build_on_meta(build_model), str(path))
    return ModelSource(path, build_model, shape, found, None, positions is not None)


def _resolve_dir(path: Path, batch_size: int | None, seq_len: int | None, weights: str | None) -> ModelSource:
    if not (path / "config.json").is_file():
        raise TraceError(f"{path} is a directory without config.json; pass a Hugging Face model directory "
                         "(config.json, safetensors, tokenizer files) or a .py model file")
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many types for one cause: a config it cannot read
        raise TraceError(f"{path / 'config.json'} cannot be read as a Hugging Face config ("
                         f"{one_line(exc)}); restore the config.json that came with the model") from None
    config.use_cache = False

    def build_model():
        return AutoModelForCausalLM.from_config(config)

    if weights == RANDOM:
        checkpoint = None
    else:
        at = Path(weights) if weights else ckpt_weights.find(path)
        if at is None:
            others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
            held = f" (it holds {', '.join(others[:2])}: only safetensors are read)" if others else ""
            raise DataError(
                f"{path} holds config.json but no weights{held}; put the checkpoint's {ckpt_weights.SINGLE_FILE} "
                f"(or its shards and {ckpt_weights.INDEX_FILE}) beside it, pass --weights FILE, or pass "
                f"--weights {RANDOM} to train from a fresh initialisation")
        checkpoint = ckpt_weights.read(at)
        try:
            meta_model = build_on_meta(build_model)
        except Exception as exc:  # an architecture this transformers cannot build
            raise TraceError(f"transformers cannot build a causal LM from {path / 'config.json'} "
                             f"({one_line(exc)}); use a decoder model directory") from None
        ckpt_weights.check(checkpoint, meta_model, str(path / "config.json"))
    shape = (batch_size or 8, seq_len or min(256, getattr(config, "max_position_embeddings", 256)))
    tok = path if any((path / f).is_file() for f in _TOKENIZER_FILES) else None
    return ModelSource(path, build_model, shape, checkpoint, tok)
