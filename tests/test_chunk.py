"""Pass `chunk` and the chunked loss stage (NOTE: [Chunked loss] in runtime/chunked.py).

The last stage (final norm, lm_head, cross-entropy) runs in k slices of the batch, whole rows or
pieces of rows (tokens), when it provably keeps them apart and its working set is over
`loss_chunk_bytes`. Here a small limit forces k > 1, and the labels carry ignore_index (-100)
entries spread unevenly over the rows and positions (one row entirely), so a mean of the chunks'
means would differ from the global mean. Checked: the pass's choice of k, its refusals, the smaller
minimum budget, the loss's fp32 workspace in the plan, and replays equal to eager PyTorch (loss,
gradients, gradient accumulation, the clipping norm, weights after AdamW steps).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lazytrain import hardware
from lazytrain.passes.chunk import choose_chunks, choose_tokens, decide, whole_nodes, working_bytes
from lazytrain.pipeline import analyse, compile_model, minimum_budget
from checks import assert_grads_match, bind_source, check_adamw_steps, eager_grads
from models import hf_pair, model_pair, ragged, tiny_gpt_pair, tiny_qwen_pair

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


@pytest.mark.parametrize("rows, seq, working, limit, n", [
    (1, 10, 1000, 100, 1),  # a tenth of a row: one position per chunk
    (1, 10, 1000, 50, 1),  # nothing is small enough: one position per chunk
    (2, 12, 2400, 500, 4),  # 5 positions fit; 3 pieces a row either way, so 4, 4, 4 rather than 5, 5, 2
    (1, 10, 1000, 450, 4),  # 4 fit: pieces of 4, 4, 2
    (1, 65536, 8 * 10**9, 10**9, 8192),  # an eighth of the sequence
])
def test_choose_tokens(rows, seq, working, limit, n):
    assert choose_tokens(rows, seq, working, limit) == n
    assert -(-working * n // (rows * seq)) <= limit or n == 1


def test_decide_on_tiny_qwen():
    """k is the smallest divisor of the batch (8) bringing the working set (forward peak, or saved
    values, their gradients and the loss's log-probabilities) under the limit; the chunked stage
    carries one chunk's working set and nothing saved; other stages are as before. Below one row's
    share, rows are cut into pieces of positions."""
    meta, _, batch = tiny_qwen_pair()
    _, plain = analyse(meta, batch, HW, loss_chunk_bytes=0)
    epi = plain[len(plain) - 1]
    working = max(epi.peak_bytes, 2 * epi.saved_bytes + epi.internal_bytes)
    assert working_bytes(epi) == working and epi.internal_bytes > 0
    graph, chunked = analyse(meta, batch, HW, loss_chunk_bytes=working // 8)
    # The label shift (labels only) runs whole: its results stay for every chunk, counted once.
    whole = whole_nodes(graph, epi)
    assert {graph[n].target for n in whole} >= {"aten.pad.default", "aten.slice.Tensor"}
    d = decide(graph, plain, working // 3)
    assert (d.chunks, d.chunk_len, d.whole) == (4, 0, whole), d.reason
    fixed = d.chunk_bytes - -(-working // 4)  # every other node of this epilogue depends on the batch
    assert 0 < fixed <= sum(graph[n].spec.nbytes for n in whole)
    assert decide(graph, plain, working).chunks == 1
    assert chunked.stages[:-1] == plain.stages[:-1]
    got = chunked[len(chunked) - 1]
    assert (got.chunks, got.saved_bytes, got.internal_bytes, got.peak_bytes) == (8, 0, 0, -(-working // 8) + fixed)
    d = decide(graph, plain, working // 32)  # a quarter of a row (64 positions)
    assert (d.chunks, d.chunk_len) == (32, 16), d.reason
    assert "32 chunks along tokens" in d.reason


# ---- refusals ---------------------------------------------------------------------------------------

class TinyLM(nn.Module):
    """Embedding, two tanh(Linear) blocks, LayerNorm, a head; `loss` picks how logits become the
    loss. Only "mean" (and "seq_centered", along rows) is cut exactly; every other variant must be refused."""

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
        if self.loss == "seq_centered":  # subtracts a mean over each row's positions: positions mix
            logits = logits - logits.mean(1, keepdim=True)
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


def test_seq_centered_is_still_cut_along_rows():
    """Mixing positions within a row rules out tokens, not rows: below one row's share, the finest
    cut is one row per chunk, and it is exact."""
    meta, real, batch = tiny_lm("seq_centered")
    batch = ragged(batch)
    graph, stages = analyse(meta, batch, HW, loss_chunk_bytes=0)
    assert "not along tokens: mean: reduces over the sequence dimension" in decide(graph, stages, 1).reason
    c = compile_model(meta, batch, 1 << 30, HW, loss_chunk_bytes=1, time_limit=20)
    assert (last(c).chunks, last(c).chunk_len) == (4, 0)
    check_chunked(c.source_text, real, batch)


def test_a_batch_of_one_is_cut_along_tokens():
    """One row cannot be cut into rows; its positions can (TinyLM flattens logits and labels)."""
    meta, real, batch = tiny_lm("mean", rows=1, seq=12)
    batch["labels"][0, 2:7] = -100
    c = compile_model(meta, batch, 1 << 30, HW, loss_chunk_bytes=1, time_limit=20)
    assert (last(c).chunks, last(c).chunk_len) == (12, 1)
    check_chunked(c.source_text, real, batch)


def test_plain_mean_is_chunked_and_exact():
    """The control for the refusals: the same model with a plain mean is chunked and exact, along
    rows when whole rows are enough, along tokens when they are not."""
    meta, real, batch = tiny_lm("mean")
    batch = ragged(batch)
    _, stages = analyse(meta, batch, HW, loss_chunk_bytes=0)
    working = working_bytes(stages[len(stages) - 1])
    for limit, chunks, chunk_len in ((working // 4, 4, 0), (1, 32, 1)):
        c = compile_model(meta, batch, 1 << 30, HW, loss_chunk_bytes=limit, time_limit=20)
        assert (last(c).chunks, last(c).chunk_len) == (chunks, chunk_len)
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
        limit = working_bytes(plain[len(plain) - 1]) // 4
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
    check_adamw_steps(compiled[budget].source_text, real, batch, 3, **HP)


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
    assert (last(c).chunks, last(c).chunk_len) == (64, 1) and c.plan.peak_bytes == chunked  # one token each
    check_chunked(c.source_text, real, batch)


# ---- along tokens: Hugging Face's shifted labels ---------------------------------------------------

def long_labels(batch: dict) -> dict:
    """Labels ignored unevenly along the sequence: a run crossing chunk boundaries, a stretch as
    long as several chunks, scattered single positions (the shift adds the last one per row)."""
    labels = batch["labels"].clone()
    rows, seq = labels.shape
    for r in range(rows):
        labels[r, 5 + r: 23 + 3 * r] = -100
        labels[r, seq // 2: seq // 2 + seq // 5] = -100
        labels[r, seq - 9:: 4] = -100
    return dict(batch, labels=labels)


@pytest.mark.parametrize("rows, seq, pieces", [(1, 96, 12), (2, 48, 5)])
def test_hf_loss_chunked_along_tokens_equals_eager(rows, seq, pieces):
    """A Qwen2 decoder at batch 1 (and at 2 where rows are not enough): the loss stage (final norm,
    lm_head, ForCausalLMLoss with its label pad-and-shift) runs in pieces of each row; the shift
    runs once, whole; loss and every gradient equal eager's."""
    meta, real, batch = hf_pair("qwen2", layers=2, batch=rows, seq=seq, vocab=512)
    batch = long_labels(batch)
    graph, plain = analyse(meta, batch, HW, loss_chunk_bytes=0)
    limit = working_bytes(plain[len(plain) - 1]) // (rows * pieces)
    c = compile_model(meta, batch, 1 << 30, HW, loss_chunk_bytes=limit, time_limit=20)
    epi = last(c)
    n = choose_tokens(rows, seq, working_bytes(plain[len(plain) - 1]), limit)
    assert (epi.chunks, epi.chunk_len) == (rows * -(-seq // n), n) and n < seq
    assert "aten.pad.default" in {graph[w].target for w in epi.whole}
    assert epi.peak_bytes <= limit + sum(graph[w].spec.nbytes for w in epi.whole)
    check_chunked(c.source_text, real, batch)
    trainer, model = bind_source(c.source_text, real)  # twice: the loss stage's part scaled alone
    ref_loss, ref_grads = eager_grads(real, batch, times=2)
    trainer.forward_backward(batch)
    assert_grads_match(model, trainer.forward_backward(batch), ref_loss, ref_grads, ATOL, RTOL)


def test_tokens_in_the_dump_and_inspect(tmp_path):
    """`--dump-ir` (05-chunk.txt) and the plan summary say how the loss was cut."""
    from lazytrain.runtime.schedule import load_source
    from lazytrain.summary import summary

    meta, _, batch = hf_pair("qwen2", layers=2, batch=1, seq=32, vocab=512)
    graph, plain = analyse(meta, batch, HW, loss_chunk_bytes=0)
    limit = working_bytes(plain[len(plain) - 1]) // 4
    c = compile_model(meta, batch, 1 << 30, HW, loss_chunk_bytes=limit, time_limit=20, dump_dir=tmp_path)
    dumped = (tmp_path / "05-chunk.txt").read_text()
    assert dumped.startswith("# last stage: 4 chunks along tokens: 1 row(s) x 4 pieces of 8 positions\n")
    assert "chunks=4 chunk_len=8 whole=['pad', " in dumped
    text = summary(load_source(c.source_text, "lt_test_chunk_summary"))
    assert "forward and backward in 4 chunks along tokens (8 positions of one row each)" in text
    assert "forward and backward in 4 chunks along tokens (8 positions of one row each)" in c.source_text


# ---- the loss's workspace in the plan (NOTE: [Operator workspace]) -------------------------------------

def test_unchunked_loss_counts_its_fp32_workspace():
    """bf16 compute, the loss left whole: the logits' fp32 upcast and cross-entropy's fp32
    log-probabilities are live together in forward, and backward holds the log-probabilities, their
    gradient and the logits' gradient (3 x fp32 logits). The plan must count them (on meta: no
    memory needed)."""
    rows, seq, vocab = 1, 256, 4096
    meta, _, batch = hf_pair("qwen2", layers=2, batch=rows, seq=seq, vocab=vocab)
    fp32_logits = rows * seq * vocab * 4
    c = compile_model(meta, batch, None, HW, loss_chunk_bytes=0, dtype=torch.bfloat16, time_limit=20)
    epi = last(c)
    assert epi.chunks == 1 and epi.internal_bytes == fp32_logits
    assert epi.peak_bytes >= 2 * fp32_logits  # upcast + log_softmax, beside each other
    assert working_bytes(epi) >= 3 * fp32_logits
    # the events say so too: what the stage saves, plus each compute's workspace and the weights'
    # gradients its backward makes, of which none exists yet at that peak (NOTE: [Weight gradients
    # at the backward's peak] in analysis/backward.py)
    sizes = {b.name: b.bytes for b in c.schedule.buffers}
    saved = sizes.get(f"saved:{epi.index}", 0)
    held = {e.phase.value: saved + e.workspace + sum(sizes[a] for a in e.allocs if a.startswith(("g:", "rgrad:")))
            for e in c.schedule.events if e.stage == epi.index and e.kind.value == "compute"}
    assert held["fwd"] >= 2 * fp32_logits and held["bwd"] >= 3 * fp32_logits, held
    assert c.plan.peak_bytes >= 3 * fp32_logits and max(c.memory_trace) <= c.plan.budget
