"""Document-masked attention for packed rows: the `lazytrain::document_attention` operator, its
backward, and the Hugging Face attention function that calls it."""

# NOTE: [Document attention]
# A packed training row holds several examples; attention must stay inside each one. Hugging Face
# builds that as a dense [B, 1, S, S] mask for sdpa, which costs O(S^2) memory, keeps sdpa off its
# flash kernel and computes every masked score. This operator takes the position_ids instead and is
# exact: a query sees a key iff both are in the same document, key <= query, and, with a sliding
# window W, query - key < W (Hugging Face's semantics). A document starts where the row starts and wherever
# position_ids[t] != position_ids[t-1] + 1 (transformers' find_packed_sequence_indices), so a
# row's trailing padding, restarting at 0, is a document of its own and no query is fully masked.
# Kernels: on CUDA in bf16/fp16, FlexAttention (compiled once), registered at the operator's
# AutogradCUDA key so that FlexAttention's own backward is recorded. Its block mask is made from
# each 128-token block's first and last document (`block_mask`: small ops, no [S, S] evaluation),
# once a batch (`batch_block_mask`), so blocks of other documents are skipped, blocks inside one
# document run unmasked, and memory stays O(S). Everywhere else (CPU, other devices, CUDA in
# float32) an exact float32 reference takes BLOCK query rows at a time, so its scores are
# [B, H, BLOCK, S], never [B, H, S, S]; its backward is a second operator applying the standard
# formulas with the saved lse. The operator returns (out, lse), lse being the natural log-sum-exp
# of each query's scaled scores on every device (FlexAttention's public function converts its
# base-2 statistic).
# Measured on the H200 (bench/doc_attention.py, 2026-12-03, torch 2.11, a Qwen2.5-7B layer's
# attention, 32 x 1024 tokens packed from examples of mean 162, bf16, forward + backward): full
# causal flash 2.65 ms; sdpa under the dense document mask 6.13 ms; this operator, when it made its
# mask on every call, 6.80 ms, of which `block_mask` was 3.10 ms (FlexAttention alone, its mask
# made once: 2.66 ms): hence one mask a batch (not yet timed on the H200). An operator backward
# of our own, which could only run FlexAttention's forward again, took 11.83 ms. The plan prices the
# operator as full causal attention: the bound.

import inspect
import weakref

import torch

IMPLEMENTATION = "lazytrain_documents"
BLOCK = 1024  # query rows per float32 score block of the reference kernels

_FLEX = None  # torch.compile(flex_attention), made on first use
_RETURN_AUX = None  # whether flex_attention returns the lse through return_aux, read on first use


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] int32: the document of each token, counted from 0 in each row."""
    starts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    starts = torch.cat([torch.zeros_like(starts[:, :1]), starts], dim=1)
    return starts.cumsum(-1, dtype=torch.int32)


def _rows_mask(ids, r0: int, r1: int, lo: int, window: int | None) -> torch.Tensor:
    """[B, r1 - r0, r1 - lo]: may query r0..r1 see key lo..r1 (keys past r1 are in the future)."""
    q = torch.arange(r0, r1, device=ids.device)[:, None]
    k = torch.arange(lo, r1, device=ids.device)[None, :]
    keep = (ids[:, r0:r1, None] == ids[:, None, lo:r1]) & (k <= q)
    return keep if window is None else keep & (q - k < window)


def document_mask(position_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, S, S] bool, True where query (row) may attend to key (column)."""
    S = position_ids.shape[-1]
    return _rows_mask(document_ids(position_ids), 0, S, 0, window)


def _blocks(S: int, window: int | None):
    """Query blocks (r0, r1) and the first key any of their queries can see."""
    for r0 in range(0, S, BLOCK):
        yield r0, min(r0 + BLOCK, S), 0 if window is None else max(0, r0 - window + 1)


def _grouped(x, KV: int) -> torch.Tensor:
    """[B, H, S, D] in float32 as [B, KV, H // KV, S, D]: query head h reads kv head h // (H // KV)."""
    B, H, S, D = x.shape
    return x.float().reshape(B, KV, H // KV, S, D)


def _scores(q5, k5, ids, r0, r1, lo, scale, window) -> torch.Tensor:
    s = q5[..., r0:r1, :] @ k5[..., lo:r1, :].transpose(-1, -2) * scale
    return s.masked_fill(~_rows_mask(ids, r0, r1, lo, window)[:, None, None], float("-inf"))


def _empty_out(query, value) -> torch.Tensor:
    """[B, H, S, Dv] laid out as [B, S, H, Dv], the layout Hugging Face transposes back."""
    B, H, S, _ = query.shape
    return query.new_empty(B, S, H, value.shape[-1]).transpose(1, 2)


def _reference_forward(query, key, value, ids, scale, window):
    B, H, S, _ = query.shape
    KV = key.shape[1]
    q5, k5, v5 = _grouped(query, KV), key.float()[:, :, None], value.float()[:, :, None]
    out, lse = _empty_out(query, value), query.new_empty(B, H, S, dtype=torch.float32)
    for r0, r1, lo in _blocks(S, window):
        s = _scores(q5, k5, ids, r0, r1, lo, scale, window)
        m = torch.logsumexp(s, dim=-1)
        out[:, :, r0:r1] = (torch.exp(s - m[..., None]) @ v5[..., lo:r1, :]).reshape(B, H, r1 - r0, -1)
        lse[:, :, r0:r1] = m.reshape(B, H, r1 - r0)
    return out, lse


def _reference_backward(grad_out, query, key, value, out, lse, ids, scale, window):
    B, H, S, D = query.shape
    KV = key.shape[1]
    q5, k5, v5 = _grouped(query, KV), key.float()[:, :, None], value.float()[:, :, None]
    do5 = _grouped(grad_out, KV)
    delta = (do5 * _grouped(out, KV)).sum(-1, keepdim=True)  # rowsum(dout * out)
    lse5 = lse.reshape(B, KV, H // KV, S, 1)
    dq = torch.empty_like(q5)
    dk = key.new_zeros(key.shape, dtype=torch.float32)
    dv = value.new_zeros(value.shape, dtype=torch.float32)
    for r0, r1, lo in _blocks(S, window):
        p = torch.exp(_scores(q5, k5, ids, r0, r1, lo, scale, window) - lse5[..., r0:r1, :])
        dob = do5[..., r0:r1, :]
        dv[:, :, lo:r1] += (p.transpose(-1, -2) @ dob).sum(2)
        ds = p * (dob @ v5[..., lo:r1, :].transpose(-1, -2) - delta[..., r0:r1, :])
        dq[..., r0:r1, :] = ds @ k5[..., lo:r1, :] * scale
        dk[:, :, lo:r1] += (ds.transpose(-1, -2) @ q5[..., r0:r1, :]).sum(2) * scale
    return dq.reshape(B, H, S, D).to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def _uses_flex(query) -> bool:
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)


FLEX_BLOCK = 128  # FlexAttention's block of queries and of keys


def block_mask(ids: torch.Tensor, window: int | None):
    """FlexAttention's BlockMask for the document ids [B, S], from each block's first and last
    document (ids never decrease along a row): a key block is skipped when its last document ends
    before the query block's first one starts, or it lies in the future or beyond the window; it is
    full, its mask not evaluated, when both blocks lie in one document and inside the window."""
    from torch.nn.attention.flex_attention import BlockMask

    B, S = ids.shape
    n = -(-S // FLEX_BLOCK)
    padded = torch.cat([ids, ids[:, -1:].expand(B, n * FLEX_BLOCK - S)], dim=1).view(B, n, FLEX_BLOCK)
    first, last = padded[..., 0], padded[..., -1]
    qb = torch.arange(n, device=ids.device)[:, None]
    kb = torch.arange(n, device=ids.device)[None, :]
    seen = (kb <= qb) & (last[:, None, :] >= first[:, :, None])  # [B, query block, key block]
    full = (kb < qb) & (first[:, None, :] == last[:, :, None])
    if S % FLEX_BLOCK:  # the last blocks are part padding: their mask is evaluated
        full &= (qb < n - 1) & (kb < n - 1)
    if window is not None:
        seen &= (qb - kb - 1) * FLEX_BLOCK + 1 < window  # some query-key pair is inside the window
        full &= (qb - kb + 1) * FLEX_BLOCK - 1 < window  # every pair is
    partial = seen & ~full

    def indexed(blocks):
        blocks = blocks[:, None]  # one mask for every head
        order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
        return blocks.sum(-1, dtype=torch.int32), order.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        same = ids[b, q_idx.clamp(max=S - 1)] == ids[b, kv_idx.clamp(max=S - 1)]
        keep = same & (kv_idx <= q_idx)
        return keep if window is None else keep & (q_idx - kv_idx < window)

    return BlockMask.from_kv_blocks(*indexed(partial), *indexed(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(S, S))


_MADE: dict = {"batch": None, "version": -1, "masks": {}}  # the block masks of one batch's position_ids


def batch_block_mask(position_ids: torch.Tensor, window: int | None):
    """`block_mask` of these position_ids, made once for every attention layer that reads them
    (3.1 ms a call for a 7B layer at 32 x 1024: NOTE: [Document attention]). The layers take the
    same batch tensor, or views of it: a mask is reused only while that very tensor (by identity,
    held weakly, so a new batch at the same address is another tensor) is unchanged (its version
    counter, which in-place writes through any view advance) and is seen through the same view."""
    base = position_ids if position_ids._base is None else position_ids._base
    held = _MADE["batch"]
    if held is None or held() is not base or _MADE["version"] != base._version:
        _MADE.update(batch=weakref.ref(base), version=base._version, masks={})
    view = (window, tuple(position_ids.shape), position_ids.stride(), position_ids.storage_offset())
    if view not in _MADE["masks"]:
        _MADE["masks"][view] = block_mask(document_ids(position_ids), window)
    return _MADE["masks"][view]


def flex_attention(query, key, value, mask, scale):
    """FlexAttention (compiled once) under the block mask `mask`: (out laid out as [B, S, H, D],
    lse in natural log). Differentiable through FlexAttention's own backward where autograd records."""
    global _FLEX, _RETURN_AUX
    from torch.nn.attention import flex_attention as fa

    if _FLEX is None:
        _FLEX = torch.compile(fa.flex_attention, dynamic=False)
    if _RETURN_AUX is None:
        # torch >= 2.9 asks for the lse through return_aux (return_lse is deprecated there); both
        # return it in natural log: the kernels' base-2 statistic is scaled by ln 2 before it leaves.
        _RETURN_AUX = "return_aux" in inspect.signature(fa.flex_attention).parameters
    kwargs = dict(block_mask=mask, scale=scale, enable_gqa=True)
    if _RETURN_AUX:
        out, aux = _FLEX(query, key, value, return_aux=fa.AuxRequest(lse=True), **kwargs)
        lse = aux.lse
    else:
        out, lse = _FLEX(query, key, value, return_lse=True, **kwargs)
    if not out.transpose(1, 2).is_contiguous():
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
    return out, lse.detach().float()


@torch.library.custom_op("lazytrain::document_attention", mutates_args=())
def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor,
                       scale: float, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """query [B, H, S, D], key and value [B, KV, S, D] (H % KV == 0), position_ids [B, S] ->
    (out [B, H, S, D] in query's dtype, laid out as [B, S, H, D]; lse [B, H, S] float32)."""
    if _uses_flex(query):  # reached below autograd: a forward that records nothing
        with torch.no_grad():
            return flex_attention(query, key, value, batch_block_mask(position_ids, window), scale)
    return _reference_forward(query, key, value, document_ids(position_ids), scale, window)


@document_attention.register_fake
def _(query, key, value, position_ids, scale, window):
    B, H, S, _ = query.shape
    return _empty_out(query, value), query.new_empty(B, H, S, dtype=torch.float32)


@torch.library.custom_op("lazytrain::document_attention_backward", mutates_args=())
def document_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, position_ids: torch.Tensor, scale: float,
                                window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, in the dtypes and shapes of query, key and value."""
    return _reference_backward(grad_out, query, key, value, out, lse, document_ids(position_ids), scale, window)


@document_attention_backward.register_fake
def _(grad_out, query, key, value, out, lse, position_ids, scale, window):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, position_ids, scale, window = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(query, key, value, position_ids, out, lse)
    ctx.scale, ctx.window = scale, window


def _backward(ctx, grad_out, grad_lse):
    query, key, value, position_ids, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.lazytrain.document_attention_backward(
        grad_out, query, key, value, out, lse, position_ids, ctx.scale, ctx.window)
    return dq, dk, dv, None, None, None


torch.library.register_autograd("lazytrain::document_attention", _backward, setup_context=_setup_context)


class _Reference(torch.autograd.Function):
    """The operator's own autograd, for a kernel registered above it (`_autograd_cuda`)."""

    @staticmethod
    def forward(ctx, query, key, value, position_ids, scale, window):
        with torch._C._AutoDispatchBelowAutograd():
            out, lse = torch.ops.lazytrain.document_attention(query, key, value, position_ids, scale, window)
        _setup_context(ctx, (query, key, value, position_ids, scale, window), (out, lse))
        return out, lse

    backward = staticmethod(_backward)


def _autograd_cuda(query, key, value, position_ids, scale, window):
    """The operator on CUDA: in bf16 and fp16, FlexAttention's own autograd records its backward,
    which reads the forward's lse (an operator backward of our own could only run FlexAttention's
    forward again: NOTE: [Document attention]); float32 keeps the reference."""
    if _uses_flex(query):
        return flex_attention(query, key, value, batch_block_mask(position_ids, window), scale)
    return _Reference.apply(query, key, value, position_ids, scale, window)


_LIB = torch.library.Library("lazytrain", "IMPL")
_LIB.impl("document_attention", _autograd_cuda, "AutogradCUDA")


# attention-interface arguments that change the softmax: refused rather than ignored
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "attn_logit_softcapping")


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
    """A transformers attention function (the contract of its sdpa_attention_forward): returns
    (attn_output [B, S, H, D], None). Documents come from kwargs["position_ids"]; attention_mask
    is ignored, since transformers builds none for this implementation (`register`)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError(f"attn_implementation={IMPLEMENTATION!r} finds the documents in position_ids, "
                         "and the attention layer was given none")
    if dropout:
        raise ValueError(f"attn_implementation={IMPLEMENTATION!r} has no attention dropout (got {dropout})")
    changed = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if changed or getattr(module, "is_causal", True) is False:
        what = ", ".join(changed) or "attention that is not causal"
        raise ValueError(f"attn_implementation={IMPLEMENTATION!r} computes plain causal softmax attention within each "
                         f"document; {type(module).__name__} also asks for {what}; train it with --packing off")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"attn_implementation={IMPLEMENTATION!r} is for training: queries and keys are the "
                         f"same tokens (got {query.shape[2]} queries, {key.shape[2]} keys)")
    position_ids = position_ids.expand(query.shape[0], -1)  # models pass [1, S] for unpacked batches
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, _ = torch.ops.lazytrain.document_attention(query, key, value, position_ids, scale, sliding_window)
    return out.transpose(1, 2), None


def _no_mask(*args, **kwargs):
    """The mask function of IMPLEMENTATION: the operator reads the documents from position_ids, so
    no [S, S] mask is built."""
    return None


def register() -> str:
    """Make IMPLEMENTATION a transformers attn_implementation (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)
    return IMPLEMENTATION
