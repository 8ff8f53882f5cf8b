"""Ranks for the sharded host weights tests (test_sharded_weights.py), launched by dp_worker.launch:
each rank binds a schedule whose host keeps its piece of the streamed weights and the same plan with
them whole, steps both on its rows of the same global batches, and compares them bit for bit.
"""

from __future__ import annotations

import torch

from dp_worker import HP, STEPS, bind, global_batch, pair, rows_of, weights_digest


def _placeholders(trainer, model) -> list[str]:
    """The model's parameters that hold no storage of their own (NOTE: [Sharded host weights])."""
    names = {trainer.m.PLACEHOLDERS[p][1] for p in trainer.store.held}
    return [n for n, t in model.named_parameters() if n in names and t.untyped_storage().nbytes() <= t.element_size()]


def check_held_equals_whole(rank, world, name, held_source, whole_source, max_grad_norm=None):
    """STEPS steps of both schedules on this rank's rows: the same losses, and after a sync the same
    weights bit for bit. The held schedule's host keeps only its pieces of the streamed weights, and
    its model's own parameters hold placeholders between steps: a sync lands the whole weights, the
    next step lets them go. Returns the weights' digest."""
    _, real, _ = pair(name)
    held, model = bind(held_source, real, max_grad_norm=max_grad_norm, **HP)
    whole, ref = bind(whole_source, real, max_grad_norm=max_grad_norm, **HP)
    assert held.store.held and not whole.store.held
    names = {held.m.PLACEHOLDERS[p][1] for p in held.store.held}
    for p in held.store.held:
        lo, hi = held.store.layout_of[p].span(p)
        assert held.store.source[p].numel() == hi - lo, f"{p}: rank {rank}'s host holds {held.store.source[p].numel()}"
    assert sorted(_placeholders(held, model)) == sorted(names), "the model kept streamed weights in host memory"
    for i in range(STEPS):
        rows = rows_of(global_batch(name, world, seed=70 + i), rank, world)
        loss, want = held.step(rows), whole.step(rows)
        assert torch.equal(loss, want), f"step {i}: loss {loss} != {want} with the host weights whole"
        if i == 0:  # the model's own state_dict() lands the whole weights (a collective); the step drops them
            sd = model.state_dict()
            assert not _placeholders(held, model) and all(sd[n].untyped_storage().nbytes() > 4 for n in names)
    assert sorted(_placeholders(held, model)) == sorted(names)
    held.sync_model()
    whole.sync_model()
    for (n, got), want in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(got, want), f"{n} differs from the whole host weights' by {(got - want).abs().max():.3g}"
    if max_grad_norm is not None:
        assert held.last_grad_norm == whole.last_grad_norm
    return weights_digest(model)
