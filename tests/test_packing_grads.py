"""A packed batch through the compiled step trains as its examples would, each alone (NOTE:
[Packing] in lazytrain/train/packing.py): for tiny Qwen2, Llama, Gemma3 (a sliding window shorter
than the examples) and GPT-2 (learned positions), the loss and every parameter's gradient of a
batch packed by `PackedBatches` equal, within 1e-5 in fp32, the sum over its examples run alone in
eager PyTorch, each weighted by its learnt tokens over the batch's (the global mean over learnt
tokens); and three AdamW steps on packed batches give torch.optim.AdamW's weights on the same
examples."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from lazytrain.kernels import documents
from lazytrain.pipeline import compile_model
from lazytrain.train.data import PackedBatches, builtin_tokenizer
from lazytrain.train.packing import Layout
from checks import assert_grads_match, bind_source
from models import model_pair

VOCAB, BATCH, SEQ = 512, 2, 32
IGNORE = -100


def build(family: str, attention: str = "sdpa"):
    import transformers as tf

    common = dict(vocab_size=VOCAB, use_cache=False, attn_implementation=attention)
    if family == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.0,
                                                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **common))
    llama_like = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=SEQ, **common)
    if family == "gemma3":
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(head_dim=8, sliding_window=4, bos_token_id=0, eos_token_id=0,
                                                        pad_token_id=1, layer_types=["sliding_attention", "full_attention"],
                                                        **llama_like))
    cls, config = {"qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config), "llama": (tf.LlamaForCausalLM, tf.LlamaConfig)}[family]
    return cls(config(tie_word_embeddings=False, **llama_like))


def packed(tmp_path, batches: int) -> list[dict]:
    """The first `batches` packed batches of examples of 3 to 14 tokens (a third of each its prompt)."""
    rng = random.Random(0)
    with open(tmp_path / "ex.jsonl", "w") as f:
        for _ in range(40):
            n = rng.randint(3, 14)
            ids = [rng.randrange(2, VOCAB) for _ in range(n)]
            f.write(json.dumps({"input_ids": ids, "labels": [IGNORE if j < n // 3 else t for j, t in enumerate(ids)]})
                    + "\n")
    data = PackedBatches(tmp_path / "ex.jsonl", builtin_tokenizer(), BATCH, SEQ, seed=1, vocab_size=VOCAB,
                         layout=Layout())
    out = [next(data) for _ in range(batches)]
    assert all((b["position_ids"] == 0).sum() >= 3 * BATCH for b in out)  # several examples to a row
    return out


def examples(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each example of a packed batch (ids, labels): the runs between position restarts that learn."""
    found = []
    for ids, labels, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
        starts = (pos == 0).nonzero().flatten().tolist() + [SEQ]
        for a, b in zip(starts, starts[1:]):
            if (labels[a + 1 : b] != IGNORE).any():
                found.append((ids[a:b], labels[a:b]))
    return found


def loss_alone(model, batch: dict) -> torch.Tensor:
    """The batch's loss as its examples run one at a time: each example's mean over its learnt
    tokens, weighted by their share of the batch's."""
    pieces = examples(batch)
    counts = [int((labels[1:] != IGNORE).sum()) for _, labels in pieces]
    total = sum(counts)
    assert total == int((batch["labels"][:, 1:] != IGNORE).sum())  # nothing learnt outside the examples
    return sum(model(input_ids=ids[None], labels=labels[None]).loss * n / total for (ids, labels), n in zip(pieces, counts))


def compiled(family: str, batch: dict, attention: str = "sdpa"):
    meta, real = model_pair(lambda: build(family, attention))
    return compile_model(meta, batch, 1 << 40, "cpu", source="tests", time_limit=20).source_text, real


@pytest.mark.parametrize("attention", ["sdpa", documents.register()])
@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma3", "gpt2"])
def test_a_packed_batch_equals_its_examples_run_alone(tmp_path, family, attention):
    """With sdpa, the mask transformers builds from position_ids; with lazytrain_documents, the
    document attention operator, which reads them (NOTE: [Document attention])."""
    batch = packed(tmp_path, 1)[0]
    text, real = compiled(family, batch, attention)
    if attention != "sdpa":
        assert text.count("torch.ops.lazytrain.document_attention.default(") == 2  # one a layer
    trainer, model = bind_source(text, real)
    loss = trainer.forward_backward(batch)
    reference = copy.deepcopy(real)
    reference.set_attn_implementation("sdpa")  # the examples alone through torch's own attention
    assert reference.config._attn_implementation == "sdpa"
    ref_loss = loss_alone(reference, batch)
    ref_loss.backward()
    assert_grads_match(model, loss, ref_loss.detach(), {n: p.grad for n, p in reference.named_parameters()})


def test_three_adamw_steps_on_packed_batches_equal_adamw_on_the_examples(tmp_path):
    batches = packed(tmp_path, 3)
    text, real = compiled("qwen2", batches[0])
    hp = dict(lr=1e-3, weight_decay=0.01)
    trainer, model = bind_source(text, real, **hp)
    losses = [trainer.step(b).item() for b in batches]
    trainer.synchronize()
    alone, whole = copy.deepcopy(real), copy.deepcopy(real)
    for reference, loss_of in ((alone, loss_alone), (whole, lambda m, b: m(**b).loss)):
        opt = torch.optim.AdamW(reference.parameters(), **hp)
        for batch, got in zip(batches, losses):
            opt.zero_grad()
            loss = loss_of(reference, batch)
            loss.backward()
            opt.step()
            assert got == pytest.approx(loss.item(), rel=1e-5)
    # the packed batch in eager PyTorch: the compiled step's own arithmetic, to 1e-6 as every replay;
    # the examples alone sum in another order, and Adam's step divides by the root of tiny moments
    for tolerance, reference in ((1e-6, whole), (1e-5, alone)):
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            assert torch.allclose(got, want, atol=tolerance, rtol=1e-5), \
                f"{name} differs by {(got - want).abs().max():.3g}"
