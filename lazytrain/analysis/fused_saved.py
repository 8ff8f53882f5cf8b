"""What a stage's body saves for backward when Inductor compiles it (NOTE: [Fused saved activations]).

    model.layers.0 (Qwen2.5-1.5B shape, 16 x 1024, bf16): eager autograd saves 1696.9 MiB,
    AOTAutograd's partitioner 1224.9 MiB -> the fused plan keeps 1224.9 MiB from its forward

NOTE: [Fused saved activations]
`torch.compile` hands a stage's forward and backward to AOTAutograd, whose min-cut partitioner
(`min_cut_rematerialization_partition`, Inductor's) chooses what the compiled forward saves: it
recomputes cheap element-wise values in backward instead of keeping them. So a fused stage keeps
fewer bytes from forward to backward than eager autograd does, and a plan that counted eager's bytes
over-predicted its peak: on the H200 (2026-12-04, 2047494) every fused 1.5B and 7B row of the
fidelity table ran 5-31 % under its predicted peak (the 7B with 8-bit states and no budget: 103.2 GiB
allocated against 135.6 predicted), outside the 5 % check and room the solver could have spent on
keeping instead of recomputing.
So the plan asks the partitioner itself. `trace` runs a stage's body on fake tensors (no memory, no
device): eagerly under autograd, counting what autograd saves, and through
`aot_function` with Inductor's partitioner, counting what the partitioned forward returns for
backward beyond the stage's outputs. Both leave out the stage's inputs and parameters and views of
them (memory the plan counts elsewhere). The fused stage saves the plan's eager bytes less the
difference. The difference, not the partitioner's bytes themselves, because the two traces run the
CPU's operators (fake tensors of the capture device would need its backend): attention's saved
tensors, which the CPU and CUDA kernels keep differently, cancel, and what differs is element-wise
work, which is the same on both. For the layer above, eager's count on fake tensors equals the cost
model's own (1696.875 MiB), and the 1.5B fused rows ran 26 % under the eager price, 28 % here.
A body that will not trace (an operator without a fake-tensor rule) keeps eager's bytes: an
over-prediction, never an under-one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lazytrain.ir.evaluate import decode, evaluate
from lazytrain.ir.graph import Graph
from lazytrain.ir.stages import Stage


@dataclass(frozen=True)
class Traced:
    """A stage's body traced on fake tensors: what eager autograd saves, and the graphs AOTAutograd
    hands the compiler (NOTE: [Fused transients] in fused_transients.py)."""
    eager_saved: int  # bytes eager autograd saves, less the stage's inputs and parameters
    outputs: int  # the stage's outputs: the first values each forward graph returns
    saving: tuple[torch.fx.Graph, torch.fx.Graph]  # forward and backward saving all forward made (eager's)
    compiled: tuple[torch.fx.Graph, torch.fx.Graph]  # forward and backward of the min-cut partition
    weights: frozenset[int] = frozenset()  # the positions of the stage's weights' gradients in what a backward returns

    @property
    def compiled_saved(self) -> int:
        return _forward_saved(self.compiled[0], self.outputs)


def trace(graph: Graph, stage: Stage, requires_grad: frozenset[str], remat: bool = False) -> Traced | None:
    """`stage`'s body traced on fake tensors, or None where it does not trace. `requires_grad`: the
    values that take a gradient (`Stages`). `remat`: its recompute before backward, which runs the
    stage's `skips` as `grad_only_linear` (NOTE: [Skipped recompute] in analysis/remat.py)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef

    from lazytrain.runtime.remat import grad_only_linear

    names = list(stage.placeholders) + list(stage.inputs)
    skips = set(stage.skips) if remat else set()

    def body(*values):
        env = dict(zip(names, values))
        for n in stage.nodes:
            if n in skips:
                env[n] = grad_only_linear(*decode(graph[n].args, env))
            else:
                evaluate(graph[n], env)
        return tuple(env[o] for o in stage.outputs)

    parts: dict = {}

    def partition(joint, inputs, **kw):  # one joint graph, partitioned as eager keeps and as compiled
        parts["saving"] = default_partition(joint, inputs, **kw)
        parts["compiled"] = min_cut_rematerialization_partition(joint, inputs, **kw)
        return parts["compiled"]

    try:
        with FakeTensorMode():
            values = []
            for n in names:
                spec = graph[n].spec
                t = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
                values.append(t.requires_grad_(n in requires_grad and spec.is_float))
            given = {StorageWeakRef(v.untyped_storage()) for v in values}
            eager: dict = {}

            def pack(t):
                key = StorageWeakRef(t.untyped_storage())
                if key not in given:
                    eager[key] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                body(*values)
            aot_function(body, fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm, partition_fn=partition)(*values)
    except Exception:  # noqa: BLE001  (no fake-tensor rule, no AOT trace: eager's bytes stand)
        return None
    if len(parts) < 2:  # nothing takes a gradient: no partition
        return None
    graphs = {k: (fw.graph, bw.graph) for k, (fw, bw) in parts.items()}
    weights = frozenset(i for i, n in enumerate(names) if n in stage.params)  # a backward returns one gradient an input
    return Traced(sum(eager.values()), len(stage.outputs), graphs["saving"], graphs["compiled"], weights)


def _saved_nodes(graph: torch.fx.Graph, n_outputs: int) -> list:
    """What a partitioned forward returns for backward (its outputs past the first `n_outputs`)."""
    return list(next(n for n in graph.nodes if n.op == "output").args[0][n_outputs:])


def _base(node: torch.fx.Node) -> torch.fx.Node:
    while node.op == "call_function" and getattr(node.target, "is_view", False):
        node = node.args[0]
    return node


def saved_inputs(forward: torch.fx.Graph, n_outputs: int) -> frozenset[int]:
    """The positions of a backward's inputs that are memory of its own: what `forward` saved but for
    the stage's inputs and parameters (and views of them). Not the output gradients, which the plan
    counts as buffers of their own (NOTE: [Backward memory] in backward.py)."""
    return frozenset(i for i, n in enumerate(_saved_nodes(forward, n_outputs))
                     if isinstance(n, torch.fx.Node) and _base(n).op != "placeholder")


def donated_inputs(forward: torch.fx.Graph, n_outputs: int) -> frozenset[int]:
    """Of `saved_inputs`, those nothing else holds: not the stage's outputs nor views of them.
    AOTAutograd hands these to the compiled backward as donated buffers, which it frees at their last
    reader and may write into (NOTE: [Fused transients] in fused_transients.py)."""
    saved = _saved_nodes(forward, n_outputs)
    out = next(n for n in forward.nodes if n.op == "output")
    returned = {_base(n) for n in out.args[0][:n_outputs] if isinstance(n, torch.fx.Node)}
    return frozenset(i for i in saved_inputs(forward, n_outputs) if _base(saved[i]) not in returned)


def _forward_saved(graph: torch.fx.Graph, n_outputs: int) -> int:
    """Bytes a partitioned forward returns for backward (its outputs past the first `n_outputs`),
    less its inputs and views of them."""
    total, seen = 0, set()
    for node in _saved_nodes(graph, n_outputs):
        if not isinstance(node, torch.fx.Node) or not isinstance(value := node.meta.get("val"), torch.Tensor):
            continue
        base = _base(node)
        if base.op == "placeholder" or base in seen:
            continue
        seen.add(base)
        total += value.untyped_storage().nbytes()
    return total
