"""Export a trained Hugging Face model (and its tokenizer) for `from_pretrained`: `lazytrain train
--export-hf`."""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

from lazytrain.errors import CheckpointError
from lazytrain.files import free_bytes, is_disk_full, no_space, replaced_whole
from lazytrain.train.checkpoint import MODEL_FILE
from lazytrain.train.weights import converts_weights

EXPORT_SHARD_SIZE = "5GB"  # the Hugging Face Hub's customary shard size
EXPORT_MARKER = "lazytrain-export.json"  # written last: the directory is an export, and these are its files
NO_ROOM_FIX = ", or pass an --export-hf directory on a disk with room"


def saved_bytes(model: Any) -> int:
    """Bytes of the tensors ``save_pretrained`` writes: the state dict's, each tensor once (tied
    weights once)."""
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_marker(out_dir: Path) -> dict | None:
    """The marker of an earlier export in ``out_dir``; None where there is none or it does not read."""
    try:
        marker = json.loads((out_dir / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def export_hf(model: Any, out_dir: str | Path, tokenizer: Any = None, max_shard_size: int | str = EXPORT_SHARD_SIZE,
              about: dict | None = None) -> Path:
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

    The directory is written whole or not at all (NOTE: [Directories replaced whole] in files.py):
    an earlier ``out_dir`` stays whole until the new one is complete, then is replaced (with any
    files of its own that this export does not write). ``EXPORT_MARKER`` is written last: ``about``
    and the names of the files written. A full disk raises ``ResourceError`` naming the directory
    and the bytes it needs, with nothing left written. Raises ``CheckpointError`` for any other model.
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
    needed = saved_bytes(model)
    try:
        with replaced_whole(out_dir) as tmp:  # leftovers of killed exports removed first
            free = free_bytes(tmp)
            if free is not None and free < needed:  # the old export stays until the new one is complete
                raise no_space(out_dir, needed, NO_ROOM_FIX)
            model.save_pretrained(str(tmp), **kwargs)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            marker = {**(about or {}), "files": sorted(os.listdir(tmp))}
            (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    except Exception as exc:
        if is_disk_full(exc):  # NOTE: [Full disk] in files.py
            raise no_space(out_dir, needed, NO_ROOM_FIX) from None
        raise
    return out_dir
