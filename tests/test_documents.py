"""The document attention operator (NOTE: [Document attention] in lazytrain/kernels/documents.py):
its output, lse and gradients equal sdpa under the dense document mask, for several packings, GQA
and MHA, with and without a sliding window, in one block of queries and in many; it passes
torch.library.opcheck and torch.export; its GPU branch (FlexAttention under its own autograd, with a block mask
made from the documents' block ranges) gives the reference's numbers through FlexAttention's dense CPU
implementation; and a
tiny Qwen2 with attn_implementation "lazytrain_documents" trains exactly as with sdpa on packed
position_ids, sliding window too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lazytrain.kernels import documents
from lazytrain.kernels.documents import document_mask

ATOL = 1e-5
# position_ids [2, 12]: restarts and trailing padding; one document per row; documents of one token
PACKINGS = {
    "packed": [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 0], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1]],
    "whole": [list(range(12)), list(range(12))],
    "singles": [[0] * 12, [0, 1, 0, 0, 1, 2, 0, 0, 0, 1, 0, 0]],
    "unaligned": [[5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 8], [3, 4, 0, 1, 2, 9, 10, 11, 12, 13, 14, 15]],
}


def inputs(heads: int, kv_heads: int, packing: str, seed: int = 0, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    pos = torch.tensor(PACKINGS[packing])
    B, S = pos.shape
    q = torch.randn(B, S, heads, dim, generator=g).transpose(1, 2)  # the layout transformers hands over
    k, v = (torch.randn(B, kv_heads, S, dim, generator=g) for _ in range(2))
    return q, k, v, pos


def sdpa_reference(q, k, v, pos, scale, window):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=document_mask(pos, window)[:, None], scale=scale)


@pytest.mark.parametrize("block", [1024, 5])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("packing", sorted(PACKINGS))
def test_op_equals_sdpa_with_the_document_mask(packing, heads, window, block, monkeypatch):
    monkeypatch.setattr(documents, "BLOCK", block)  # 5: three blocks of queries in rows of 12
    q, k, v, pos = inputs(*heads, packing)
    scale = 0.3
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = torch.ops.lazytrain.document_attention(*leaves, pos, scale, window)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    ref_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = sdpa_reference(*ref_leaves, pos, scale, window)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)

    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad)
    ref.backward(grad)
    for mine, theirs in zip(leaves, ref_leaves):
        assert mine.grad.shape == theirs.grad.shape
        torch.testing.assert_close(mine.grad, theirs.grad, atol=ATOL, rtol=0)

    rep = heads[0] // heads[1]
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * scale
    masked = scores.masked_fill(~document_mask(pos, window)[:, None], float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(masked, -1), atol=ATOL, rtol=0)


def test_document_ids_follow_transformers():
    from transformers.masking_utils import find_packed_sequence_indices

    pos = torch.tensor(PACKINGS["packed"] + PACKINGS["unaligned"] + PACKINGS["singles"])
    assert torch.equal(documents.document_ids(pos).long(), find_packed_sequence_indices(pos))


def test_bf16_out_keeps_dtype_and_layout():
    q, k, v, pos = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs(4, 2, "packed"))
    out, lse = torch.ops.lazytrain.document_attention(q, k, v, pos, 0.3, None)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("window", [None, 3])
def test_opcheck(window):
    q, k, v, pos = inputs(4, 2, "packed")
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), pos, 0.3, window)
    # test_aot_dispatch_dynamic applies as well: the fake kernels are written in symbolic shapes and
    # the real ones loop over concrete ones, so all four default checks run.
    torch.library.opcheck(torch.ops.lazytrain.document_attention.default, args)


class Attend(torch.nn.Module):
    def __init__(self, dim: int = 16, heads: int = 4, kv_heads: int = 2, head_dim: int = 4):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = torch.nn.Linear(dim, heads * head_dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * head_dim)

    def forward(self, x, position_ids):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = torch.ops.lazytrain.document_attention(q, k, v, position_ids, self.head_dim ** -0.5, 2)[0]
        return out.transpose(1, 2).reshape(B, S, -1)


def test_export_on_meta():
    with torch.device("meta"):
        model = Attend()
        x, pos = torch.empty(2, 12, 16), torch.zeros(2, 12, dtype=torch.long)
    exported = torch.export.export(model, (x, pos))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert "lazytrain.document_attention.default" in targets
    assert exported.module()(x, pos).shape == (2, 12, 16)


def test_attention_needs_position_ids_and_no_dropout():
    q, k, v, pos = inputs(4, 2, "packed")
    with pytest.raises(ValueError, match="position_ids"):
        documents.attention(None, q, k, v, None)
    with pytest.raises(ValueError, match="dropout"):
        documents.attention(None, q, k, v, None, dropout=0.1, position_ids=pos)


def _qwen2(implementation: str, sliding: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # max_window_layers=0: every layer from index 0 on slides (Qwen2Config.layer_types)
    window = dict(use_sliding_window=True, sliding_window=4, max_window_layers=0) if sliding else {}
    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
                         attn_implementation=implementation, **window)
    assert config.layer_types == ["sliding_attention" if sliding else "full_attention"] * 2
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_qwen2_trains_as_with_sdpa(sliding, monkeypatch):
    name = documents.register()
    assert name == documents.register() == "lazytrain_documents"
    seen = []
    real = torch.ops.lazytrain.document_attention

    class Spy:
        def __call__(self, *args):
            seen.append(args[3])
            return real(*args)

    monkeypatch.setattr(torch.ops.lazytrain, "document_attention", Spy())
    ours, theirs = _qwen2(name, sliding), _qwen2("sdpa", sliding)
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == name

    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6],
                        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 0, 0, 0]])
    ids = torch.randint(0, 128, pos.shape, generator=torch.Generator().manual_seed(2))
    losses = [m(input_ids=ids, labels=ids, position_ids=pos).loss for m in (ours, theirs)]
    assert len(seen) == 2 and all(torch.equal(p, pos) for p in seen)  # each layer got the packing
    torch.testing.assert_close(losses[0], losses[1], atol=ATOL, rtol=0)
    for loss in losses:
        loss.backward()
    for (n, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=ATOL, rtol=0, msg=n)


def flex_on_cpu(monkeypatch):
    """FlexAttention's dense implementation, compiled with aot_eager: inductor's CPU kernels give no
    lse, and flex_attention refuses inputs that require grad on the CPU."""
    from torch.nn.attention import flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    monkeypatch.setattr(documents, "_FLEX", torch.compile(fa.flex_attention, backend="aot_eager", dynamic=False))


def long_packing() -> torch.Tensor:
    """[2, 420]: documents longer than a block of 128 (full blocks), shorter ones, a ragged end."""
    pos = torch.cat([torch.arange(170), torch.arange(30), torch.arange(220)]).repeat(2, 1)
    pos[1, 20:] = torch.arange(400)
    return pos


@pytest.mark.parametrize("window", [None, 7, 140])
def test_block_mask_is_the_document_mask(window):
    """The block mask made from each block's first and last document is the dense mask of
    create_block_mask on the same mask: the same blocks skipped, and every element the same."""
    from torch.nn.attention.flex_attention import create_block_mask

    pos = long_packing()
    ids = documents.document_ids(pos)
    ours = documents.block_mask(ids, window)
    mask = document_mask(pos, window)
    theirs = create_block_mask(lambda b, h, q, k: mask[b, q, k], 2, None, 420, 420, device="cpu")
    assert torch.equal(ours.to_dense(), theirs.to_dense())  # blocks computed at all
    dense = ours.to_dense().repeat_interleave(128, -1).repeat_interleave(128, -2)[..., :420, :420].bool()
    b, q, k = torch.meshgrid(torch.arange(2), torch.arange(420), torch.arange(420), indexing="ij")
    assert torch.equal(ours.mask_mod(b, 0, q, k) & dense[:, 0], mask)
    full = ours.full_kv_num_blocks is not None and ours.full_kv_num_blocks.sum() > 0
    assert full == (window is None)  # a long document makes full blocks, unless a window cuts them


@pytest.mark.parametrize("window", [None, 7])
def test_flex_attention_on_cpu(window, monkeypatch):
    """The GPU path's code (block mask, lse request, layout, FlexAttention's own backward) gives the
    reference's output, lse and gradients through FlexAttention's dense CPU implementation."""
    flex_on_cpu(monkeypatch)
    g = torch.Generator().manual_seed(0)
    pos = long_packing()
    q = torch.randn(2, 420, 4, 16, generator=g).transpose(1, 2)
    k, v = (torch.randn(2, 2, 420, 16, generator=g) for _ in range(2))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ids = documents.document_ids(pos)
    out, lse = documents.flex_attention(*leaves, documents.batch_block_mask(pos, window), 0.25)
    assert out.transpose(1, 2).is_contiguous()
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)

    ref_out, ref_lse = documents._reference_forward(q, k, v, ids, 0.25, window)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)  # natural log, as the reference's
    ref_grads = documents._reference_backward(grad, q, k, v, ref_out, ref_lse, ids, 0.25, window)
    for leaf, ref in zip(leaves, ref_grads):
        torch.testing.assert_close(leaf.grad, ref, atol=ATOL, rtol=0)

def test_a_batch_makes_its_block_mask_once():
    """Every layer reading the batch's position_ids (or a view of them) reuses one block mask; a
    new batch, an in-place change, another view or another window makes a new one."""
    pos = long_packing()
    mask = documents.batch_block_mask(pos, None)
    assert documents.batch_block_mask(pos, None) is mask
    assert documents.batch_block_mask(pos.expand(2, -1), None) is mask  # transformers' expand per layer
    assert documents.batch_block_mask(pos, 7) is not mask
    assert documents.batch_block_mask(pos[:1], None) is not mask
    same = pos.clone()
    other = documents.batch_block_mask(same, None)
    assert other is not mask and torch.equal(other.to_dense(), mask.to_dense())
    same[1, 20:] = torch.arange(400) % 50  # written in place: other documents
    changed = documents.batch_block_mask(same, None)
    assert changed is not other and not torch.equal(changed.to_dense(), other.to_dense())
    assert torch.equal(changed.to_dense(), documents.block_mask(documents.document_ids(same), None).to_dense())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_packed_model_directory_switches_to_the_operator_unless_it_drops_attention(dropout):
    """run_data switches a Hugging Face model to the operator, except one whose attention has
    dropout (which the operator has not): it keeps its own attention under the dense mask."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lazytrain.train.run_data import document_attention

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, attention_dropout=dropout,
                                             attn_implementation="sdpa"))
    assert document_attention(model) == (dropout == 0)
    assert model.config._attn_implementation == ("sdpa" if dropout else documents.IMPLEMENTATION)
