"""The model FLOPs `lazytrain train` reports (NOTE: [Model FLOPs] in lazytrain/train/flops.py):
attention's (query, key) pairs counted exactly for the sequences a global batch holds, against a
brute-force count of the document mask; the attention layers read from Hugging Face configs; and
a model without a config reported as counting 6N alone."""

from __future__ import annotations

import json
import random
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from lazytrain.cli import main
from lazytrain.examples import tiny_gpt
from lazytrain.kernels.documents import document_mask
from lazytrain.train.data import PackedBatches, builtin_tokenizer
from lazytrain.train.evaluation import EvalSet
from lazytrain.train.flops import AttentionLayer, attention_flops, attention_layers, pairs, step_flops
from lazytrain.train.packing import UNPACKED, Layout
from lazytrain.train.report import step_record

IGNORE = -100
WINDOWS = (None, 1, 3, 8, 1000)


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Examples of 2 to 30 tokens (a third of each a prompt) and plain text documents."""
    folder = tmp_path_factory.mktemp("flops")
    rng = random.Random(0)
    with open(folder / "ex.jsonl", "w") as f:
        for n in (rng.randint(2, 30) for _ in range(70)):
            ids = [rng.randrange(2, 500) for _ in range(n)]
            f.write(json.dumps({"input_ids": ids, "labels": [IGNORE if j < n // 3 else t for j, t in enumerate(ids)]})
                    + "\n")
    (folder / "a.txt").write_text("\n\n".join(f"document {i} says {'hello ' * (i % 7)}" for i in range(40)))
    return folder


def padding(batch: dict, pad: int) -> torch.Tensor:
    """[B, S] bool: the run after a row's last position restart, where it holds only padding (the
    pad id, no label): the rows' padding, found from the inputs alone."""
    ids, labels, pos = (batch[k] for k in ("input_ids", "labels", "position_ids"))
    out = torch.zeros_like(ids, dtype=torch.bool)
    for r in range(ids.shape[0]):
        last = int((pos[r] == 0).nonzero().max())
        if ((ids[r, last:] == pad) & (labels[r, last:] == IGNORE)).all():
            out[r, last:] = True
    return out


def brute_pairs(batch: dict, pad: int, window: int | None) -> int:
    """The (query, key) pairs the document mask allows, counted over the queries that are no padding."""
    mask = document_mask(batch["position_ids"], window)
    return int(mask[~padding(batch, pad)].sum())


def batches(data, tok, layout: Layout, world: int = 1, rank: int = 0, seed: int = 1) -> PackedBatches:
    return PackedBatches([data / "a.txt", data / "ex.jsonl"], tok, 4, 32, seed=seed, layout=layout, rank=rank,
                         world=world)


@pytest.mark.parametrize("layout", [Layout(), Layout(pack_examples=False), UNPACKED],
                         ids=["packed", "documents-masked", "unpacked"])
def test_pairs_match_the_document_mask_over_real_tokens(data, tok, layout):
    """Packed examples, documents, rows ending in padding and rows with none: the sequences'
    pairs, causal and windowed, are the mask's over the queries that are no padding."""
    train = batches(data, tok, layout)
    held = EvalSet([data / "ex.jsonl"], tok, 4, 32, layout=layout)  # its last batch has empty rows
    seen, several = [], False
    for batch in [train.next_batch() for _ in range(12)] + list(held.batches()):
        assert batch.documents.sum() == batch.tokens and batch.documents.min() > 0
        assert not batch.documents.flags.writeable
        for window in WINDOWS:
            assert pairs(batch.documents, window) == brute_pairs(batch.inputs, tok.pad_token_id, window)
        seen += padding(batch.inputs, tok.pad_token_id).any(dim=1).tolist()
        several |= len(batch.documents) > 4
    assert set(seen) == {True, False} and several == (layout != UNPACKED)


def test_pairs_closed_form():
    assert pairs(np.array([1, 4]), None) == 1 + 10
    assert pairs(np.array([5]), 2) == 1 + 2 + 2 + 2 + 2
    assert pairs(np.array([5]), 5) == pairs(np.array([5]), None) == 15
    assert pairs(np.array([], dtype=np.int64), None) == 0
    assert pairs(np.array([262_144]), None) == 262_144 * 262_145 // 2  # no overflow on the way


def test_every_rank_counts_the_global_batchs_sequences(data, tok):
    """On two ranks each rank's batch holds half the rows, and the sequences of all of them."""
    one = batches(data, tok, Layout())
    two = [batches(data, tok, Layout(), world=2, rank=r) for r in range(2)]
    for _ in range(8):
        whole, halves = one.next_batch(), [b.next_batch() for b in two]
        for half in halves:
            assert np.array_equal(half.documents, whole.documents) and half.tokens == whole.tokens
        joined = {k: torch.cat([h.inputs[k] for h in halves]) for k in whole.inputs}
        assert pairs(whole.documents, None) == brute_pairs(joined, tok.pad_token_id, None)


def config_model(config):
    return types.SimpleNamespace(config=config)


def test_attention_layers_read_from_hugging_face_configs():
    from transformers import Gemma3Config, Gemma3TextConfig, GPT2Config, LlamaConfig, Qwen2Config

    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)
    assert attention_layers(config_model(Qwen2Config(**small))) == (AttentionLayer(64, None),) * 4
    windowed = Qwen2Config(**small, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert attention_layers(config_model(windowed)) == (AttentionLayer(64, None),) + (AttentionLayer(64, 16),) * 3
    windowed.layer_types = None  # a config from before layer_types: use_sliding_window and max_window_layers
    assert attention_layers(config_model(windowed)) == (AttentionLayer(64, None),) + (AttentionLayer(64, 16),) * 3
    assert attention_layers(config_model(LlamaConfig(**small))) == (AttentionLayer(64, None),) * 4
    assert attention_layers(config_model(LlamaConfig(**small, head_dim=32))) == (AttentionLayer(128, None),) * 4

    gemma = Gemma3TextConfig(**{**small, "num_hidden_layers": 7}, head_dim=24, sliding_window=8)
    full, sliding = AttentionLayer(96, None), AttentionLayer(96, 8)
    assert attention_layers(config_model(gemma)) == (sliding,) * 5 + (full, sliding)
    assert attention_layers(config_model(Gemma3Config(text_config=gemma.to_dict()))) == (sliding,) * 5 + (full, sliding)

    assert attention_layers(config_model(GPT2Config(n_layer=3, n_head=4, n_embd=64))) == (AttentionLayer(64, None),) * 3
    with torch.device("meta"):
        from transformers import GPT2LMHeadModel

        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    assert attention_layers(gpt2) == (AttentionLayer(32, None),) * 2

    other = LlamaConfig(**small)
    other.layer_types = ["full_attention", "linear_attention"] * 2  # work this count does not know
    assert attention_layers(config_model(other)) is None


def test_attention_flops_sum_every_layer_and_sequence():
    layers = (AttentionLayer(64, None), AttentionLayer(32, 3), AttentionLayer(64, None))
    lengths = np.array([7, 1, 20])
    assert attention_flops(layers, lengths) == 14 * (64 * pairs(lengths, None) * 2 + 32 * pairs(lengths, 3))


def test_a_model_without_a_config_reports_6n_alone(data, tok):
    model = tiny_gpt.build_model()
    assert attention_layers(model) is None
    batch = batches(data, tok, UNPACKED).next_batch()
    n_params = sum(p.numel() for p in model.parameters())
    plain = step_record(1, 2.0, 1e-3, 0.5, batch, n_params, None)
    assert plain["tflops_counts_attention"] is False
    assert plain["tflops"] * 0.5 * 1e12 == pytest.approx(6 * n_params * batch.tokens, rel=1e-12)
    layers = (AttentionLayer(32, None),) * 3
    counted = step_record(1, 2.0, 1e-3, 0.5, batch, n_params, layers)
    assert counted["tflops_counts_attention"] is True
    assert counted["tflops"] * 0.5 * 1e12 == pytest.approx(step_flops(n_params, batch, layers), rel=1e-12)
    assert step_flops(n_params, batch, layers) == 6 * n_params * batch.tokens + 14 * 96 * pairs(batch.documents, None)


def test_a_model_file_without_a_config_trains_and_logs_6n_alone(tmp_path, capsys):
    """`lazytrain train` on a plain model file: its records count 6N a token and say so."""
    model = tmp_path / "gpt.py"
    model.write_text(Path(tiny_gpt.__file__).read_text().replace("= 96, 32, 4, 3, 16, 2", "= 512, 32, 4, 3, 16, 2"))
    code = main([str(a) for a in ("train", "--model", model, "--steps", 1, "--log", tmp_path / "log.jsonl",
                                  "--no-progress")])
    assert code == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "log.jsonl").read_text())
    n_params = sum(p.numel() for p in tiny_gpt.TinyGPT(vocab=512).parameters())
    assert record["tflops_counts_attention"] is False
    assert record["tflops"] * 1e12 == pytest.approx(6 * n_params * record["tokens_per_s"], rel=1e-9)
