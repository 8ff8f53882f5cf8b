"""Qwen2.5 model shapes for benchmarks, built without Hugging Face's slow init.

`meta_model(name)` builds on the meta device (for compiling); `host_model(name)` materialises fp32
weights on the host, filled with small random values in large chunks on the GPU when there is one
(a 7B model is ready in seconds; Hugging Face's own init takes minutes on a CPU).
"""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-14b": (5120, 13824, 48, 40, 8, 152064, False),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064, False),
    "qwen2.5-72b": (8192, 29568, 80, 64, 8, 152064, False),
}


def config(name: str, seq: int) -> Qwen2Config:
    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[name]
    return Qwen2Config(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=max(seq, 4096),
        rope_theta=1e6, rms_norm_eps=1e-6, use_cache=False, attn_implementation="sdpa",
    )


def meta_model(name: str, seq: int) -> torch.nn.Module:
    with torch.device("meta"):
        return Qwen2ForCausalLM(config(name, seq))


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def fill_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights (std 0.02, norms at 1, rotary tables recomputed) on the model's device."""
    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=gen_device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.device.type == gen_device:
            p.normal_(0.0, 0.02, generator=g)
            _check_finite(name, p)
        else:  # drawn in fp32 where the generator is, cast there (the same values), then copied
            t = torch.empty(p.shape, device=gen_device).normal_(0.0, 0.02, generator=g).to(p.dtype)
            _check_finite(name, t)
            p.copy_(t)
    for module in model.modules():  # buffers come out of to_empty() uninitialised: rebuild them
        if hasattr(module, "inv_freq"):
            fresh = type(module)(module.config)
            module.inv_freq.copy_(fresh.inv_freq)
            module.original_inv_freq.copy_(fresh.original_inv_freq)
    return model


def build(name: str, seq: int, device: str, dtype: torch.dtype, seed: int = 0,
          places: dict | None = None) -> torch.nn.Module:
    """The model with random weights on `device`; a parameter `places` names goes to its device
    there instead (or is made by its maker, `(shape, dtype) -> tensor`: a master on disk), made and
    filled in place, so the host never holds the whole model."""
    model = meta_model(name, seq).to(dtype).to_empty(device=device) if not places else _placed(name, seq, dtype, device, places)
    model.tie_weights()  # to_empty() gives each module its own tensor: tie the embeddings again
    model.train()
    return fill_(model, seed)


def for_schedule(module, name: str, seq: int, dtype: torch.dtype, seed: int = 0, masters=None) -> torch.nn.Module:
    """`build` in the tiers a schedule keeps its masters in: resident blocks' on the GPU, streamed
    blocks' on the host (NOTE: [Resident masters on the device] in solver/step_model.py), and those
    on disk in `masters` (runtime/disk_masters.py), settled once filled."""
    from lazytrain.runtime.store import resident_targets

    places = dict.fromkeys(resident_targets(module), "cuda") if module.DEVICE == "cuda" else {}
    for p in masters.layout if masters is not None else ():
        places[module.PLACEHOLDERS[p][1]] = masters.place(p)
    model = build(name, seq, "cpu", dtype, seed, places or None)
    if masters is not None:
        masters.settle()
    return model


def _placed(name: str, seq: int, dtype: torch.dtype, device: str, places: dict[str, str]) -> torch.nn.Module:
    model = meta_model(name, seq).to(dtype)  # cast on meta: no full-size fp32 pass
    for full, p in list(model.named_parameters()):
        owner, _, leaf = full.rpartition(".")
        module = model.get_submodule(owner)
        place = places.get(full, device)
        made = place(tuple(p.shape), p.dtype) if callable(place) else torch.empty_like(p, device=place)
        module._parameters[leaf] = torch.nn.Parameter(made, requires_grad=p.requires_grad)
    for full, b in list(model.named_buffers()):
        owner, _, leaf = full.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = torch.empty_like(b, device=device)
    return model


def _check_finite(name: str, t: torch.Tensor) -> None:
    if not torch.isfinite(t).all():
        raise ValueError(f"non-finite values in {name} after filling")


def batch(name: str, batch_size: int, seq: int, device: str = "cpu", seed: int = 0) -> dict:
    vocab = SHAPES[name][5]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}
