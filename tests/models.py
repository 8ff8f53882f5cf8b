"""Small models and batches shared by the compiler tests.

Every model is built twice: once under `torch.device("meta")` for the compiler (which never sees
real weights) and once on the CPU from a fixed seed for the replay (checks.py compares the two).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


HW = "cpu"
_names = itertools.count()


def examples(n: int) -> int:
    """Hypothesis example counts, scaled by LAZYTRAIN_HYPOTHESIS_SCALE (e.g. 10 for a long local run)."""
    return max(1, int(n * float(os.environ.get("LAZYTRAIN_HYPOTHESIS_SCALE", "1"))))


def unique_name(prefix: str = "lt_test_schedule") -> str:
    """A fresh module name for `load_source` (it registers the module in sys.modules)."""
    return f"{prefix}_{next(_names)}"


# ---- model pairs and batches ---------------------------------------------------------------------

def model_pair(build, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(meta copy for the compiler, real CPU copy with weights from `seed`)."""
    with torch.device("meta"):
        meta = build()
    torch.manual_seed(seed)
    real = build()
    return meta, real


def token_batch(batch: int, seq: int, vocab: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """input_ids and labels drawn independently (so a mixed-up input shows in the loss)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, vocab, (batch, seq), generator=g),
        "labels": torch.randint(0, vocab, (batch, seq), generator=g),
    }


def ragged(batch: dict) -> dict:
    """The batch with labels ignored (-100) unevenly: row 0 entirely, row 1 not at all, the others
    in growing runs, so every row counts its own number of targets (a chunked loss must divide by
    the global count, not average the chunks' means)."""
    labels = batch["labels"].clone()
    rows, seq = labels.shape
    labels[0] = -100
    for r in range(2, rows):
        labels[r, : (r * seq) // (rows + 1)] = -100
    return dict(batch, labels=labels)


def tiny_gpt_pair(seed: int = 0):
    from lazytrain.examples import tiny_gpt

    meta, real = model_pair(tiny_gpt.build_model, seed)
    return meta, real, token_batch(tiny_gpt.BATCH, tiny_gpt.SEQ, tiny_gpt.VOCAB)


def disk_gpt(hw, states: str = "32bit", clipping: str = "off", layers: int = 6, dim: int | None = None,
             compute: torch.dtype | None = None):
    """The tiny GPT with `layers` blocks, analysed on `hw` with the disk tier on: (graph, stages,
    batch, real model). `compute`: the dtype it is captured in (bfloat16: fp32 masters of bf16 weights)."""
    from lazytrain.examples import tiny_gpt
    from lazytrain.pipeline import analyse

    meta, real = model_pair(lambda: tiny_gpt.TinyGPT(dim=dim or tiny_gpt.DIM, layers=layers))
    batch = token_batch(tiny_gpt.BATCH, tiny_gpt.SEQ, tiny_gpt.VOCAB)
    graph, stages = analyse(meta.to(compute) if compute else meta, batch, hw, optimizer_states=states)
    return graph, dataclasses.replace(stages, disk=True, clipping=clipping), batch, real


def tiny_qwen_pair(seed: int = 0):
    """The shipped example (lazytrain/examples/tiny_qwen.py: 4 layers, hidden 128, vocabulary 512)."""
    from lazytrain.examples import tiny_qwen

    meta, real = model_pair(tiny_qwen.build_model, seed)
    return meta, real, token_batch(tiny_qwen.BATCH, tiny_qwen.SEQ, tiny_qwen.config().vocab_size)


def hf_config(family: str, layers: int = 2, vocab: int = 128, hidden: int = 32):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[family]
    return cls(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )


def hf_pair(family: str, layers: int = 2, seed: int = 0, batch: int = 2, seq: int = 8, vocab: int = 128):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    cls = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}[family]
    cfg = hf_config(family, layers, vocab)
    meta, real = model_pair(lambda: cls(cfg), seed)
    return meta, real, token_batch(batch, seq, cfg.vocab_size)


# ---- random block models -------------------------------------------------------------------------

ACTS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "silu": F.silu}
KINDS = ("linear", "mlp", "norm")


@dataclass(frozen=True)
class BlockSpec:
    kind: str  # "linear": act(Linear); "mlp": x + fc2(act(fc1(x))); "norm": act(Linear(LayerNorm(x)))
    width: int  # output width ("mlp": its hidden width; the output keeps the input width)
    act: str = "relu"


@dataclass(frozen=True)
class ModelSpec:
    blocks: tuple[BlockSpec, ...]
    d_in: int = 8
    width: int = 16  # width of the prologue's projection
    tied: bool = False  # the head reads the input projection's weight (transposed): a shared parameter
    table: str = "none"  # "none"; "const": a table made before the blocks (like rotary); "grad": one with gradient
    batch: int = 4

    def widths(self) -> list[int]:
        w = [self.width]
        for b in self.blocks:
            w.append(w[-1] if b.kind == "mlp" else b.width)
        return w


class _Block(nn.Module):
    def __init__(self, spec: BlockSpec, width_in: int):
        super().__init__()
        self.kind, self.act = spec.kind, ACTS[spec.act]
        if spec.kind == "linear":
            self.fc = nn.Linear(width_in, spec.width)
        elif spec.kind == "mlp":
            self.fc1 = nn.Linear(width_in, spec.width)
            self.fc2 = nn.Linear(spec.width, width_in)
        else:
            self.ln = nn.LayerNorm(width_in)
            self.fc = nn.Linear(width_in, spec.width)

    def forward(self, x, table):
        if table is not None:
            x = x * table
        if self.kind == "linear":
            return self.act(self.fc(x))
        if self.kind == "mlp":
            return x + self.fc2(self.act(self.fc1(x)))
        return self.act(self.fc(self.ln(x)))


class BlockModel(nn.Module):
    """inp: Linear(d_in, width) -> blocks (an nn.ModuleList) -> head to d_in -> mean squared error."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        widths = spec.widths()
        self.inp = nn.Linear(spec.d_in, spec.width)
        self.blocks = nn.ModuleList(_Block(b, w) for b, w in zip(spec.blocks, widths))
        if spec.tied:
            self.head_bias = nn.Parameter(torch.zeros(spec.d_in))
        else:
            self.head = nn.Linear(widths[-1], spec.d_in)

    def forward(self, x, y):
        h = self.inp(x)
        table = None
        if self.spec.table == "const":
            pos = torch.arange(x.shape[0], device=x.device, dtype=x.dtype).unsqueeze(-1)
            table = torch.cos(pos * 0.1) + 1.5
        elif self.spec.table == "grad":
            table = torch.sigmoid(h.mean(-1, keepdim=True)) + 0.5
        for block in self.blocks:
            h = block(h, table)
        out = F.linear(h, self.inp.weight.t(), self.head_bias) if self.spec.tied else self.head(h)
        return ((out - y) ** 2).mean()


def random_block_model(spec: ModelSpec | None = None, *, seed: int = 0, **kwargs):
    """(meta model, real model, batch) for a `ModelSpec` (or one built from kwargs)."""
    spec = spec or ModelSpec(**kwargs)
    if spec.tied and spec.widths()[-1] != spec.width:
        raise ValueError("a tied head needs the last width equal to the projection width")
    meta, real = model_pair(lambda: BlockModel(spec), seed)
    g = torch.Generator().manual_seed(seed + 1)
    batch = {"x": torch.randn(spec.batch, spec.d_in, generator=g), "y": torch.randn(spec.batch, spec.d_in, generator=g)}
    return meta, real, batch


def model_specs():
    """Hypothesis strategy for `ModelSpec`s: 1-5 blocks of random kinds and widths."""
    from hypothesis import strategies as st

    block = st.builds(BlockSpec, kind=st.sampled_from(KINDS), width=st.sampled_from((8, 12, 16, 24)),
                      act=st.sampled_from(tuple(ACTS)))

    @st.composite
    def specs(draw):
        blocks = draw(st.lists(block, min_size=1, max_size=5))
        width = draw(st.sampled_from((8, 16)))
        table = draw(st.sampled_from(("none", "const", "grad")))
        spec = ModelSpec(tuple(blocks), width=width, table=table)
        if draw(st.booleans()):
            last = spec.widths()[-1]
            if last != width:  # make the last block end at the projection width so the head can tie
                tail = blocks[-1]
                blocks[-1] = BlockSpec("linear" if tail.kind == "mlp" else tail.kind, width, tail.act)
            spec = ModelSpec(tuple(blocks), width=width, table=table, tied=True)
        return spec

    return specs()
