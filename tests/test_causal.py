"""Pass `causal`: a constant causal mask becomes `is_causal=True`; any other mask stays."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lazytrain.ir.capture import capture
from lazytrain.ir.graph import OpKind
from lazytrain.analysis.masks import _COMPARE, Rows, _combine, _compare_keys, is_causal_rows
from lazytrain.passes.causal import SDPA, _is_causal, causal

from checks import replay_equals_eager
from models import hf_config, hf_pair, model_pair, token_batch


def _sdpa_nodes(graph):
    return [n for n in graph.of(OpKind.CALL) if n.target == SDPA]


def _masked(node) -> bool:
    return len(node.args) > 3 or "attn_mask" in dict(node.kwargs)


def test_hf_causal_mask_becomes_is_causal_and_its_producers_go():
    meta, _, batch = hf_pair("qwen2", layers=2)
    graph = capture(meta, batch)
    before = _sdpa_nodes(graph)
    assert len(before) == 2 and all(_masked(n) for n in before)  # what export gives: a materialised mask
    after = causal(graph)
    nodes = _sdpa_nodes(after)
    assert len(nodes) == 2 and not any(_masked(n) for n in nodes)
    assert all(dict(n.kwargs)["is_causal"] is True for n in nodes)
    assert dict(nodes[0].kwargs)["scale"] == dict(before[0].kwargs)["scale"]
    square = [n for n in after if getattr(n.value, "dtype", "") == "bool" and n.value.shape[-2:] == (8, 8)]
    assert [n for n in graph if getattr(n.value, "dtype", "") == "bool" and n.value.shape[-2:] == (8, 8)]
    assert not square, f"mask producers left: {[n.name for n in square]}"
    assert len(after) < len(graph)


def test_a_padding_mask_from_the_batch_is_kept():
    meta, _, batch = hf_pair("qwen2", layers=2)
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, :3] = 0
    graph = capture(meta, dict(batch, attention_mask=mask))
    assert all(_masked(n) for n in _sdpa_nodes(causal(graph)))


class _Attn(nn.Module):
    """One attention layer under a mask built in forward from constants."""

    def __init__(self, mask: str, dim: int = 16, vocab: int = 32):
        super().__init__()
        self.mask, self.emb, self.qkv, self.out = mask, nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, vocab)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, -1).permute(2, 0, 3, 1, 4)
        n = x.shape[1]
        pos = torch.arange(n, device=x.device)
        if self.mask == "float":  # additive: 0 on and below the diagonal, -inf above
            m = torch.zeros(n, n, device=x.device).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        elif self.mask == "window":  # causal, but only the last 2 keys: not the causal mask
            m = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 2)
        elif self.mask == "difference":  # causal, through an integer [n, n] value
            m = (pos[:, None] - pos[None, :]) >= 0
        else:
            m = pos[None, :] <= pos[:, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=m).transpose(1, 2).reshape(x.shape)
        return F.cross_entropy(self.out(y).flatten(0, 1), labels.flatten())


def test_only_the_causal_mask_is_rewritten():
    batch = token_batch(2, 6, 32)
    for kind, rewritten in (("bool", True), ("float", True), ("window", False)):
        meta, _ = model_pair(lambda: _Attn(kind))
        nodes = _sdpa_nodes(causal(capture(meta, batch)))
        assert [not _masked(n) for n in nodes] == [rewritten], kind


def test_rewritten_attention_replays_as_eager():
    batch = token_batch(2, 6, 32)
    for kind in ("bool", "float", "window"):
        meta, real = model_pair(lambda: _Attn(kind))
        replay_equals_eager(meta, real, batch, budget=1 << 30)


def test_is_causal_checks_every_slice():
    causal_mask = torch.ones(4, 4, dtype=torch.bool).tril()
    assert _is_causal(causal_mask.expand(3, 1, 4, 4), 4, 4)
    bad = causal_mask.expand(3, 1, 4, 4).clone()
    bad[2, 0, 0, 1] = True
    assert not _is_causal(bad, 4, 4)
    assert not _is_causal(causal_mask, 4, 5)  # queries != keys: is_causal aligns differently
    assert not _is_causal(causal_mask.to(torch.int64), 4, 4)


def _proven_by_rows(monkeypatch, seq: int):
    """Limits at which a mask of `seq` positions is too large to evaluate whole: proven by rows."""
    import lazytrain.passes.causal as pass_causal

    monkeypatch.setattr(pass_causal, "EVAL_LIMIT", 16 * seq * seq // 2)  # large: over half a [seq, seq] mask
    monkeypatch.setattr(pass_causal, "BLOCK_BYTES", 3 * seq)  # a few rows a block
    called = []
    inner = pass_causal._causal_by_rows
    monkeypatch.setattr(pass_causal, "_causal_by_rows", lambda *a: called.append(a[1]) or inner(*a))
    return called


def test_a_mask_the_intervals_cannot_read_is_proven_by_rows(monkeypatch):
    """A mask built with integer arithmetic over [queries, keys] (q - k >= 0) is no interval
    comparison (NOTE: [Masks by rows of intervals] in analysis/masks.py): past EVAL_LIMIT it is
    proven a block of query rows at a time, with every large value elementwise; a window stays."""
    called = _proven_by_rows(monkeypatch, 32)
    batch = token_batch(2, 32, 32)
    for kind, rewritten in (("difference", True), ("window", False)):
        meta, _ = model_pair(lambda: _Attn(kind))
        nodes = _sdpa_nodes(causal(capture(meta, batch)))
        assert [not _masked(n) for n in nodes] == [rewritten], kind
    assert len(called) == 2
    meta, real = model_pair(lambda: _Attn("difference"))
    replay_equals_eager(meta, real, batch, budget=1 << 30)


def _hf(family: str, seq: int, **extra):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaForCausalLM, Qwen2ForCausalLM

    if family == "gemma3":  # layers 0-4 slide over 4 keys, layer 5 attends to all (its pattern is 6)
        cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                               max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa", **extra)
        cls = Gemma3ForCausalLM
    else:
        cfg = hf_config(family, layers=2, vocab=64)
        cls = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}[family]
    with torch.device("meta"):
        model = cls(cfg)
    return model, token_batch(1, seq, 64)


def _no_evaluation(monkeypatch):
    """Evaluating a mask, whole or by rows, fails the test: the intervals must answer alone."""
    import lazytrain.passes.causal as pass_causal

    def refuse(*args):
        raise AssertionError("the mask was evaluated")
    monkeypatch.setattr(pass_causal, "_constant", refuse)
    monkeypatch.setattr(pass_causal, "_causal_by_rows", refuse)


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma3"])
def test_hugging_face_masks_are_read_as_intervals(monkeypatch, family):
    """Transformers' masks (causal, with its packed-sequence term; Gemma3's sliding windows) are
    proven from their O(S) vectors without evaluating the [S, S] mask: the causal ones become
    is_causal=True, a sliding window stays a mask."""
    _no_evaluation(monkeypatch)
    model, batch = _hf(family, 64)
    nodes = _sdpa_nodes(causal(capture(model, batch)))
    rewritten = [not _masked(n) for n in nodes]
    assert rewritten == ([False] * 5 + [True] if family == "gemma3" else [True, True])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_a_million_token_mask_is_proven_without_evaluating_it(monkeypatch, family):
    """At 1 x 1,048,576 tokens the mask would be 1 TiB of booleans: the intervals read it from its
    vectors (bench/compile_time.py times it)."""
    _no_evaluation(monkeypatch)
    seq = 1 << 20
    model, batch = _hf(family, seq)
    nodes = _sdpa_nodes(causal(capture(model, batch)))
    assert [not _masked(n) for n in nodes] == ([False] * 5 + [True] if family == "gemma3" else [True, True])


def _dense(rows, n_keys: int) -> torch.Tensor:
    return rows.at(torch.arange(n_keys).expand(rows.points.shape[0], -1).contiguous())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 12), min_size=1, max_size=10), st.lists(st.integers(-3, 14), min_size=1, max_size=10),
       st.lists(st.integers(-3, 14), min_size=1, max_size=10), st.sampled_from(sorted(_COMPARE)),
       st.sampled_from(sorted(_COMPARE)), st.sampled_from(["and", "or"]), st.booleans(), st.booleans())
def test_intervals_equal_the_dense_mask(keys, q1, q2, op1, op2, how, negate, decreasing):
    """Comparisons of a monotone key vector with query values, combined and negated, as intervals
    per row, equal the same operators on the dense [Q, K] tensors; and the causal check agrees
    with the dense one."""
    k = torch.tensor(sorted(keys, reverse=decreasing))
    n = min(len(q1), len(q2))
    a, b = torch.tensor(q1[:n]), torch.tensor(q2[:n])
    ra, rb = _compare_keys(k, op1, a), _compare_keys(k, op2, b)
    da, db = _COMPARE[op1](k[None, :], a[:, None]), _COMPARE[op2](k[None, :], b[:, None])
    assert torch.equal(_dense(ra, len(k)), da) and torch.equal(_dense(rb, len(k)), db)
    fn = torch.logical_and if how == "and" else torch.logical_or
    both = _combine(ra, rb, fn)
    dense = fn(da, db)
    if negate:
        both, dense = Rows(both.points, ~both.values), ~dense
    assert torch.equal(_dense(both, len(k)), dense)
    if n == len(k):
        assert is_causal_rows(both, len(k)) == bool(torch.equal(dense, torch.ones(n, n, dtype=torch.bool).tril()))


def test_the_causal_check_reads_every_segment():
    n = 6
    j = torch.arange(n)
    causal_rows = _compare_keys(j, "le", j)  # keys j <= query i
    assert is_causal_rows(causal_rows, n)
    assert not is_causal_rows(_compare_keys(j, "lt", j), n)  # the diagonal missing
    assert not is_causal_rows(_combine(causal_rows, _compare_keys(j, "gt", j - 3), torch.logical_and), n)  # a window
