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
from lazytrain.ir.stages import Stages
from lazytrain.units import format_size


def backward_floor(stages: Stages, s: int) -> tuple[int, dict[str, int]]:
    """What stage `s`'s backward holds on the GPU at once under any plan, and its parts."""
    g = stages.stages[s]
    grad_in = sum(stages.stages[p].grad_out_bytes for p in g.producers if stages.grad_maker(p) == s)
    parts = {"saved by its forward": g.saved_bytes, "made in its backward": g.backward_bytes - g.saved_bytes,
             "its output's and input's gradients": g.grad_out_bytes + grad_in,
             "its weights and their gradients": 2 * g.param_bytes}
    return sum(parts.values()), parts


def past_device(stages: Stages, hw: Hardware, need: int) -> str:
    """The sentences a refusal adds where `need` is more than any budget of this device (NOTE: [Past
    the device]); empty where it is not."""
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
            f"{format_size(hw.gpu_memory_bytes)}): it needs a GPU of at least {format_size(gpu, round_up=True)}. "
            f"Where it goes: {stages.stages[s].name}'s backward alone holds {format_size(floor)} under any plan "
            f"({said})")
    room = hw.host_capacity + (hw.disk_bytes if stages.disk else 0)
    if sum(outs) > room:
        text += (f"; the {len(outs)} stage outputs kept for backward are {format_size(sum(outs))}, where the host "
                 f"({format_size(hw.host_capacity)}, beside the optimizer's state)"
                 + (f" and the disk ({format_size(hw.disk_bytes)})" if stages.disk else "")
                 + f" hold {format_size(room)} in all, and the rest stay on the GPU or are recomputed")
    return text + ". Shrink the tokens per row or the batch, or compile for a larger device (--hardware)."
