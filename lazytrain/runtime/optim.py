"""AdamW stepped one stage at a time, with the arithmetic of the optimizer it wraps.

The schedule runs each stage's optimizer step as soon as that stage's gradients are complete (an
OPT_STEP event), some on the CPU worker thread while others run on the main thread, so the
optimizer has one parameter group per stage and `step_group(i)` steps group i alone. It does so
through a per-group view of the optimizer that shares the group's dict (so LR schedulers reach it)
and the state dict (so `state_dict()` sees everything), and never mutates shared structure, so steps
of different groups may run concurrently.

Two precisions of state: "32bit" wraps `torch.optim.AdamW`; "8bit" wraps bitsandbytes'
`AdamW8bit` (blockwise-quantised moments; optim8bit.py, imported only when asked for). An 8-bit optimizer steps
the groups marked `"states": "32bit"` (host-stepped stages, NOTE: [State precision per stage] in
solver/formulation.py) with `torch.optim.AdamW`'s arithmetic; all groups share one state dict, so
`state_dict()` holds both kinds.

NOTE: [bf16 master weights]
With `--master-weights bf16` the parameters the optimizer updates are bf16. Each is stepped
through an fp32 twin (one tensor at a time, so the extra memory is one tensor's) and rounded back
stochastically: up or down to a neighbouring bf16 with probability given by the distance, so the
rounding is unbiased and small updates accumulate in expectation instead of vanishing. The noise
is a function of (group, parameter, step) alone (`sr_seed`), not of the order steps run in, so a
run resumed from a checkpoint (which applies pending updates early) stays bit-identical.

NOTE: [Masters in the schedule's dtype]
The masters are what the schedule says (`MASTER_WEIGHTS`, printed in its header), whatever dtype
the model was built in: `bind` makes every floating parameter bf16 under `--master-weights bf16`
and fp32 otherwise, and `lazytrain train` loads a checkpoint straight into that dtype. A bf16
checkpoint under an fp32-master schedule once kept its bf16 parameters as the masters, stepped
partly through fp32 twins: a save, which lands pending updates early, then changed the rounding
and so the run (a Llama diverged from the step after each save). Now its masters are fp32, and a
checkpoint holds them.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from lazytrain.sizes import TWIN_CHUNK


def master_dtype(module, dtype: torch.dtype) -> torch.dtype:
    """The dtype schedule `module` keeps a parameter of `dtype` in as the optimizer's master (NOTE:
    [Masters in the schedule's dtype]): bf16 or fp32 for floating parameters, others as they are."""
    if not dtype.is_floating_point:
        return dtype
    return torch.bfloat16 if getattr(module, "MASTER_WEIGHTS", "fp32") == "bf16" else torch.float32


def round_stochastic_(dst: torch.Tensor, src: torch.Tensor, seed: int | None = None,
                      noise: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
    """`dst` (bf16) <- `src` (fp32) with stochastic rounding: random low 16 bits are added to the
    fp32 bit pattern, then truncated; a value 1/4 of the way between two bf16 numbers rounds up
    with probability 1/4. Infinities stay infinite. `seed`: draw the noise from seeded generators,
    element i of the whole parameter from chunk i // _NOISE_CHUNK's (NOTE: [Host rounding noise]);
    `offset`: where `src`'s first element sits in its whole parameter (a rank's piece, NOTE:
    [Sharded state] in sharding.py), so a piece rounds as the whole tensor would. `noise`: an int32
    buffer of `src`'s numel to draw it into (on a device: the memory the plan counted for it),
    instead of a fresh one."""
    bits = src.view(torch.int32)
    if seed is None:
        noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=src.device)
    else:
        out = noise.view(-1)[:bits.numel()] if noise is not None and src.device.type != "cpu" else (
            _host_buffer("noise", bits.numel(), torch.int32) if src.device.type == "cpu" else
            torch.empty(bits.numel(), dtype=torch.int32, device=src.device))
        noise = _seeded_noise(out, seed, offset).view(bits.shape)
    return dst.copy_(noise.add_(bits).bitwise_and_(-65536).view(torch.float32))


# NOTE: [Host rounding noise] A seeded CPU generator draws one number at a time on one core: 3.4
# ns per parameter measured on a 2-core machine, eight times the fused AdamW step it follows. So the
# noise comes in fixed chunks of a parameter's elements, each from its own generator seeded by
# (seed, chunk), drawn on the host on as many threads as torch uses; the chunk size is fixed, so
# the noise of an element depends on the seed and its index in the parameter alone, not on how the
# parameter is cut (a data-parallel rank's piece draws what the whole tensor would there). A piece
# starting inside a chunk draws that chunk from its start (a host generator's first k draws are
# the same whatever the size asked for); on a device a chunk is always drawn whole (the values a
# device generator gives an element depend on the size drawn), into a chunk-sized buffer where the
# piece covers only part of it.
_NOISE_CHUNK = 1 << 20
_noise_pool = None


def _seeded_noise(out: torch.Tensor, seed: int, offset: int = 0) -> torch.Tensor:
    """`out` (int32, flat) filled with the noise of elements [offset, offset + numel) of a parameter
    rounded with `seed`, in [0, 2**16)."""
    global _noise_pool
    n, C = out.numel(), _NOISE_CHUNK
    chunks = range(offset // C, -(-(offset + n) // C)) if n else range(0)
    host = out.device.type == "cpu"

    def fill(c: int) -> None:
        lo, hi = max(offset, c * C), min(offset + n, (c + 1) * C)
        gen = torch.Generator(device=out.device).manual_seed((seed * 1_000_003 + c) % (1 << 63))
        part = out[lo - offset:hi - offset]
        if (lo == c * C) if host else (hi - lo == C):  # host: a prefix of the chunk's draws; device: all of them
            torch.randint(0, 1 << 16, part.shape, generator=gen, dtype=torch.int32, out=part)
            return
        size = hi - c * C if host else C
        whole = torch.randint(0, 1 << 16, (size,), generator=gen, dtype=torch.int32, device=out.device)
        part.copy_(whole[lo - c * C:hi - c * C])
    if host and len(chunks) > 1:
        if _noise_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _noise_pool = ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()), thread_name_prefix="lazytrain-sr")
        list(_noise_pool.map(fill, chunks))
    else:
        for c in chunks:
            fill(c)
    return out


# NOTE: [Host step buffers] Fresh host buffers of a tensor's size are page-faulted in on first
# touch, every step. So host steps reuse one buffer per role and thread, grown to the largest tensor
# they meet: on the H200 machine a 7B layer's bf16-master host step went from 0.67 to 0.45 s
# (`bench/host_step.py`). Device tensors keep using the caching allocator.
_host_buffers = threading.local()


def _host_buffer(role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat `dtype` buffer of `numel` elements, reused by this thread for `role`."""
    bufs = _host_buffers.__dict__
    buf = bufs.get(role)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        buf = bufs[role] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def _fp32(t: torch.Tensor, role: str) -> torch.Tensor:
    """An fp32 copy of `t`: in a reused buffer on the host (NOTE: [Host step buffers])."""
    if t.device.type != "cpu":
        return t.float()
    return _host_buffer(role, t.numel(), torch.float32).view(t.shape).copy_(t)


class _Staged:
    """Mixin over an optimizer class: per-group steps through views."""

    def _make_views(self) -> list:
        # hooks and defaults as the parent's; not an instance-level `step` (LR schedulers patch one in)
        base = {k: v for k, v in self.__dict__.items() if k not in ("_views", "step")}
        return [_view(type(self).__mro__[2], base, [group], self.state) for group in self.param_groups]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._views = self._make_views()
        self._sr_steps: dict[tuple[int, int], int] = {}

    def sr_seed(self, group: int, index: int, state: dict) -> int:
        """The rounding noise's seed for parameter `index` of `group`, just stepped (NOTE: [bf16
        master weights]). The step count is read from its state once (a device tensor: reading
        it waits for the device), then counted on the host."""
        key = (group, index)
        if key in self._sr_steps:
            self._sr_steps[key] += 1
        else:
            step = state.get("step", 0)
            self._sr_steps[key] = int(step.item()) if torch.is_tensor(step) else int(step)
        return ((group * 1_000_003 + index) * 1_000_000_007 + self._sr_steps[key]) % (1 << 63)

    def step_group(self, index: int, hyper: dict | None = None) -> None:
        """Step group `index` alone; `hyper` overrides its hyperparameters (values snapshotted when
        the step was asked for, for steps that run later)."""
        # the parent's instance `step` (LR schedulers wrap it to count calls) is not run here
        self._opt_called = True
        view = self._views[index]
        if hyper is not None:
            view = _view(type(view), view.__dict__, [{**view.param_groups[0], **hyper}], view.state)
        self._run_view(view, index)

    def step_on(self, index: int, params: list, state: dict, hyper: dict, positions: list[int] | None = None) -> None:
        """Group `index`'s step applied to stand-ins: `params` (with `.grad`) and `state` (param ->
        its state) replace the group's own, e.g. device twins of host masters; `positions`: theirs
        in the group (default: all of them, in order)."""
        self._opt_called = True
        view = self._views[index]
        group = narrowed({**view.param_groups[0], **hyper}, params, positions)
        self._run_view(_view(type(view), view.__dict__, [group], state), index)

    def fresh_state(self, index: int, param: torch.Tensor, take, position: int | None = None) -> dict:
        """The state group `index`'s first step would create for `param` (a stand-in for the group's
        parameter at `position`, default: `param` itself), with its tensors cut by
        `take(shape, dtype)` (zeroed here), so a first step on a device twin allocates nothing of its
        own (NOTE: [First step's states] in gpu_step.py)."""
        return _adamw_fresh_state(self.param_groups[index], param, take)

    def hyperparameters(self, index: int) -> dict:
        return {k: v for k, v in self.param_groups[index].items() if k != "params"}

    def _run_view(self, view, index: int) -> None:
        params = view.param_groups[0]["params"]
        if all(p.dtype == torch.float32 for p in params):
            self._step(view)
            return
        offsets = view.param_groups[0].get("offsets") or [0] * len(params)  # NOTE: [Sharded state] in sharding.py
        for i, p in enumerate(params):  # NOTE: [bf16 master weights]
            if p.grad is not None:
                self._step_twin(view, index, i, p, offsets[i])

    def _position(self, index: int, param: torch.Tensor, position: int | None) -> int:
        """Where `param` (or the stand-in for the parameter at `position`) sits in group `index`."""
        if position is not None:
            return position
        return next((i for i, q in enumerate(self.param_groups[index]["params"]) if q is param), 0)

    def _step_twin(self, view, index: int, i: int, p: torch.Tensor, offset: int) -> None:
        """Parameter `p` (bf16) stepped through an fp32 twin, then rounded back, `TWIN_CHUNK`
        elements at a time (NOTE: [Twin chunks] in sizes.py). A function of its own so the twins and their
        gradients die on return, before the next parameter's are made (NOTE: [Resident steps] in
        solver/footprint.py). `offset`: where `p` starts in its whole parameter (NOTE: [Sharded
        state] in sharding.py)."""
        numel = p.numel()
        pieces = twin_pieces(view.state[p], numel)
        if len(pieces) == 1:  # the tensor whole, in its shape (its state's shape)
            view.state[p], _ = self._step_piece(view, index, i, p.detach(), p.grad, view.state[p], offset)
            return
        if not view.state[p]:  # the first step: the whole state, as a one-piece step makes it
            widen = lambda shape, dtype: torch.zeros(shape, dtype=torch.float32 if dtype.is_floating_point else dtype,
                                                     device=p.device)
            view.state[p] = self.fresh_state(index, p.detach(), widen, position=i)
        whole, flat, grad, seed = view.state[p], p.detach().view(-1), p.grad.view(-1), None
        for lo, hi in pieces:
            stepped, seed = self._step_piece(view, index, i, flat[lo:hi], grad[lo:hi], state_piece(whole, lo, hi, numel),
                                             offset + lo, seed)
        whole["step"] = stepped["step"]  # every piece stepped the count it started from once

    def _step_piece(self, view, index: int, i: int, weights: torch.Tensor, grad: torch.Tensor, state: dict,
                    offset: int, seed: int | None = None) -> tuple[dict, int]:
        """`weights` (bf16, a view of parameter `i` of group `index` or all of it) stepped through an
        fp32 twin with `state`, then rounded back with `seed` (None: the parameter's next, drawn once
        per step); the state after the step, and the seed."""
        twin = _fp32(weights, "master")
        twin.grad = _fp32(grad, "grad")
        states = defaultdict(dict, {twin: state})
        self._step(_view(type(view), view.__dict__, [narrowed(view.param_groups[0], [twin], [i])], states))
        seed = self.sr_seed(index, i, states[twin]) if seed is None else seed
        with torch.no_grad():
            round_stochastic_(weights, twin, seed, offset=offset)
        return states[twin], seed

    def _step(self, view) -> None:
        view.step()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # Loading casts floating state to each parameter's dtype (bitsandbytes: even AdamW's step
        # count); bf16 masters keep fp32 moments and steps. A step count stays where loading put it.
        params = [p for group in self.param_groups for p in group["params"]]
        saved = [i for group in state_dict["param_groups"] for i in group["params"]]
        for p, i in zip(params, saved):
            if p.dtype != torch.float32 and i in state_dict["state"]:
                for k, v in state_dict["state"][i].items():
                    if torch.is_tensor(v) and v.is_floating_point():
                        device = self.state[p][k].device if k == "step" else p.device
                        self.state[p][k] = v.to(device, copy=True)
        self._views = self._make_views()
        self._sr_steps = {}


def twin_pieces(state: dict, numel: int) -> list[tuple[int, int]]:
    """[lo, hi) element ranges a bf16 master steps in: one piece up to `TWIN_CHUNK`, else pieces of
    `TWIN_CHUNK` when its state can be cut there (NOTE: [Twin chunks] in sizes.py)."""
    if numel <= TWIN_CHUNK or not _cuttable(state, numel):
        return [(0, numel)]
    return [(lo, min(lo + TWIN_CHUNK, numel)) for lo in range(0, numel, TWIN_CHUNK)]


def _sliced(key: str, v) -> bool:
    """Whether state entry `key` holds values per element or per quantisation block (not a scalar,
    nor bitsandbytes' shared quantisation map)."""
    return torch.is_tensor(v) and v.dim() > 0 and not key.startswith("qmap")


def _block(v: torch.Tensor, numel: int) -> int:
    """Elements per value of a state tensor over a `numel`-element parameter (1: per element)."""
    return -(-numel // v.numel())


def _cuttable(state: dict, numel: int) -> bool:
    """Whether every tensor of `state` is per element, or per quantisation block of a size that
    divides `TWIN_CHUNK` (bitsandbytes' absmax), so a piece's state is a slice of each."""
    return all(TWIN_CHUNK % _block(v, numel) == 0 and -(-numel // _block(v, numel)) == v.numel()
               for key, v in state.items() if _sliced(key, v) and v.numel() != numel)


def state_piece(state: dict, lo: int, hi: int, numel: int) -> dict:
    """Elements [lo, hi) of a parameter's optimizer state: views of its per-element and per-block
    tensors, a copy of its step count (each piece counts the step once), the rest shared."""
    piece = {}
    for key, v in state.items():
        if key == "step":
            piece[key] = v.clone() if torch.is_tensor(v) else v
        elif _sliced(key, v):
            block = _block(v, numel)
            piece[key] = v.view(-1)[lo // block:-(-hi // block)]
        else:
            piece[key] = v
    return piece


def _adamw_fresh_state(group: dict, param: torch.Tensor, take) -> dict:
    """`torch.optim.AdamW`'s lazy state initialisation (`Adam._init_group`), with the moments cut by
    `take`: `step` on the parameter's device when fused or capturable, else a host scalar. The
    moments are those of the fp32 twin a 16-bit master steps through (NOTE: [bf16 master weights]):
    fp32. (Made in the master's dtype, a bf16 master's moments on disk had regions half their size:
    the 7B at 1 x 65536 on the H200, 2026-12-02.)"""
    from torch.optim.optimizer import _get_scalar_dtype

    on_device = bool(group.get("fused") or group.get("capturable"))
    dtype = torch.float32 if param.dtype in (torch.bfloat16, torch.float16) else param.dtype
    state = {"step": take((), _get_scalar_dtype(is_fused=bool(group.get("fused")))).zero_() if on_device
             else torch.tensor(0.0, dtype=_get_scalar_dtype()),
             "exp_avg": take(param.shape, dtype).zero_(),
             "exp_avg_sq": take(param.shape, dtype).zero_()}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = take(param.shape, dtype).zero_()
    return state


# per parameter of a group, in its order: where a sharded rank's pieces sit in their parameters, and
# those parameters' sizes (NOTE: [Sharded state] in sharding.py)
PER_PARAMETER = ("offsets", "numels")


def narrowed(group: dict, params: list, positions: list[int] | None = None) -> dict:
    """`group` over `params`, stand-ins for its parameters at `positions` (default: all of them, in
    order): its lists per parameter follow them."""
    out = {**group, "params": params}
    if positions is not None:
        for key in PER_PARAMETER:
            if key in group:
                out[key] = [group[key][i] for i in positions]
    return out


def _view(cls, attrs: dict, groups: list, state: dict):
    view = cls.__new__(cls)
    view.__dict__.update(attrs)
    view.param_groups = groups
    view.state = state
    return view


class StagedAdamW(_Staged, torch.optim.AdamW):
    pass


def staged_optimizer(states: str, groups: list[dict], **kwargs) -> torch.optim.Optimizer:
    if states == "32bit":
        return StagedAdamW(groups, **kwargs)
    if states == "8bit":
        from lazytrain.runtime.optim8bit import staged_adamw8bit  # bitsandbytes, imported only when asked for

        return staged_adamw8bit(groups, **kwargs)
    raise ValueError(f"optimizer states {states!r}: use '32bit' or '8bit'")
