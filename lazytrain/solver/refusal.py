"""What a refusal says when no budget this device has could hold a plan: the GPU it would need,
and where the bytes go (NOTE: [Past the device])."""

# NOTE: [Past the device]
# A smallest feasible budget above the device's largest (`Hardware.max_budget`) cannot be met by
# raising --budget, so the refusal says what no plan on this box avoids. The 7B at 1 x 1,048,576
# tokens with tiled MLPs and norms and the disk tier needs 162.7 GiB of the H200's 137.8 (CPU plans,
# 2026-12-03, bench/README.md): a layer's backward alone holds about 92 GiB whatever the plan (49.1
# GiB its forward saved, 28 more in its backward, the 7 GiB gradients of its output and its input,
# its weights and their gradients), and the 28 layers' 7 GiB outputs (196 GiB) do not fit beside
# the optimizer's host memory (128 GB) and the disk (64 GB), so the plan keeps some of them on the
# GPU. The refusal gives those figures from the plan's own stages, and the smallest GPU that would
# do: the budget plus what the device keeps outside any plan. (Since attention reads its key-value
# heads unrepeated, NOTE: [Grouped-query attention unrepeated] in passes/gqa.py, the same row's
# least is 131.5 GiB, inside the device: CPU plans, 2026-12-04; 130.7 GiB since its outputs are
# placed by the tile, NOTE: [Boundary tiles] in boundary.py, 2026-12-05. Priced fused with
# attention's backward workspace counted, NOTE: [Workspace the trace cannot see] in
# analysis/fused_transients.py, it is 149.6 GiB again past the device, a layer's backward 89.0 GiB:
# the refusal names a GPU of 151.6 GiB, and 983,040 tokens fit in 132.4.)

from __future__ import annotations

from lazytrain.hardware import Hardware
from lazytrain.ir.stages import STATE_BYTES, Stages
from lazytrain.solver.footprint import disk_available
from lazytrain.solver.shards import sharding
from lazytrain.solver.workspace import backward_workspace
from lazytrain.units import format_size

# NOTE: [State past the host]
# Where the masters and optimizer states of all parameters are more than the host (and the disk,
# with --disk) may hold, the rest of them stays on the GPU whatever the plan, and that, not a
# layer's backward, is what the GPU it needs is made of. Llama-3-70B's shape at 1 x 4096 with fp32
# masters and 32-bit states (12 bytes a parameter, 788.5 GiB) on the H200 box (113.2 GiB of host a
# fused plan may use) needs a GPU of 948.0 GiB (CPU plan, 2026-12-05), where a layer's backward
# holds 8.8.
# The refusal then says so and names the options that shrink the state (8-bit states: about 2
# bytes a parameter in place of 8; bf16 masters: 2 in place of 4; --disk; with exact clipping,
# clipping by the previous norm, since only a block stepped in its own backward keeps its states on
# disk without a host buffer as large, and exact clipping steps nothing before the global norm),
# not a shorter batch. (That 70B shape with 8-bit states, bf16 masters and --disk plans within the
# whole H200 at previous-norm or no clipping, 135.8 GiB, and none fits it with exact clipping.)
# Where that state alone leaves the GPU more than the budget, no tiles of the token-wise work can
# help (they shrink activations), so the compile refuses without capturing again in tiles
# (`InfeasibleBudget.any_tiles`; NOTE: [Tiles where nothing else fits] in pipeline.py): the 70B
# refusal took 66 s with the tiled captures and solves, most of it for nothing.


def backward_floor(stages: Stages, s: int) -> tuple[int, dict[str, int]]:
    """What stage `s`'s backward holds on the GPU at once under any plan, and its parts."""
    g = stages.stages[s]
    grad_in = sum(stages.stages[p].grad_out_bytes for p in g.producers if stages.grad_maker(p) == s)
    parts = {"saved by its forward": g.saved_bytes, "made in its backward": backward_workspace(g),
             "its output's and input's gradients": g.grad_out_bytes + grad_in,
             "its weights and their gradients": 2 * g.param_bytes}
    return sum(parts.values()), parts


def past_device(stages: Stages, hw: Hardware, need: int, proven: bool = True) -> str:
    """The sentences a refusal adds where `need` is more than any budget of this device (NOTE: [Past
    the device]); empty where it is not. `proven`: `need` is the least a plan needs, not only a
    budget a plan was found to fit (the least-memory search stopped at its time limit)."""
    if need <= hw.max_budget:
        return ""
    gpu = need + hw.gpu_memory_bytes - hw.max_budget
    # a chunked loss stage's figures are the whole batch's; its chunks hold a fraction of them
    whole = [g.index for g in stages.stages if g.chunks == 1] or [0]
    s = max(whole, key=lambda i: backward_floor(stages, i)[0])
    floor, parts = backward_floor(stages, s)
    said = ", ".join(f"{format_size(v)} {k}" for k, v in parts.items() if v > 0)
    outs = [g.out_bytes for g in stages.stages if g.consumers and g.index < len(stages.stages) - 1]
    text = (f"That is more than hardware profile '{hw.name}' lets a plan use ({format_size(hw.max_budget)} of its "
            f"{format_size(hw.gpu_memory_bytes)}): " + (f"it needs a GPU of at least {format_size(gpu, round_up=True)}. "
            if proven else f"a GPU of {format_size(gpu, round_up=True)} would hold it, and a smaller one may. "))
    state = state_past_host(stages, hw)
    if state:
        return text + state
    text += (f"Where it goes: {stages.stages[s].name}'s backward alone holds {format_size(floor)} under any plan "
             f"({said})")
    room = _state(stages, hw)[2]
    if sum(outs) > room:
        text += (f"; the {len(outs)} stage outputs kept for backward are {format_size(sum(outs))}, where the host "
                 f"({format_size(hw.host_capacity)}, beside the optimizer's state)"
                 + (f" and the disk ({format_size(hw.disk_bytes)})" if stages.disk else "")
                 + f" hold {format_size(room)} in all, and the rest stay on the GPU or are recomputed")
    return text + ". Shrink the tokens per row or the batch, or compile for a larger device (--hardware)."


def _state(stages: Stages, hw: Hardware) -> tuple[int, float, int]:
    """This rank's parameters, the master and state bytes each, and what host and disk may hold."""
    numel = -(-(sum(g.param_numel for g in stages.stages) + stages.shared_numel) // sharding(stages))
    return numel, stages.master_bytes + stages.state_bytes, hw.host_capacity + (hw.disk_bytes if stages.disk else 0)


def state_floor(stages: Stages, hw: Hardware) -> int:
    """The training state the GPU holds under any plan, whatever the activations and their tiles:
    the masters and optimizer states that host and disk cannot (NOTE: [State past the host])."""
    numel, per, room = _state(stages, hw)
    return max(0, int(numel * per) - room)


def state_past_host(stages: Stages, hw: Hardware) -> str:
    """Where all parameters' masters and optimizer states are more than host and disk may hold, the
    sentences that say so and name what shrinks them (NOTE: [State past the host]); else empty."""
    numel, per, room = _state(stages, hw)
    if int(numel * per) <= room:  # `state_floor` is 0
        return ""
    where = "the host" + (" and the disk" if stages.disk else "")
    count = f"{numel / 1e9:.2f} G" if numel >= 1e9 else f"{numel / 1e6:.2f} M"
    text = (f"Where it goes: its training state alone, the masters and optimizer states of {count} parameters"
            + (" (this rank's share)" if sharding(stages) > 1 else "")
            + f" ({per:g} bytes each: {format_size(numel * per)}), is more than {where} may hold "
            f"({format_size(room)}), so the rest of it stays on the GPU. ")
    smaller = [flag for flag, unused in (("--optimizer-states 8bit", stages.state_bytes > STATE_BYTES["8bit"]),
                                         ("--master-weights bf16", stages.master_bytes > 2)) if unused]
    if smaller:
        smaller[-1] += f" (8-bit states and bf16 masters take it to {format_size(numel * (2 + STATE_BYTES['8bit']))})"
    disk = stages.disk or disk_available(hw)
    fixes = smaller + (["--disk"] if disk and not stages.disk else []) + (
        ["--clipping previous-norm (blocks may then step in their own backward, with their states on disk)"]
        if disk and stages.clipping == "exact" and sharding(stages) == 1 else [])
    if not fixes:
        return text + "Compile for a host with more memory (--hardware), or shard it over several GPUs (--world-size)."
    return text + f"Shrink it with {', '.join(fixes)}, or compile for a host with more memory (--hardware)."
