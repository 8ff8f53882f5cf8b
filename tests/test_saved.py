"""Saved activations (NOTE: [Saved activations] in passes/saved.py) against what autograd keeps.

Each decoder layer's `saved_bytes` must cover what PyTorch's autograd really saves during that
layer's forward (counted with saved-tensor hooks, one count per storage, parameters and the layer's
inputs left out), and not by much more: the plan's memory rests on it.
"""

import pytest
import torch

from lazytrain import hardware
from lazytrain.pipeline import analyse
from models import hf_pair


def autograd_saved_bytes(model, batch, layer) -> int:
    """Bytes of the storages autograd saves while `layer` runs forward, beyond parameters and inputs."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inputs: set[int] = set()
    saved: dict[int, int] = {}
    inside = [False]

    def enter(module, args, kwargs):
        for a in list(args) + list(kwargs.values()):
            for t in a if isinstance(a, tuple) else (a,):
                if torch.is_tensor(t):
                    inputs.add(t.untyped_storage().data_ptr())
        inside[0] = True

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in params and ptr not in inputs:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    hooks = [layer.register_forward_pre_hook(enter, with_kwargs=True),
             layer.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return sum(saved.values())


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_saved_bytes_cover_autograd_and_stay_close(family, dtype):
    meta, real, batch = hf_pair(family, layers=3, batch=4, seq=16)
    _, stages = analyse(meta.to(dtype), batch, hardware.load("cpu"))
    real = real.to(dtype)
    for s in stages:
        if s.name.startswith("model.layers."):
            truth = autograd_saved_bytes(real, batch, real.get_submodule(s.name))
            assert truth <= s.saved_bytes <= 1.1 * truth, (s.name, truth, s.saved_bytes)
