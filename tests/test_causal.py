"""Pass `causal`: a constant causal mask becomes `is_causal=True`; any other mask stays."""

import torch
import torch.nn.functional as F
from torch import nn

from lazytrain.ir.capture import capture
from lazytrain.ir.graph import OpKind
from lazytrain.passes.causal import SDPA, _is_causal, causal

from models import hf_pair, model_pair, replay_equals_eager, token_batch


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


def test_a_mask_too_large_to_evaluate_is_proven_by_rows(monkeypatch):
    """Past EVAL_LIMIT (1 x 16384 tokens already is) a mask is proven a block of query rows at a
    time, with every large value elementwise: the Hugging Face mask becomes is_causal=True, a
    sliding window stays, and the rewritten model replays as eager."""
    called = _proven_by_rows(monkeypatch, 32)
    meta, real, batch = hf_pair("qwen2", layers=2, seq=32)
    nodes = _sdpa_nodes(causal(capture(meta, batch)))
    assert called and nodes and not any(_masked(n) for n in nodes)
    replay_equals_eager(meta, real, batch, budget=1 << 30)
    called.clear()
    batch = token_batch(2, 32, 32)
    for kind, rewritten in (("bool", True), ("window", False)):
        meta, _ = model_pair(lambda: _Attn(kind))
        nodes = _sdpa_nodes(causal(capture(meta, batch)))
        assert [not _masked(n) for n in nodes] == [rewritten], kind
    assert called
