"""Checkpoint weights: find them, check them against the model, stream them into it.

A checkpoint is one safetensors file, or a sharded set named by its index
(`model.safetensors.index.json`, as `save_pretrained` writes for large models). `read` opens only
the headers (names, shapes, dtypes), so everything is checked before a byte of weights is read or
the step compiled. `check` compares the headers with the model built on the meta device: every
parameter present (one name of a tied group is enough: `save_pretrained` keeps the embeddings and
drops a tied `lm_head.weight`), no names the model lacks, shapes equal, the checkpoint's names read as
transformers reads them (NOTE: [Checkpoint names]). Dtypes may differ: `load` casts them and says so once.

NOTE: [Loading weights]
The model is built with its parameters on the meta device (`parameters_on_meta`: no init, no
memory; buffers, which the config determines, stay real), and `load` then reads the checkpoint one
tensor at a time, each straight into a new parameter in the dtype the masters will have (bf16 with
`--master-weights bf16`, else the model's). Host memory peaks at the masters plus one tensor: a
sharded checkpoint is never held in full beside the model. Loading happens before `bind`, into the
model's parameters, because those *are* the masters (NOTE: [Parameter homes] in
runtime/store.py): bind's moves (page-locking streamed masters, device copies of resident ones) go
tensor by tensor, so loading after bind would save no host memory.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from lazytrain.errors import DataError, one_line
from lazytrain.train.tensor_file import DTYPES

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Weights:
    """The tensors of a checkpoint, from its headers: name -> (file, shape, dtype)."""

    origin: Path  # the file or index the user gave, for messages
    files: dict[str, Path]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]


def find(directory: Path) -> Path | None:
    """The checkpoint in a model directory: its index if sharded, else its one safetensors file,
    else None (no safetensors at all)."""
    if (directory / INDEX_FILE).exists():
        return directory / INDEX_FILE
    found = sorted(directory.glob("*.safetensors"))
    if (directory / SINGLE_FILE).is_file():
        return directory / SINGLE_FILE
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise DataError(
            f"{directory} holds {len(found)} safetensors files but no {INDEX_FILE}; restore the index that came "
            "with the shards, or pass one file with --weights")
    return None


def read(path: Path) -> Weights:
    """The headers of a safetensors file or of every shard an index names. Raises `DataError`
    naming the file for a missing or unreadable file or index, or a shard that lacks a tensor its
    index places there."""
    if not path.is_file():
        raise DataError(f"weights {path} do not exist; pass a .safetensors file or a {INDEX_FILE}")
    if path.name.endswith(".json"):
        placed = _read_index(path)
    else:
        placed = None
    files, shapes, dtypes = {}, {}, {}
    for shard in sorted(set(placed.values())) if placed is not None else [path]:
        for name, (shape, dtype) in _read_header(shard, path).items():
            if placed is not None and placed.get(name) != shard:
                continue  # the index places this name in another shard: that one is read
            files[name], shapes[name], dtypes[name] = shard, shape, dtype
    if placed is not None:
        lost = [name for name in placed if name not in files]
        if lost:
            raise DataError(
                f"{placed[lost[0]]} lacks {lost[0]}, which {path} places there ({len(lost)} tensors missing); "
                "download that shard again")
    return Weights(path, files, shapes, dtypes)


def _read_index(path: Path) -> dict[str, Path]:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataError(
            f"index {path} cannot be read ({one_line(exc)}); restore the "
            f'{INDEX_FILE} that came with the shards (a JSON object with a "weight_map")') from None
    first: dict[str, str] = {}
    for name, file in weight_map.items():
        first.setdefault(file, name)
    for file, name in first.items():  # each shard once, named by its first tensor
        _check_inside(path, name, file)
    placed = {name: path.parent / file for name, file in weight_map.items()}
    missing = sorted({p.name for p in placed.values() if not p.is_file()})
    if missing:
        raise DataError(
            f"shard {path.parent / missing[0]} named by {path} does not exist ({len(missing)} of "
            f"{len(set(placed.values()))} shards missing); download the missing shards into {path.parent}")
    return placed


def _check_inside(index: Path, name: str, file: str) -> None:
    """Raise `DataError` unless the shard `file` that `index` names for `name` lies in the index's
    directory, links resolved: a Hub cache snapshot (`models--org--name/snapshots/REV/`, whose files
    link to `../../blobs/HASH`) may also reach its own blobs. Anything else would read files the model
    directory does not hold (`../../x/model.safetensors`, `/etc/passwd`)."""
    folder = index.parent
    roots = [folder.resolve()]
    if folder.parent.name == "snapshots":
        roots.append((folder.parent.parent / "blobs").resolve())
    if Path(file).is_absolute():
        reason = "an absolute path"
    elif not any((folder / file).resolve().is_relative_to(root) for root in roots):
        named_inside = Path(os.path.normpath(folder / file)).is_relative_to(os.path.normpath(folder))
        reason = f"which {'links' if named_inside else 'is'} outside {folder}"
    else:
        return
    raise DataError(f"index {index} places {name} in {file}, {reason}; restore the {INDEX_FILE} that came with the "
                    f"shards, and keep the shards themselves in {folder}")


def _read_header(shard: Path, origin: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from safetensors import safe_open

    try:
        with safe_open(str(shard), "pt") as f:
            out = {}
            for name in f.keys():
                sliced = f.get_slice(name)
                out[name] = (tuple(sliced.get_shape()), DTYPES.get(sliced.get_dtype()))
            return out
    except Exception as exc:  # safetensors raises its own error types for one cause: a bad file
        where = f" (named by {origin})" if shard != origin else ""
        raise DataError(
            f"{shard}{where} is not a readable safetensors file ({one_line(exc)}); "
            "download it again") from None


# --------------------------------------------------------------------------- building and checking


@contextmanager
def parameters_on_meta():
    """Build modules with their parameters on the meta device and their buffers real.

    Parameters are made as usual (torch allocates without touching memory) and replaced by meta
    ones as they are registered, so initialising them costs nothing; buffers such as rotary
    frequencies, computed from the config, keep their values. Tied parameters stay one object.
    """
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _groups(model: torch.nn.Module) -> list[list[str]]:
    """Each parameter's names (several when tied), in module order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return list(names.values())


def _non_persistent(model: torch.nn.Module) -> set[str]:
    out = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for b in module._non_persistent_buffers_set:
            out.add(f"{prefix}.{b}" if prefix else b)
    return out


def converts_weights(model: torch.nn.Module) -> bool:
    """Whether transformers merges or splits this model's tensors between its checkpoint layout
    and its parameters (transformers 5's weight conversions: fused MoE experts). lazytrain reads
    and writes the parameters' own layout."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return False
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # transformers 4 has no conversions
        return False
    return any(isinstance(c, WeightConverter) for c in get_model_conversion_mapping(model))


# NOTE: [Checkpoint names]
# A Hugging Face checkpoint's keys are not always its model's names: GPT-NeoX saves `embed_out.weight`
# for `lm_head.weight`, Granite MoE its experts as `input_linear`, a base model's checkpoint lacks the
# `model.` prefix. `from_pretrained` renames them with the model's own conversion mapping, and
# `save_pretrained` renames back. `check` and `load` apply the same renamings, in the same order with
# the same fallbacks (`rename_source_key` in transformers' core_model_loading.py), so a directory
# transformers loads loads here, and an export (save_pretrained's names) trains again. Only renamings:
# the conversions that merge or split tensors are not applied (`converts_weights`).


def _model_names(weights: Weights, model: torch.nn.Module) -> dict[str, str]:
    """Each checkpoint name -> the model's name for it (NOTE: [Checkpoint names]); the name itself
    for a model that is not a transformers model. Raises `DataError` when two checkpoint names are
    one model name."""
    renamed = {name: name for name in weights.files}
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightRenaming, rename_source_key
        except ImportError:  # transformers 4 renames nothing it can say
            return renamed
        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
        prefix = model.base_model_prefix
        own = dict.fromkeys(model.state_dict(keep_vars=True), True)  # its names: only `get` is read
        for name in weights.files:
            to, _ = rename_source_key(name, renamings, [], prefix, own)
            if to not in own and name in own:  # transformers' fallback: the name as it is
                to, _ = rename_source_key(name, [], [], prefix, own)
            renamed[name] = to
    seen: dict[str, str] = {}
    for name, to in sorted(renamed.items()):
        if to in seen:
            raise DataError(f"weights {weights.origin} hold both {seen[to]} and {name}, which are both the model's "
                            f"{to}; keep one of them")
        seen[to] = name
    return renamed


def check(weights: Weights, model: torch.nn.Module, built_from: str) -> None:
    """Raise `DataError` (one line: the first offending name and the fix) unless `weights` fit
    `model` (on meta or real): every parameter present under one of its names, every tensor a
    parameter or buffer of the model, shapes equal. Non-persistent buffers (computed from the
    config, e.g. old checkpoints' `rotary_emb.inv_freq`) in the checkpoint are ignored; persistent
    buffers it lacks keep the values the model was built with."""
    fix = f"use the weights saved for {built_from}, or a config that matches these weights"
    if converts_weights(model):  # names missing or unexpected: most likely the checkpoint's layout
        fix = ("these are in the layout transformers converts when loading (e.g. one tensor per expert), which "
               "lazytrain does not convert; convert once with AutoModelForCausalLM.from_pretrained(DIR)"
               ".save_pretrained(NEW, save_original_format=False) and train --model NEW")
    named = _model_names(weights, model)
    stored = {to: name for name, to in named.items()}
    for names in _groups(model):
        if not any(n in stored for n in names):
            tied = (" or " + " / ".join(names[1:])) if len(names) > 1 else ""
            hint = _untied_hint(model, names[0])
            raise DataError(f"weights {weights.origin} lack {names[0]}{tied}, which the model built from "
                            f"{built_from} needs; {hint or fix}")
    buffers = {n: b for n, b in model.named_buffers(remove_duplicate=False)}
    # old checkpoints hold rotary frequencies per layer (`model.layers.0.self_attn.rotary_emb.inv_freq`)
    # where the model now keeps one: a name ending like a non-persistent buffer is that buffer
    tails = {".".join(n.split(".")[-2:]) for n in _non_persistent(model)}
    own = dict(model.named_parameters(remove_duplicate=False))
    mismatch = f"the weights saved for {built_from}, or a config that matches these weights"
    for name in sorted(weights.files):
        to = named[name]
        if ".".join(to.split(".")[-2:]) in tails:
            continue
        target = own.get(to, buffers.get(to))
        if target is None:
            raise DataError(f"weights {weights.origin} hold {name}, which the model built from {built_from} "
                            f"does not have; {fix}")
        said = name if to == name else f"{name} (the model's {to})"
        if tuple(target.shape) != weights.shapes[name]:
            raise DataError(f"{said} in {weights.files[name]} has shape {list(weights.shapes[name])} but the model "
                            f"built from {built_from} has {list(target.shape)}; use {mismatch}")
        if weights.dtypes[name] is None or weights.dtypes[name].is_floating_point != target.is_floating_point():
            raise DataError(f"{said} in {weights.files[name]} has dtype {weights.dtypes[name]} but the model "
                            f"built from {built_from} has {target.dtype}; use {mismatch}")


def _untied_hint(model: torch.nn.Module, missing: str) -> str | None:
    """The fix when a checkpoint of tied embeddings meets a config that does not tie them."""
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    outputs = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if inputs is None or outputs is None or outputs.weight is inputs.weight:
        return None
    if not missing.endswith("weight") or model.get_parameter(missing) is not outputs.weight:
        return None
    return ('these weights tie the output embeddings to the input ones: set "tie_word_embeddings": true '
            "in the model's config.json")


# --------------------------------------------------------------------------- loading


def load(model: torch.nn.Module, weights: Weights, dtype: torch.dtype | None = None,
         places: dict[str, torch.device | Callable] | None = None) -> list[str]:
    """Stream `weights` into `model` (built under `parameters_on_meta`, checked with `check`), one
    tensor at a time (NOTE: [Loading weights]). Floating parameters become `dtype` (default: the
    dtype each was built with); a parameter one of whose names `places` holds is made on that device
    (NOTE: [Masters built in place] in runtime/store.py), or by that maker, `(shape, dtype) ->
    tensor` (a master on disk: runtime/disk_masters.py), the rest in host memory. Returns one line
    per kind of cast done, e.g. ``cast 24 tensors from bfloat16 to float32``, for the caller to say
    once."""
    from safetensors import safe_open

    stored = {to: name for name, to in _model_names(weights, model).items()}  # NOTE: [Checkpoint names]
    source = {}  # the model's name read from the checkpoint -> the names it fills
    for names in _groups(model):
        present = [n for n in names if n in stored]
        source[present[0]] = names
    persistent = {n for n, _ in model.named_buffers(remove_duplicate=False)} - _non_persistent(model)
    casts: Counter = Counter()
    by_file: dict[Path, list[str]] = {}
    twins = {n: present for present, names in source.items() for n in names if n != present and n in stored}
    for name in list(source) + sorted(n for n in stored if n in persistent):
        by_file.setdefault(weights.files[stored[name]], []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(str(file), "pt") as f:
                for name in names:
                    tensor = f.get_tensor(stored[name])
                    if name in source:
                        old = model.get_parameter(name)
                        want = dtype if dtype is not None and old.is_floating_point() else old.dtype
                        device = next((places[n] for n in source[name] if n in places), None) if places else None
                        _set_parameter(model, source[name], tensor, want, old.requires_grad, casts, device)
                    else:
                        buf = model.get_buffer(name)
                        if buf.dtype != tensor.dtype:
                            casts[(tensor.dtype, buf.dtype)] += 1
                        buf.copy_(tensor)
                    del tensor
        for name, loaded_as in twins.items():  # another name of a tied parameter: it must hold the same values
            with safe_open(str(weights.files[stored[name]]), "pt") as f:
                _check_twin(weights, stored[name], stored[loaded_as], f.get_tensor(stored[name]),
                            model.get_parameter(loaded_as))
    return [f"cast {n} tensor{'s' * (n > 1)} from {str(a).removeprefix('torch.')} to {str(b).removeprefix('torch.')}"
            for (a, b), n in sorted(casts.items(), key=str)]


def _check_twin(weights, name, loaded_as, tensor, param) -> None:
    if not torch.equal(param, tensor.to(param.dtype)):
        raise DataError(
            f"weights {weights.origin} hold different values for {name} and {loaded_as}, which the model's config "
            'ties into one parameter; set "tie_word_embeddings": false in its config.json to train them apart')


def _set_parameter(model, names, tensor, dtype, requires_grad, casts, device=None) -> None:
    if tensor.dtype != dtype:
        casts[(tensor.dtype, dtype)] += 1
    # `get_tensor` returns a view of the shard's private file mapping: the copy owns its memory, so
    # that nothing reads the file again (an export into the same directory rewrites it).
    made = device(tuple(tensor.shape), dtype) if callable(device) else torch.empty(tensor.shape, dtype=dtype,
                                                                                   device=device or "cpu")
    owned = made.copy_(tensor)
    param = torch.nn.Parameter(owned, requires_grad=requires_grad)
    for name in names:  # tied names share the one new parameter
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = param
