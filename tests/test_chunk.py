"""Pass `chunk` and the chunked loss stage (NOTE: [Chunked loss] in runtime/trainer.py).

The last stage (final norm, lm_head, cross-entropy) runs in k slices of the batch when it is
provably row-wise and its working set is over `loss_chunk_bytes`. Here a tiny limit forces k > 1,
and the labels carry ignore_index (-100) entries spread unevenly over the rows (one row entirely),
so a mean of the chunks' means would differ from the global mean. Checked: the pass's choice of k,
its refusals, the smaller minimum budget, and replays equal to eager PyTorch (loss, gradients,
gradient accumulation, the clipping norm, weights after AdamW steps).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lazytrain import hardware
from lazytrain.passes.chunk import choose_chunks, decide
from lazytrain.pipeline import analyse, compile_model, minimum_budget
from models import (
    adamw_reference, assert_grads_match, bind_source, eager_grads, hf_pair, model_pair, ragged, tiny_gpt_pair,
    tiny_qwen_pair,
)

HW = hardware.load("cpu")
ATOL, RTOL = 1e-6, 1e-5
# Chunks add float sums in another order than eager, so gradients differ by rounding (~1e-7
# relative). Adam divides by sqrt(v) + eps, which blows up differences in gradients near zero: the
# attention key bias's gradient is exactly zero in exact arithmetic, rounding noise in practice, and
# with eps 1e-6 its update is noise-sized. eps 1e-4 keeps the comparison about the updates.
HP = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-4, weight_decay=0.05)


def last(compiled):
    return compiled.stages[len(compiled.stages) - 1]


def check_chunked(text, real, batch):
    ref_loss, ref_grads = eager_grads(real, batch)
    trainer, model = bind_source(text, real)
    assert_grads_match(model, trainer.forward_backward(batch), ref_loss, ref_grads, ATOL, RTOL)


# ---- the choice of k ------------------------------------------------------------------------------

@pytest.mark.parametrize("batch, working, limit, k", [
    (32, 100, 100, 1),  # fits already
    (32, 10**9, 0, 1),  # off
    (1, 10**9, 100, 1),  # one row cannot be split
    (32, 300, 100, 4),  # 2 chunks leave 150 > 100; 4 leave 75
    (32, 200, 100, 2),  # exactly at the limit
    (12, 500, 100, 6),  # divisors only: 5 does not divide 12
    (7, 200, 100, 7),  # a prime batch: all rows apart
    (32, 10**9, 100, 32),  # nothing is small enough: one row per chunk
])
def test_choose_chunks(batch, working, limit, k):
    assert choose_chunks(batch, working, limit) == k


def test_decide_on_tiny_qwen():
    """k is the smallest divisor of the batch (8) bringing max(peak, 2*saved) under the limit, and
    the chunked stage carries one chunk's working set and nothing saved; other stages are as before."""
    meta, _, batch = tiny_qwen_pair()
    _, plain = analyse(meta, batch, HW, loss_chunk_bytes=0)
    graph, chunked = analyse(meta, batch, HW, loss_chunk_bytes=1)
    epi = plain[len(plain) - 1]
    working = max(epi.peak_bytes, 2 * epi.saved_bytes)
    d = decide(graph, plain, working // 3)
    assert d.chunks == 4, d.reason
    assert d.chunk_bytes == -(-working // 4)  # every node of this epilogue depends on the batch
    assert decide(graph, plain, working).chunks == 1
    assert chunked.stages[:-1] == plain.stages[:-1]
    got = chunked[len(chunked) - 1]
    assert (got.chunks, got.saved_bytes, got.peak_bytes) == (8, 0, -(-working // 8))


# ---- refusals ---------------------------------------------------------------------------------------

class TinyLM(nn.Module):
    """Embedding, two tanh(Linear) blocks, LayerNorm, a head; `loss` picks how logits become the
    loss. Only "mean" is row-wise with a splittable mean; every other variant must be refused."""

    def __init__(self, loss: str = "mean", vocab: int = 64, dim: int = 16):
        super().__init__()
        self.loss = loss
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("class_weight", torch.ones(vocab))

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        logits = self.head(self.norm(x))
        if self.loss == "batch_centered":  # subtracts a mean over the batch: rows mix
            logits = logits - logits.mean(0, keepdim=True)
        if self.loss == "cumsum":
            logits = logits.cumsum(0)
        if self.loss == "mse":
            return logits.pow(2).mean()
        flat = logits.view(-1, logits.shape[-1])
        if self.loss == "fixed_view":  # the flattened size written out: a chunk cannot take it
            flat = logits.reshape(logits.shape[0] * logits.shape[1], logits.shape[2])
        target = labels.reshape(-1)
        kwargs = {"smoothing": dict(label_smoothing=0.1), "sum": dict(reduction="sum"),
                  "weighted": dict(weight=self.class_weight)}.get(self.loss, {})
        return F.cross_entropy(flat, target, **kwargs)


def tiny_lm(loss: str, rows: int = 4, seq: int = 8):
    meta, real = model_pair(lambda: TinyLM(loss))
    g = torch.Generator().manual_seed(3)
    batch = {"input_ids": torch.randint(0, 64, (rows, seq), generator=g),
             "labels": torch.randint(0, 64, (rows, seq), generator=g)}
    return meta, real, batch


@pytest.mark.parametrize("loss, reason", [
    ("smoothing", "label_smoothing=0.1"),
    ("sum", "reduction=2"),
    ("weighted", "weight="),
    ("batch_centered", "reduces over the batch dimension"),
    ("cumsum", "aten.cumsum.default is not known to be row-wise"),
    ("mse", "is not only a aten.cross_entropy_loss.default loss"),
    ("fixed_view", "fixes the leading dimension"),
])
def test_refuses_what_it_cannot_prove_row_wise(loss, reason):
    meta, _, batch = tiny_lm(loss)
    graph, stages = analyse(meta, batch, HW, loss_chunk_bytes=1)
    assert stages[len(stages) - 1].chunks == 1
    assert reason in decide(graph, stages, 1).reason


def test_refuses_a_batch_of_one():
    meta, _, batch = tiny_lm("mean", rows=1)
    graph, stages = analyse(meta, batch, HW, loss_chunk_bytes=1)
    assert stages[len(stages) - 1].chunks == 1
    assert "above 1" in decide(graph, stages, 1).reason


def test_plain_mean_is_chunked_and_exact():
    """The control for the refusals: the same model with a plain mean is chunked and exact."""
    meta, real, batch = tiny_lm("mean")
    batch = ragged(batch)
    c = compile_model(meta, batch, 1 << 30, HW, loss_chunk_bytes=1, time_limit=20)
    assert last(c).chunks == 4
    check_chunked(c.source_text, real, batch)


# ---- replays equal eager ------------------------------------------------------------------------------

MODELS = {"tiny_gpt": tiny_gpt_pair, "tiny_qwen": tiny_qwen_pair}


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request):
    """(name, real model, ragged batch, {budget: chunked Compiled}, smallest budgets off/on)."""
    meta, real, batch = MODELS[request.param]()
    batch = ragged(batch)
    rows = batch["labels"].shape[0]
    limit = 1 if rows == 2 else None  # tiny_gpt: 2 chunks; tiny_qwen: 2 rows per chunk (below)
    if limit is None:
        _, plain = analyse(meta, batch, HW, loss_chunk_bytes=0)
        epi = plain[len(plain) - 1]
        limit = max(epi.peak_bytes, 2 * epi.saved_bytes) // 4
    smallest = minimum_budget(meta, batch, HW, loss_chunk_bytes=limit)
    compiled = {name: compile_model(meta, batch, b, HW, loss_chunk_bytes=limit, time_limit=20)
                for name, b in (("resident", 1 << 30), ("minimum", smallest))}
    return request.param, real, batch, compiled


@pytest.mark.parametrize("budget", ["resident", "minimum"])
def test_chunked_forward_backward_equals_eager(case, budget):
    _, real, batch, compiled = case
    c = compiled[budget]
    assert last(c).chunks == {2: 2, 8: 4}[batch["labels"].shape[0]]
    assert max(c.memory_trace) <= c.plan.budget
    check_chunked(c.source_text, real, batch)


def test_chunked_gradients_accumulate(case):
    """Two forward_backward calls: the second scales only its own part of the loss stage's
    gradients (tied embeddings in tiny_gpt already hold the prologue's part)."""
    _, real, batch, compiled = case
    ref_loss, ref_grads = eager_grads(real, batch, times=2)
    trainer, model = bind_source(compiled["minimum"].source_text, real)
    trainer.forward_backward(batch)
    assert_grads_match(model, trainer.forward_backward(batch), ref_loss, ref_grads, ATOL, RTOL)


@pytest.mark.parametrize("budget", ["resident", "minimum"])
def test_chunked_steps_equal_torch_adamw(case, budget):
    _, real, batch, compiled = case
    trainer, model = bind_source(compiled[budget].source_text, real, **HP)
    for _ in range(3):
        trainer.step(batch)
    trainer.synchronize()
    ref = adamw_reference(real, batch, 3, **HP)
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), \
            f"{name} differs from torch.optim.AdamW by {(got - want).abs().max().item():.3g}"


def test_chunked_clipping_norm_equals_torch(case):
    """The global gradient norm counts the chunked stage's gradients once, scaled."""
    _, real, batch, compiled = case
    trainer, _ = bind_source(compiled["minimum"].source_text, real, max_grad_norm=0.01, **HP)
    trainer.step(batch)
    ref = copy.deepcopy(real)
    out = ref(**batch)
    (out.loss if hasattr(out, "loss") else out).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert trainer.last_grad_norm == pytest.approx(norm.item(), rel=1e-5)


# ---- memory ---------------------------------------------------------------------------------------------

def test_smallest_budget_drops_with_chunking():
    """A vocabulary large beside the model (2048 x hidden 32): the loss stage sets the minimum
    budget; chunked, the minimum drops, and a plan at it is still exact."""
    meta, real, batch = hf_pair("qwen2", layers=2, batch=4, seq=16, vocab=2048)
    batch = ragged(batch)
    plain = minimum_budget(meta, batch, HW, loss_chunk_bytes=0)
    chunked = minimum_budget(meta, batch, HW, loss_chunk_bytes=1)
    assert chunked < plain * 0.6
    c = compile_model(meta, batch, chunked, HW, loss_chunk_bytes=1, time_limit=20)
    assert last(c).chunks == 4 and c.plan.peak_bytes == chunked
    check_chunked(c.source_text, real, batch)
