"""Export a trained Hugging Face model (and its tokenizer) for `from_pretrained`: `lazytrain train
--export-hf`."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

from lazytrain.errors import CheckpointError
from lazytrain.train.checkpoint import MODEL_FILE
from lazytrain.train.weights import converts_weights

EXPORT_SHARD_SIZE = "5GB"  # the Hugging Face Hub's customary shard size


def export_hf(model: Any, out_dir: str | Path, tokenizer: Any = None, max_shard_size: int | str = EXPORT_SHARD_SIZE) -> Path:
    """Save a ``transformers.PreTrainedModel`` with ``save_pretrained`` as safetensors, and
    ``tokenizer`` (the one it was trained with) beside it, so that ``from_pretrained(out_dir)``
    loads both and ``lazytrain train --model out_dir`` continues from them.

    ``save_pretrained`` semantics: tied weights are saved once, a model larger than
    ``max_shard_size`` is split into shards with a ``model.safetensors.index.json``, and tensors
    the model's conversion mapping renames are saved under their checkpoint names (GPT-NeoX's
    ``lm_head.weight`` as ``embed_out.weight``), which both ``from_pretrained`` and ``lazytrain
    train --model`` read (NOTE: [Checkpoint names] in weights.py). Models whose
    checkpoint layout transformers converts (fused MoE experts) are saved in their parameters'
    layout, which both transformers and ``lazytrain train --model`` load.
    Raises ``CheckpointError`` for any other model.
    """
    # A model cannot be a PreTrainedModel unless transformers is loaded: skip its slow import.
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        raise CheckpointError(
            f"only Hugging Face models (transformers.PreTrainedModel) can be exported, got "
            f"{type(model).__name__}; use {MODEL_FILE} in the checkpoint directory, which holds "
            "this model's weights"
        )
    out_dir = Path(out_dir)
    # transformers 5 always writes safetensors and dropped the flag; 4.x needs it.
    kwargs = {"max_shard_size": max_shard_size}
    accepted = inspect.signature(model.save_pretrained).parameters
    if "safe_serialization" in accepted:
        kwargs["safe_serialization"] = True
    if "save_original_format" in accepted and converts_weights(model):
        # the parameters' own layout (fused experts): transformers loads it as it is, and so does
        # `lazytrain train --model`, which does not apply transformers' weight conversions
        kwargs["save_original_format"] = False
    model.save_pretrained(str(out_dir), **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return out_dir
