"""Hooks on a bound model: its own APIs land the trainer's pending updates before they read weights.

NOTE: [Model sync hooks]
After `step()` the model's own parameters can lag the trainer: a GPU-stepped streamed stage applies
its update at the next forward's prefetch (NOTE: [GPU-stepped streamed stages] in solver/formulation.py),
a host step may still run, and a resident stage stepped on the GPU updates a device copy (NOTE:
[Parameter homes] in store.py). The deferral is a speed feature, so it stays; instead `bind` puts a
state-dict pre-hook and a forward pre-hook on every submodule of the model, and each calls
`sync_model()` first when the trainer has stepped since its last sync. So `model.state_dict()`
(which `save_pretrained` and `torch.save(model.state_dict())` go through), `model(...)` and
`submodule(...)` see the updated weights; reading the parameters directly (`parameters()`,
`named_parameters()`, a tensor held from before) goes through no hook: `trainer.sync_model()` is
the explicit way. The trainer itself never calls the model's forward or state_dict, so the hooks
never fire inside a step; between syncs they cost one flag test per module call.
  - The hooks hold the trainer weakly: a garbage-collected trainer's hooks are removed.
  - Binding the model again lands the previous trainer's updates (the new one starts from them),
    then removes its hooks: only the latest trainer is consulted.
  - A copy of the bound model (`copy.deepcopy`, pickling) carries inert hooks: it is not bound.
"""

from __future__ import annotations

import weakref

import torch

_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> weakref to its trainer


class _SyncHook:
    """Both hooks' callable: `(module, ...) -> None`. A class, not a closure, so a bound model still
    pickles; the copy holds no trainer."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)

    def __call__(self, module, *args):
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None and trainer._model_behind:
            sync(trainer)

    def __getstate__(self):
        return {"_trainer": None}


def sync(trainer) -> None:
    """`sync_model()`, outside inference mode: optimizer states the pending steps create must stay
    usable by later training steps (inference tensors cannot be updated outside inference mode)."""
    with torch.inference_mode(False):
        trainer.sync_model()


def land_previous(model: torch.nn.Module) -> None:
    """Before another trainer binds `model`: the previous one's pending updates into the model."""
    ref = _BOUND.get(model)
    old = ref() if ref is not None else None
    if old is not None and old._model_behind:
        sync(old)


def attach(trainer, model: torch.nn.Module) -> None:
    """Hook `model` to `trainer`, replacing the hooks of a trainer bound to it before."""
    ref = _BOUND.get(model)
    old = ref() if ref is not None else None
    if old is not None:
        old._sync_finalizer()  # removes its hooks
    hook = _SyncHook(trainer)
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(hook))
        handles.append(m.register_state_dict_pre_hook(hook))
    trainer._sync_finalizer = weakref.finalize(trainer, _remove, handles)
    _BOUND[model] = weakref.ref(trainer)


def _remove(handles) -> None:
    for h in handles:
        h.remove()
