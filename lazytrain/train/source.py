"""Where a training run's model comes from: a model file, or a Hugging Face config directory.

A model file follows the convention (`build_model()`, `example_batch()`). A directory with a
`config.json` builds `AutoModelForCausalLM.from_config` (no download), with the batch shape from
`--batch-size`/`--seq-len`; weights come from local safetensors when the directory holds them or
`--weights` names a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lazytrain.errors import DataError, TraceError
from lazytrain.ir.capture import check_batch, load_model_file


@dataclass(frozen=True)
class ModelSource:
    path: Path
    build_model: Callable[[], torch.nn.Module]
    batch_shape: tuple[int, int]
    weights: Path | None  # safetensors to load after building
    tokenizer_dir: Path | None  # a tokenizer that ships with the model, if any

    def example_batch(self) -> dict:
        ids = torch.zeros(self.batch_shape, dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


def resolve(model: str | Path, batch_size: int | None, seq_len: int | None, weights: str | None) -> ModelSource:
    path = Path(model)
    if not path.exists():
        raise TraceError(f"model {path} does not exist; pass a model file (.py) or a Hugging Face config directory")
    weights_path = Path(weights) if weights else None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TraceError(f"{path} is a directory without config.json; pass a Hugging Face model directory or a .py model file")
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        config.use_cache = False

        def build_model():
            return AutoModelForCausalLM.from_config(config)

        found = sorted(path.glob("*.safetensors"))
        weights_path = weights_path or (found[0] if len(found) == 1 else None)
        if len(found) > 1 and weights is None:
            raise DataError(f"{path} holds {len(found)} safetensors shards; sharded checkpoints are not read yet, pass one file with --weights")
        shape = (batch_size or 8, seq_len or min(256, getattr(config, "max_position_embeddings", 256)))
        tok = path if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")) else None
        return ModelSource(path, build_model, shape, weights_path, tok)
    build_model, example_batch = load_model_file(path)
    batch = check_batch(example_batch())
    if "input_ids" not in batch or batch["input_ids"].dim() != 2:
        raise TraceError(f"{path}: example_batch() must hold a 2-D input_ids tensor [batch, seq] to train on text")
    shape = tuple(batch["input_ids"].shape)
    if (batch_size and batch_size != shape[0]) or (seq_len and seq_len != shape[1]):
        raise DataError(f"{path} compiles for batch {list(shape)}; --batch-size/--seq-len apply to config directories only")
    return ModelSource(path, build_model, shape, weights_path, None)


def load_weights(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import load_file

    if not path.is_file():
        raise DataError(f"weights file {path} does not exist")
    state = load_file(str(path))
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("inv_freq")]
    unexpected = [k for k in state if k not in own]
    shapes = [k for k in state if k in own and own[k].shape != state[k].shape]
    if missing or unexpected or shapes:
        raise DataError(
            f"weights {path} do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"wrong shape {shapes[:3]}; use the weights saved for this config")
    model.load_state_dict(state, strict=False)
