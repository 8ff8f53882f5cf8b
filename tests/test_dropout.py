"""Dropout: erased at capture where it is the identity; recomputed by replaying the generator state
where it is not (NOTE: [Identity dropout] in ir/capture.py, NOTE: [RNG replay] in runtime/rng.py).
Also the reasons `inspect` gives for decisions no plan can take (pass `limits`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lazytrain import hardware
from lazytrain.ir.capture import capture
from lazytrain.ir.placement import Outputs
from lazytrain.pipeline import analyse, compile_model, minimum_budget
from lazytrain.runtime.schedule import load_source
from lazytrain.solver.solve import smallest_budget
from lazytrain.summary import summary
from checks import check_replay, check_seeded_replay
from models import model_pair, tiny_gpt_pair, token_batch, unique_name
from plans import decisions, forced

HW = hardware.load("cpu")
WIDTH = 8


class DropoutBlock(nn.Module):
    """x + fc2(dropout(gelu(fc1(x)))): no backward reads fc2's output, so a recompute before
    backward skips fc2 (NOTE: [Skipped recompute]) while the dropout before it draws again."""

    def __init__(self, p: float | None):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.drop = nn.Identity() if p is None else nn.Dropout(p)

    def forward(self, x):
        return x + self.fc2(self.drop(F.gelu(self.fc1(x))))


class DropoutModel(nn.Module):
    """inp -> dropout -> 3 DropoutBlocks -> head -> mean squared error. `p=None`: no dropout at all."""

    def __init__(self, p: float | None):
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.drop = nn.Identity() if p is None else nn.Dropout(p)
        self.blocks = nn.ModuleList(DropoutBlock(p) for _ in range(3))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x, y):
        h = self.drop(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return ((self.head(h) - y) ** 2).mean()


def dropout_model(p: float | None):
    meta, real = model_pair(lambda: DropoutModel(p))
    g = torch.Generator().manual_seed(3)
    return meta, real, {"x": torch.randn(6, 4, generator=g), "y": torch.randn(6, 4, generator=g)}


def _random_nodes(graph) -> list[str]:
    return [n.target for n in graph if any(r in n.target for r in ("dropout", "bernoulli", "rand"))]


# ---- identity dropouts are erased at capture -----------------------------------------------------

class Variants(nn.Module):
    """Every way a no-op dropout reaches export: modules, functional calls with p=0 or training=False,
    the feature and alpha variants, `native_dropout`; one real dropout (p=0.5) stays. With `inplace`
    capture functionalises the graph first (decompositions turn a p=0 dropout into a copy)."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.0)
        self.inplace = inplace

    def forward(self, x, y):
        h = self.fc(x)
        if self.inplace:  # an in-place op: capture functionalises the graph (run_decompositions)
            h = h.clone()
            h.mul_(2.0)
        h = self.drop(h)
        h = F.dropout(h, 0.5, training=False)
        h = F.alpha_dropout(h, 0.0, training=True)
        h = F.dropout1d(h.unsqueeze(0), 0.0, training=True).squeeze(0)
        h = torch.native_dropout(h, 0.0, True)[0]  # (output, mask): what decompositions leave
        h = torch.native_dropout(h, 0.3, False)[0]
        return ((F.dropout(h, 0.5, training=True) - y) ** 2).mean()


@pytest.mark.parametrize("inplace", [False, True])
def test_capture_erases_identity_dropouts(inplace):
    with torch.device("meta"):
        model = Variants(inplace)
    graph = capture(model, {"x": torch.zeros(4, 8), "y": torch.zeros(4, 8)})
    kept = _random_nodes(graph)
    # the p=0.5 one: `dropout` as exported, `native_dropout` (or `bernoulli`) once decomposed
    assert len(kept) == 1, kept
    node = next(n for n in graph if n.target == kept[0])
    assert 0.5 in node.args or any(a == 0.5 for a in node.args)


def test_identity_dropout_costs_nothing():
    """p=0 dropouts in every stage: after capture no dropout node is left, no stage counts as random,
    and the smallest budget is that of the same model without dropout."""
    meta, _, batch = dropout_model(0.0)
    graph, stages = analyse(meta, batch, HW)
    assert _random_nodes(graph) == []
    assert not any(s.random for s in stages)
    bare, _, _ = dropout_model(None)
    assert minimum_budget(meta, batch, HW) == minimum_budget(bare, batch, HW)


def test_identity_dropout_replays_like_eager():
    meta, real, batch = dropout_model(0.0)
    compiled = compile_model(meta, batch, minimum_budget(meta, batch, HW), HW, source="tests", time_limit=20)
    check_replay(compiled.source_text, real, batch)


# ---- real dropout: recomputed under the forward's generator state --------------------------------

@pytest.fixture(scope="module")
def random_model():
    meta, real, batch = dropout_model(0.1)
    graph, stages = analyse(meta, batch, HW)
    return graph, stages, batch, real


def test_real_dropout_stages_are_random_and_skip(random_model):
    """Every block draws random numbers and, in its recompute, skips fc2 (after the dropout)."""
    graph, stages, _, _ = random_model
    assert [s.random for s in stages] == [True, True, True, True, False]
    for s in stages[1:4]:
        assert [graph[graph[n].args[1].value].target for n in s.skips] == [f"{s.name}.fc2.weight"]


@pytest.mark.parametrize("spec", [
    ["-Rk", "-Rk", "-Rk", "-Rk", "-rk"],  # every random stage recomputed before its backward (skipping fc2)
    ["-Rd", "-Rd", "-Rd", "-Rk", "-rk"],  # a dropped segment: recomputed twice (outputs, then internals)
    ["-Rd", "-Rk", "-Rd", "-Rk", "-rk"],  # two segments of one
    ["SRk", "SRo", "SRk", "SRk", "Srk"],  # streamed
])
def test_recomputed_random_stages_equal_eager(random_model, spec):
    graph, stages, batch, real = random_model
    f = forced(graph, stages, batch, decisions(spec), HW)
    check_seeded_replay(f.source_text, real, batch, steps=2, lr=1e-2, eps=1e-6)


def test_smallest_budget_recomputes_random_stages(random_model):
    """At its smallest budget the plan recomputes or drops the random stages, and the step is eager's."""
    graph, stages, batch, real = random_model
    need = smallest_budget(stages, HW)
    meta, _, _ = dropout_model(0.1)
    compiled = compile_model(meta, batch, need, HW, source="tests", time_limit=20)
    assert any((d.recomputed or d.outputs is Outputs.DROP) for s, d in zip(stages, compiled.plan.decisions) if s.random)
    assert "random=True" in compiled.source_text
    check_seeded_replay(compiled.source_text, real, batch, steps=2, lr=1e-2, eps=1e-6)


# ---- Hugging Face models with dropout in their configs -------------------------------------------

def _hf(family: str, p: float):
    from transformers import GPT2Config, GPT2LMHeadModel, Phi3Config, Phi3ForCausalLM

    if family == "phi3":
        cfg = Phi3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attn_implementation="sdpa",
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, resid_pdrop=p, embd_pdrop=p, attention_dropout=p)
        build = lambda: Phi3ForCausalLM(cfg)  # noqa: E731
    else:
        cfg = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                         bos_token_id=1, eos_token_id=2, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p,
                         attn_implementation="eager")
        build = lambda: GPT2LMHeadModel(cfg)  # noqa: E731
    meta, real = model_pair(build)
    return meta, real, token_batch(2, 8, 128)


@pytest.mark.parametrize("family", ["phi3", "gpt2"])
def test_hf_zero_dropout_configs_stream(family):
    """Phi-3 and GPT-2 (eager attention, whose attention weights pass a dropout) with their default
    p=0 dropouts: nothing random is left, so at the smallest budget every block streams."""
    meta, real, batch = _hf(family, 0.0)
    graph, stages = analyse(meta, batch, HW)
    assert _random_nodes(graph) == [] and not any(s.random for s in stages)
    compiled = compile_model(meta, batch, smallest_budget(stages, HW), HW, source="tests", time_limit=20)
    blocks = [d for s, d in zip(stages, compiled.plan.decisions) if s.name not in ("prologue", "epilogue")]
    assert blocks and all(d.streamed and d.recomputed for d in blocks)
    check_replay(compiled.source_text, real, batch)


@pytest.mark.parametrize("family", ["phi3", "gpt2"])
def test_hf_real_dropout_at_smallest_budget(family):
    """p=0.1 everywhere (embeddings, residuals, attention: inside scaled_dot_product_attention for
    Phi-3, on the attention weights for GPT-2): recomputed blocks draw eager's masks."""
    meta, real, batch = _hf(family, 0.1)
    graph, stages = analyse(meta, batch, HW)
    assert all(s.random for s in stages[1:-1])  # every block
    compiled = compile_model(meta, batch, smallest_budget(stages, HW), HW, source="tests", time_limit=20)
    assert any(d.recomputed for d in compiled.plan.decisions)
    check_seeded_replay(compiled.source_text, real, batch)


# ---- inspect names what no plan can change -------------------------------------------------------

def test_inspect_names_why_a_stage_is_not_streamed_or_recomputed():
    """The tiny GPT's tied embedding stays resident (read by the prologue and the head); its chunked
    loss stage cannot recompute; the schedule's header and `inspect` say so, per stage."""
    meta, _, batch = tiny_gpt_pair()
    compiled = compile_model(meta, batch, 1 << 30, HW, source="tests", loss_chunk_bytes=1)
    text = summary(load_source(compiled.source_text, unique_name()))
    tied = "p_head_weight stays resident: shared with stage {} (tied weights are never streamed)"
    chunked = "not recomputed: its forward runs inside its backward, in 2 chunks of the batch"
    assert f"  0 prologue                {tied.format(4)}" in text
    assert f"  4 epilogue                {chunked}" in text
    assert tied.format(0) in text
    header = compiled.source_text[:compiled.source_text.index("import torch")]
    assert tied.format(4) in header and chunked in header


class Weightless(nn.Module):
    """A block without parameters between two with: it cannot stream (it has nothing to stream)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)])

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return ((x - y) ** 2).mean()


def test_inspect_names_a_stage_without_weights():
    meta, _ = model_pair(Weightless)
    compiled = compile_model(meta, {"x": torch.zeros(4, 8), "y": torch.zeros(4, 8)}, 1 << 30, HW, source="tests")
    text = summary(load_source(compiled.source_text, unique_name()))
    assert "  1 blocks.1                not streamed: it has no weights" in text
