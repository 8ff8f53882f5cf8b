"""Ranks for the sharded 8-bit state tests (test_data_parallel_8bit.py), launched by dp_worker.launch:
each rank binds a schedule with sharded 8-bit states and one with them replicated, steps both on its
rows of the same global batches, and compares them with each other and with one process's eager
model stepped by bitsandbytes' AdamW8bit on the global batch.
"""

from __future__ import annotations

import copy

import torch

from dp_worker import HP, STEPS, _loss, bind, global_batch, pair, rows_of, weights_digest
from lazytrain.sizes import QUANT_BLOCK
from checks import reference_optimizers

MIN_8BIT = 4096  # bitsandbytes' default min_8bit_size: smaller parameters keep 32-bit states


def check_block_shards(trainer, rank: int, world: int) -> dict[str, str]:
    """Each parameter's piece on this rank is whole quantisation blocks from rank * chunk (chunk:
    ceil(numel / world) rounded up to a block), and its states are 8-bit exactly where its whole
    parameter has MIN_8BIT elements or more, whatever the piece's size. {parameter: its states' kind:
    "8bit", "32bit" (bitsandbytes') or "adamw" (torch's, on a host-stepped stage)}."""
    kinds = {}
    for p, home in trainer.store.home.items():
        n = trainer.store.master[p].numel()
        c = -(-(-(-n // world)) // QUANT_BLOCK) * QUANT_BLOCK
        lo, hi = min(n, rank * c), min(n, (rank + 1) * c)
        assert home.numel() == hi - lo, f"{p}: rank {rank} holds {home.numel()} of its {n} elements, not {hi - lo}"
        assert trainer.store.offset(p) == lo, f"{p}: rank {rank}'s piece starts at {trainer.store.offset(p)}, not {lo}"
        if p in trainer.store.held:  # NOTE: [Sharded host weights]: the host keeps the same piece of the weights
            assert trainer.store.source[p].numel() == hi - lo, f"{p}: rank {rank}'s host holds another cut"
        state = trainer.optimizer.state[home]
        assert state, f"{p}: no states on rank {rank} ({hi - lo} of {n} elements)"
        if "exp_avg" in state:  # a host-stepped stage's: torch AdamW's (NOTE: [State precision per stage])
            assert state["exp_avg"].numel() == hi - lo
            kinds[p] = "adamw"
            continue
        eight = state["state1"].dtype == torch.uint8
        assert eight == (n >= MIN_8BIT), f"{p} ({n} elements, {hi - lo} on rank {rank}) has {state['state1'].dtype} states"
        assert state["state1"].numel() == hi - lo
        if eight:
            assert state["absmax1"].numel() == -(-(hi - lo) // QUANT_BLOCK), f"{p}: absmax of another cut"
        kinds[p] = "8bit" if eight else "32bit"
    return kinds


def check_sharded_8bit(rank, world, name, sharded_source, replicated_source):
    """STEPS steps of the sharded and the replicated schedule on this rank's rows: the same losses and
    weights bit for bit (both step the same averaged gradients; one cut into whole blocks, one
    whole), and the eager model's loss and, within bitsandbytes' 8-bit tolerance, its weights."""
    _, real, _ = pair(name)
    sharded, model = bind(sharded_source, real, **HP)
    replicated, whole = bind(replicated_source, real, **HP)
    assert sharded.sharded and not replicated.sharded
    start, ref = copy.deepcopy(real), copy.deepcopy(real)
    opts = reference_optimizers(sharded.m, ref, HP)
    for i in range(STEPS):
        glob = global_batch(name, world, seed=60 + i)
        loss = sharded.step(rows_of(glob, rank, world))
        assert torch.equal(loss, replicated.step(rows_of(glob, rank, world))), f"step {i}: the losses differ"
        for opt in opts:
            opt.zero_grad()
        ref_loss = _loss(ref(**glob))
        ref_loss.backward()
        for opt in opts:
            opt.step()
        assert torch.allclose(loss, ref_loss.detach(), atol=1e-5, rtol=1e-5), f"step {i}: loss {loss} != eager {ref_loss}"
    sharded.sync_model()  # with sharded host weights a sync gathers the model's own (NOTE: [Sharded host weights])
    replicated.sync_model()
    kinds = check_block_shards(sharded, rank, world)
    for (pname, got), want, eager, p0 in zip(model.named_parameters(), whole.parameters(), ref.parameters(),
                                             start.parameters()):
        assert torch.equal(got, want), f"{pname}: sharded differs from replicated by {(got - want).abs().max():.3g}"
        # the eager gradients are sums over the global batch, the ranks' the average of two halves:
        # equal to rounding, which an 8-bit moment may turn into a quantisation step (bitsandbytes'
        # own tests allow 2 % between its 8-bit and 32-bit updates)
        mine, theirs = got.detach() - p0, eager.detach() - p0
        assert (mine - theirs).norm() <= 0.02 * theirs.norm() + 1e-7, f"{pname} differs from eager AdamW8bit"
    return weights_digest(model), kinds


def check_checkpoint_refused(rank, world, name, source):
    """A distributed checkpoint of sharded 8-bit states is refused, saving and loading, with the fix."""
    from lazytrain.errors import CheckpointError

    _, real, _ = pair(name)
    trainer, _ = bind(source, real, **HP)
    trainer.step(rows_of(global_batch(name, world, seed=7), rank, world))
    messages = []
    for call in (trainer.sharded_state_dict, lambda: trainer.load_sharded_state_dict({"state": {}, "param_groups": []})):
        try:
            call()
        except CheckpointError as exc:
            messages.append(str(exc))
        else:
            raise AssertionError("a checkpoint of sharded 8-bit states was not refused")
    return messages
