"""Pass `gqa` (NOTE: [Grouped-query attention unrepeated] in lazytrain/passes/gqa.py): attention reads
its key-value heads unrepeated where it has no mask, and the plan counts what its backward makes."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from lazytrain.analysis.memory import backward_internal_bytes, dq_accumulator_bytes, internal_bytes
from lazytrain.ir.capture import capture
from lazytrain.ir.graph import OpKind
from lazytrain.passes.causal import SDPA, causal
from lazytrain.passes.gqa import gqa


def _graph(model_cls, cfg_cls, kv_heads, mask=False):
    cfg = cfg_cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=kv_heads, max_position_embeddings=64, use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = model_cls(cfg)
    ids = torch.zeros(2, 32, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if mask:  # padding: a mask that depends on the batch, which `causal` leaves a tensor
        batch["attention_mask"] = torch.ones(2, 32, dtype=torch.long)
    return causal(capture(model, batch, "", "cpu"))


def _attention(graph):
    return [n for n in graph.of(OpKind.CALL) if n.target == SDPA]


def test_grouped_query_attention_reads_its_heads_unrepeated():
    for model_cls, cfg_cls in ((Qwen2ForCausalLM, Qwen2Config), (LlamaForCausalLM, LlamaConfig)):
        before = _graph(model_cls, cfg_cls, kv_heads=2)
        after = gqa(before)
        calls = _attention(after)
        assert len(calls) == 2 and all(dict(n.kwargs)["enable_gqa"] for n in calls)
        for n in calls:
            assert [after[a.value].value.shape[1] for a in n.args[1:3]] == [2, 2]  # the key-value heads
        # the repeats are gone: two expands and two reshapes a layer fewer
        targets = [n.target for n in before.of(OpKind.CALL)]
        left = [n.target for n in after.of(OpKind.CALL)]
        assert targets.count("aten.expand.default") - left.count("aten.expand.default") == 4
        assert len(targets) - len(left) == 12


def test_attention_with_one_head_per_key_or_a_mask_is_left_alone():
    whole = _graph(Qwen2ForCausalLM, Qwen2Config, kv_heads=4)
    assert gqa(whole) is whole
    masked = _graph(Qwen2ForCausalLM, Qwen2Config, kv_heads=2, mask=True)
    assert all(len(n.args) > 3 and n.args[3] is not None for n in _attention(masked))  # the mask stayed
    assert gqa(masked) is masked  # with a mask, enable_gqa would run the math kernel


def test_its_backward_counts_the_key_and_value_gradients_at_every_query_head():
    graph = gqa(_graph(Qwen2ForCausalLM, Qwen2Config, kv_heads=2))
    node = _attention(graph)[0]
    q, k, v = (graph[a.value].value for a in node.args[:3])
    # the queries' fp32 gradient accumulator, and the key's and value's gradients at the query's heads
    assert backward_internal_bytes(node, graph) - internal_bytes(node, graph) == \
        dq_accumulator_bytes(q.numel) + (k.nbytes + v.nbytes) * 2
    assert k.nbytes * 2 == q.nbytes


def test_attention_forward_keeps_no_gradient_accumulator():
    """The accumulator of the queries' gradient is the backward's alone (NOTE: [Attention's backward
    workspace]): an unmasked attention's forward counts nothing of its own, so a saving forward's
    workspace is not raised by it."""
    graph = gqa(_graph(Qwen2ForCausalLM, Qwen2Config, kv_heads=2))
    node = _attention(graph)[0]
    q = graph[node.args[0].value].value
    assert internal_bytes(node, graph) == 0
    assert backward_internal_bytes(node, graph) >= dq_accumulator_bytes(q.numel) > 0
