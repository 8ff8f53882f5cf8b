"""Saved activations (NOTE: [Saved activations] in analysis/saved.py) against what autograd keeps.

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


def test_attention_with_a_boolean_mask_counts_its_bias():
    """A mask `causal` cannot prove (here it depends on the batch's padding) reaches attention as a
    boolean tensor, which attention turns into a bias of the query's dtype in every call and keeps
    for backward (NOTE: [Operator workspace] in analysis/memory.py): each layer's saved bytes and its
    workspace count it. At 65536 tokens that bias is 8 GiB a layer, and uncounted it ran the 7B
    plans out of memory on the H200."""
    meta, real, batch = hf_pair("qwen2", layers=2, batch=2, seq=16)
    batch = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    graph, stages = analyse(meta, batch, hardware.load("cpu"))
    layers = [s for s in stages if s.name.startswith("model.layers.")]
    sdpa = [graph[n] for s in layers for n in s.nodes if graph[n].target == "aten.scaled_dot_product_attention.default"]
    assert sdpa and all(len(n.args) > 3 for n in sdpa)  # the mask stayed
    bias = 2 * 1 * 16 * 16 * 4  # the mask's [B, 1, T, T] in fp32
    _, plain = analyse(*hf_pair("qwen2", layers=2, batch=2, seq=16)[::2], hardware.load("cpu"))
    for s, p in zip(layers, [s for s in plain if s.name.startswith("model.layers.")]):
        assert s.internal_bytes >= bias and s.saved_bytes >= p.saved_bytes + bias


def test_grouped_query_attention_at_the_bench_shape_saves_what_the_plan_counts():
    """A Qwen2.5-1.5B layer's attention (12 heads over 2 KV heads, head size 128, bf16) as the
    schedule runs it, fused on the CPU as on the GPU: attention reads k and v unrepeated and keeps
    them as they were made (NOTE: [Grouped-query attention unrepeated] in passes/gqa.py), and the
    `contiguous` of its transposed output copies nothing (NOTE: [Layouts that decide a copy] in
    passes/costs.py). Counted the other way the plan was 2 KiB a token short per layer, which ran a
    7B plan out of memory on the H200, when the graph still repeated them."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lazytrain.pipeline import compile_model
    from lazytrain.runtime.schedule import load_source
    from models import model_pair, token_batch, unique_name

    cfg = Qwen2Config(vocab_size=128, hidden_size=1536, intermediate_size=512, num_hidden_layers=1, num_attention_heads=12,
                      num_key_value_heads=2, max_position_embeddings=256, use_cache=False, attn_implementation="sdpa")
    meta, _ = model_pair(lambda: Qwen2ForCausalLM(cfg).to(torch.bfloat16))
    batch = token_batch(2, 256, 128)
    hw = hardware.load("cpu")
    graph, stages = analyse(meta, batch, hw)
    module = load_source(compile_model(meta, batch, 1 << 34, hw).source_text, unique_name())
    layer = next(s for s in stages if s.name == "model.layers.0")
    stage = module.STAGES[layer.index]
    torch.manual_seed(0)
    args = [torch.nn.Parameter(torch.randn(module.PLACEHOLDERS[p][2], dtype=torch.bfloat16) * 0.02)
            for p in stage.placeholders]
    args += [torch.randn(graph[x].spec.shape, dtype=getattr(torch, graph[x].spec.dtype)).requires_grad_(x in stage.grad_inputs)
             for x in stage.inputs]
    known = {a.untyped_storage().data_ptr() for a in args}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in known:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage.fn("cpu", *args)
    truth = sum(saved.values())
    assert truth <= layer.saved_bytes <= 1.01 * truth, (truth, layer.saved_bytes)


def test_attention_reaches_more_of_the_matmul_rate_as_its_keys_grow():
    """NOTE: [Attention at length] in passes/costs.py: with `attention_tokens`, the profile's share
    for fused attention is fraction * T / (T + tokens) over T keys, so a 64x longer sequence's
    attention costs less than 64^2 times a short one's; without it, one share for every length."""
    import dataclasses

    from lazytrain.passes.costs import ATTENTION, costs

    def attention_s(hw, seq):
        meta, _, batch = hf_pair("qwen2", layers=1, batch=1, seq=seq)
        graph, _ = analyse(meta, batch, hw)
        table = costs(graph, hw)
        return sum(table[n.name].time_s for n in graph if n.target in ATTENTION)
    flat = dataclasses.replace(hardware.load("cpu"), attention_fraction=0.5, attention_tokens=0.0, op_overhead_s=0.0,
                               mem_bandwidth=1e30)  # compute-bound: time is FLOPs over the rate
    grows = dataclasses.replace(flat, attention_fraction=0.8, attention_tokens=16.0)
    assert grows.attention_share(16) == pytest.approx(0.4) and grows.attention_share(48) == pytest.approx(0.6)
    assert flat.attention_share(16) == flat.attention_share(48) == 0.5
    assert attention_s(flat, 48) / attention_s(flat, 16) == pytest.approx(9.0, rel=0.05)  # causal: T^2
    assert attention_s(grows, 48) / attention_s(grows, 16) == pytest.approx(9.0 * 0.4 / 0.6, rel=0.05)
