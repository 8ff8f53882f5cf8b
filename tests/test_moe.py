"""Mixture-of-experts decoders (Qwen2-MoE, Mixtral: 2 layers, 4 experts, top-2) against eager PyTorch.

Their experts count tokens per expert with `histc`, whose input dtype transformers picks by device
type; a graph captured for another device than the one it runs on fails there (NOTE: [Capture on
the target device] in lazytrain/ir/target.py). At every budget (everything resident, a middle one,
exactly `minimum_budget`): one `forward_backward` gives eager's loss and every gradient, and two
`step`s give torch.optim.AdamW's weights. The routed work is static in the graph, and all experts
of a layer are one block (NOTE: [Routed experts] in lazytrain/passes/costs.py).
"""

from __future__ import annotations

import pytest
import torch

from lazytrain.errors import ScheduleMismatch, TraceError
from lazytrain.ir.capture import capture
from lazytrain.pipeline import compile_model, minimum_budget
from checks import bind_source, check_adamw_steps, check_replay
from models import model_pair, token_batch

GiB = 1 << 30
# eps well above the gradients' float noise: AdamW's first step moves a weight by lr * g / (|g| + eps),
# whose slope in g is up to 1 / (4 eps); at eps=1e-6 a v_proj gradient of 1.5e-6 turned replay-vs-eager
# float noise (1e-9, 1e-8 of the tensor's largest) into 1.7e-6 of weight (AMD EPYC, AVX2, 2026-11-30)
HP = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-4, weight_decay=0.05)
BUDGETS = ("resident", "middle", "minimum")
COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
              attn_implementation="sdpa")


def qwen2_moe(**extra):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                         num_experts=4, **COMMON, **extra)
    return lambda: Qwen2MoeForCausalLM(cfg)


def mixtral(**extra):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(intermediate_size=16, num_local_experts=4, **COMMON, **extra)
    return lambda: MixtralForCausalLM(cfg)


MODELS = {"qwen2_moe": qwen2_moe, "mixtral": mixtral}


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request):
    """One model: (meta, real, batch, {budget name: Compiled}), compiled for the CPU."""
    meta, real = model_pair(MODELS[request.param]())
    batch = token_batch(2, 8, COMMON["vocab_size"])
    smallest = minimum_budget(meta, batch, "cpu")
    budgets = {"resident": GiB, "middle": smallest * 3 // 2, "minimum": smallest}
    compiled = {name: compile_model(meta, batch, b, "cpu", source=request.param, time_limit=20)
                for name, b in budgets.items()}
    return meta, real, batch, compiled


@pytest.mark.parametrize("budget", BUDGETS)
def test_forward_backward_equals_eager(case, budget):
    """Loss and every gradient (router, every expert, shared expert) equal eager within 1e-5."""
    _, real, batch, compiled = case
    check_replay(compiled[budget].source_text, real, batch)


@pytest.mark.parametrize("budget", BUDGETS)
def test_steps_equal_torch_adamw(case, budget):
    """Two `step`s == two steps of torch.optim.AdamW over model.parameters()."""
    _, real, batch, compiled = case
    check_adamw_steps(compiled[budget].source_text, real, batch, 2, **HP)


def test_experts_are_one_block(case):
    """Every layer's router and all of its experts' weights sit in that layer's stage, and the
    smallest budget streams them together."""
    _, _, _, compiled = case
    c = compiled["minimum"]
    for stage, decision in zip(c.stages, c.plan.decisions):
        if not stage.name.startswith("model.layers."):
            continue
        targets = [c.graph[p].target for p in stage.params]
        experts = [t for t in targets if ".experts." in t]
        assert experts and all(t.startswith(stage.name + ".") for t in experts), (stage.name, targets)
    assert any(d.streamed for s, d in zip(c.stages, c.plan.decisions) if s.name.startswith("model.layers."))


def test_schedule_for_the_gpu_refuses_the_cpu():
    """A schedule compiled for a GPU profile carries the GPU's operators (histc on int): binding it
    on the CPU is refused with the fix, not a NotImplementedError from inside a stage."""
    meta, real = model_pair(qwen2_moe())
    batch = token_batch(2, 8, COMMON["vocab_size"])
    c = compile_model(meta, batch, 4 * GiB, "h200", time_limit=20)  # the H200 profile keeps 2.3 GiB for its libraries and allocator
    assert 'DEVICE = "cuda"' in c.source_text
    with pytest.raises(ScheduleMismatch, match=r"compiled for cuda .* bound on cpu.*--hardware cpu"):
        bind_source(c.source_text, real)
    if not torch.cuda.is_available():
        with pytest.raises(ScheduleMismatch, match=r"compiled for cuda .* no usable GPU.*--hardware cpu"):
            bind_source(c.source_text, real, device="cuda")


def test_capture_follows_the_device():
    """The experts' token count takes each device's own path: float `histc` for the CPU, int for
    the GPU; capturing leaves the (meta) model as it was."""
    meta, _ = model_pair(mixtral())
    batch = token_batch(2, 8, COMMON["vocab_size"])
    before = {n: (p.device, p.shape) for n, p in meta.named_parameters()}
    for device, dtype in (("cpu", "float32"), ("cuda", "int32")):
        graph = capture(meta, batch, device=device)
        histc = [n for n in graph if n.target == "aten.histc.default"]
        assert histc and all(graph[n.args[0].value].spec.dtype == dtype for n in histc), device
        assert graph.device == device
    assert {n: (p.device, p.shape) for n, p in meta.named_parameters()} == before


def test_data_dependent_experts_are_refused():
    """The "eager" experts loop over `nonzero()`: a TraceError naming the line, not a torch traceback."""
    meta, _ = model_pair(mixtral(experts_implementation="eager"))
    with pytest.raises(TraceError, match=r"modeling_mixtral\.py:\d+ .*data-dependent"):
        capture(meta, token_batch(2, 8, COMMON["vocab_size"]))
