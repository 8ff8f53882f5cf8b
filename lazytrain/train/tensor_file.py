"""A checkpoint's model weights written as a safetensors file, one tensor at a time.

NOTE: [Streamed weights files]
`safetensors.torch.save_file` writes host tensors it is handed all at once, so a model whose
resident masters live on the GPU (NOTE: [Resident masters on the device] in solver/step_model.py)
had every one of them copied to host memory before the file was begun: memory no plan counts, on a
host a plan may have nearly filled (the 32B at `--budget max` on a 104 GB host plans 95 GiB of it,
bench/README.md). So the weights are written here, in the safetensors
format (an 8-byte little-endian header length, the JSON header padded to 8 bytes, then each
tensor's bytes in header order), each tensor brought to host memory, written and dropped in turn;
one already in host memory (a streamed master, or a master on disk, whose mapping reads the
offload file: NOTE: [Mapped regions] in runtime/disk.py) is written from where it is. Tied names
are written twice, so each loads back as a tensor of its own.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

# the header's dtype names (weights.py reads them with the same table)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def write(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """`tensors` (any devices, any layouts) into a safetensors file at `path`."""
    header, offset = {}, 0
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise ValueError(f"{name} is {t.dtype}, which a safetensors file cannot hold")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors.values():
            if t.numel():
                f.write(_host_bytes(t))


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t` in row-major order, from host memory: its own where it can, else a copy."""
    host = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(host.view(torch.uint8).numpy())
