"""Reading a DCP checkpoint's files without running what they hold.

NOTE: [Untrusted DCP files]
torch.distributed.checkpoint reads a checkpoint's `.metadata` with plain `pickle.load`
(`FileSystemReader.read_metadata`) and its plain values (the optimizer's hyperparameters, NOTE:
[Distributed checkpoints] in dist_checkpoint.py) with `torch.load(weights_only=False)`
(`DefaultLoadPlanner.load_bytes`): a crafted file runs whatever callable it names, before any check
of lazytrain's, and meta.json's sha256 do not stop it (whoever crafts the files recomputes them). So
lazytrain reads DCP checkpoints only through `SafeReader` and `SafePlanner`:

- `.metadata` through `_Unpickler`, which resolves exactly the globals DCP's metadata is made of
  (`ALLOWED`, and torch's dtypes: what unpickling the `.metadata` of real saves asked for, by one
  process and by two ranks with sharded DTensors, under torch 2.13) and refuses every other one.
  Dotted names are refused too: pickle resolves `a.b` by getattr, so an allowed class would lend its
  methods (`pathlib.PosixPath.touch`). The metadata must then have the shape DCP writes (`_check`):
  entries of tensors or bytes, stored in files the checkpoint lists, without stream transforms.
- plain values through `torch.load(weights_only=True)`: numbers, strings, tuples, lists and dicts,
  which is all lazytrain stores there. (DCP reads tensors with weights_only=True itself.)

`read_metadata` runs before torch opens the checkpoint (checkpoint_load.py), so a crafted
`.metadata` is one `CheckpointError`; `SafeReader` repeats it for every later read of the directory.
"""

from __future__ import annotations

import io
import pickle
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from lazytrain.errors import CheckpointError, one_line
from lazytrain.train.checkpoint import DCP_METADATA, LATEST_FILE

_META = "torch.distributed.checkpoint.metadata"
ALLOWED = frozenset({
    (_META, "Metadata"), (_META, "MetadataIndex"), (_META, "StorageMeta"), (_META, "TensorProperties"),
    (_META, "TensorStorageMetadata"), (_META, "BytesStorageMetadata"), (_META, "ChunkStorageMetadata"),
    (_META, "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where an entry's bytes are
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # TensorProperties' layout, looked up by its name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the directory the save wrote
})


class _Refused(Exception):
    """A global that DCP's metadata never holds."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if "." not in name:
            if (module, name) in ALLOWED:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _Refused(f"persistent id {str(pid)[:40]!r}")


def _refused(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is refused: {what}; delete it (and {path.parent / LATEST_FILE} if it "
                           "names it) to resume from the previous one")


def read_metadata(path: Path | str, listed=None):
    """The DCP metadata of the checkpoint directory `path`, read without running anything it holds
    and checked to have DCP's shape (NOTE: [Untrusted DCP files]); `listed`: the files its entries
    may be stored in (the ones meta.json lists), else any plain file name. Raises `CheckpointError`."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    try:
        with open(path / DCP_METADATA, "rb") as f:
            metadata = _Unpickler(f).load()
    except _Refused as exc:
        raise _refused(path, f"its {DCP_METADATA} names {exc}, which DCP metadata never holds (unpickling it could "
                             "run any code)") from None
    except Exception as exc:  # noqa: BLE001 -- a torn or foreign file: pickle's errors vary
        raise _refused(path, f"its {DCP_METADATA} is not DCP metadata ({one_line(exc)})") from None
    if not isinstance(metadata, Metadata):
        raise _refused(path, f"its {DCP_METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    reason = _check(metadata, listed)
    if reason is not None:
        raise _refused(path, f"its {DCP_METADATA} {reason}")
    return metadata


def _check(metadata, listed) -> str | None:
    """What about `metadata` DCP never writes, or None."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, MetadataIndex,
                                                       TensorStorageMetadata)

    # getattr throughout: an object unpickled without its fields set lacks them
    entries, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "holds no entries and their storage"
    for key, entry in entries.items():
        if not isinstance(key, str):
            return f"names an entry {key!r}"
        if isinstance(entry, TensorStorageMetadata):
            dtype = getattr(getattr(entry, "properties", None), "dtype", None)
            if not (isinstance(getattr(entry, "size", None), torch.Size) and isinstance(dtype, torch.dtype)
                    and isinstance(getattr(entry, "chunks", None), list)):
                return f"describes the tensor {key} without its size, dtype and chunks"
        elif not isinstance(entry, BytesStorageMetadata):
            return f"describes {key} as a {type(entry).__name__}"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return "holds storage records DCP does not write"
        fqn, name = getattr(index, "fqn", None), getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            return f"stores {fqn} in {name!r}, outside the checkpoint's own files"
        if listed is not None and name not in listed:
            return f"stores {fqn} in {name}, which meta.json does not list"
        transforms = getattr(info, "transform_descriptors", None)
        if transforms:
            return f"reads {fqn} through stream transforms ({', '.join(map(str, transforms))})"
    return None


class SafeReader(FileSystemReader):
    """DCP's file reader, with `.metadata` read by `read_metadata` (NOTE: [Untrusted DCP files])."""

    def read_metadata(self, *args, **kwargs):  # a rank's own metadata too: lazytrain's saves have one
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with plain values read by `torch.load(weights_only=True)` (NOTE:
    [Untrusted DCP files]); `path`: the checkpoint, for messages."""

    def __init__(self, path: Path | str):
        super().__init__()
        self.path = Path(path)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001 -- weights_only refuses with several error types
            raise _refused(self.path, f"its entry {fqn} is not a plain value, as lazytrain stores there "
                                      f"({one_line(exc)})") from None
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes stores it
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


@contextmanager
def first_failure():
    """torch's `CheckpointException` (a BaseException holding every rank's exception and traceback,
    printed over many lines) raised as the exception it holds, for one line of its own."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        cause: BaseException = exc
        while isinstance(cause, CheckpointException) and cause.failures:
            held = next(iter(cause.failures.values()))
            cause = held[0] if isinstance(held, tuple) else held
        if cause is exc:
            raise
        raise cause from None
