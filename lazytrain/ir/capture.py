"""Capture: a PyTorch model and an example batch -> lazytrain's IR, via torch.export.

The model is built on the meta device (no weights are ever materialised, so a 70B config captures on
a laptop) and exported with `torch.export` (plain `torch.fx.symbolic_trace` fails on transformers
5.x) as fake tensors on the device the schedule runs on (NOTE: [Capture on the target device] in
ir/target.py). Parameters and buffers become placeholders named by their module path; blocks are taken from
the `nn_module_stack` the export records: the shallowest numbered container (`model.layers.N`).
Operators come out in trace order, except loop iterations whose order depends on the hash seed
(NOTE: [Hash-seed independent capture] in ir/canonical.py).
"""

from __future__ import annotations

import contextlib
import operator
import re
import sys
import traceback
import warnings
from pathlib import Path

import torch

from lazytrain.errors import LazytrainError, TraceError
from lazytrain.ir.canonical import canonical_order
from lazytrain.ir.graph import Graph, Node, OpKind, Sym, TensorSpec, Value
from lazytrain.ir.target import on_target

_WRAPPED = "_lt_model"  # attribute name of the user's model inside the loss wrapper


class LossModule(torch.nn.Module):
    """Calls the user's model and returns its scalar loss (a tensor, or an object with `.loss`)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        setattr(self, _WRAPPED, model)

    def forward(self, **batch):
        out = getattr(self, _WRAPPED)(**batch)
        return out.loss if hasattr(out, "loss") else out


def check_batch(batch) -> dict[str, torch.Tensor]:
    if not isinstance(batch, dict) or not batch or not all(isinstance(v, torch.Tensor) for v in batch.values()):
        raise TraceError("example_batch() must return a non-empty dict of tensors, e.g. {'input_ids': ..., 'labels': ...}")
    return batch


def capture(model: torch.nn.Module, batch: dict[str, torch.Tensor], source: str = "", device: str = "cpu") -> Graph:
    """Export `model(**batch)` (its loss), as it runs on `device` ("cpu" or "cuda"), into a `Graph`."""
    check_batch(batch)
    model.train()
    # Separate fake tensors per input: export merges aliased inputs into one placeholder.
    with on_target(model, batch, device) as fake_batch, _without_cache(model):
        try:
            exported = torch.export.export(LossModule(model), (), fake_batch, strict=False)
            gm = exported.graph_module
            _check_no_grad_regions(exported)
            if any(_is_mutating(n) or _is_grad_region(n) for n in gm.graph.nodes):
                with warnings.catch_warnings():  # torch's own deprecation, raised by its copy of the call graph
                    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
                    # functionalise in-place ops; inline grad-mode regions (NOTE: [Grad-mode regions])
                    exported = exported.run_decompositions({})
                gm = exported.graph_module
            _erase_identity_dropouts(gm.graph)
        except LazytrainError:
            raise
        except Exception as exc:
            raise TraceError(_explain_export_failure(exc, source)) from None
    return _convert(exported, gm, source, device)


# NOTE: [No KV cache in a training step]
# A Hugging Face model built with its config's default `use_cache=True` makes a key/value cache in
# forward; export lifts the cache's tensors as constants of the attention modules
# (`model.layers.0.self_attn.lifted_tensor_0`), which no model holds, so binding the schedule would
# fail. A training step never reads the cache, so capture turns it off in every transformers model
# inside `model` while it traces (as a model directory's config does for good, train/source.py),
# and puts the configs back after.
@contextlib.contextmanager
def _without_cache(model: torch.nn.Module):
    transformers = sys.modules.get("transformers")  # a model cannot be one unless it is loaded
    configs = [m.config for m in model.modules() if transformers is not None
               and isinstance(m, transformers.PreTrainedModel) and getattr(m.config, "use_cache", False)]
    for config in configs:
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs:
            config.use_cache = True


_NOT_MODEL_CODE = (Path(torch.__file__).parent, Path(__file__).parent.parent)


def _explain_export_failure(exc: Exception, source: str) -> str:
    text = str(exc)
    if "data-dependent" in text or "GuardOnDataDependent" in type(exc).__name__ or "meta tensors" in text:
        construct = "data-dependent control flow (an `if`, `bool()`, `.item()` or shape computed from a tensor's values)"
    else:
        construct = f"{type(exc).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    # The user's file if it is on the stack, else the innermost frame of model code (a library's
    # modeling file): never torch's or lazytrain's own.
    user_frames = [f for f in frames if source and Path(f.filename).name == Path(source).name] or [
        f for f in frames if not any(Path(root) in Path(f.filename).parents for root in _NOT_MODEL_CODE)]
    if user_frames:
        f = user_frames[-1]
        where = f" at {Path(f.filename).name}:{f.lineno} `{(f.line or '').strip()}`"
    return (
        f"cannot trace the model{where}: {construct}. lazytrain compiles a static training step with "
        "torch.export; replace the construct with tensor operations (e.g. torch.where) or move it out of forward()"
    )


# NOTE: [Identity dropout]
# Hugging Face configs default most dropouts to 0.0, and export records them anyway as
# `dropout(x, 0.0, True)`. Such a node returns its input and draws no random numbers, but a stage
# holding a random operator must replay its generator's state to recompute (NOTE: [RNG replay] in
# runtime/rng.py), and a dropout's backward keeps a mask. So capture erases every dropout that is the
# identity (p == 0, or train False) and its readers read its input. `native_dropout` (what
# decompositions leave) returns (output, mask): it goes only when nothing reads the mask.
_DROPOUTS = tuple(f"aten.{op}.default" for op in ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"))
_NATIVE_DROPOUT = "aten.native_dropout.default"


def _erase_identity_dropouts(graph: torch.fx.Graph) -> None:
    """Remove the dropouts that return their input (NOTE: [Identity dropout]); edits `graph` in place."""
    for node in list(graph.nodes):
        target = str(node.target) if node.op == "call_function" else ""
        if target not in _DROPOUTS and target != _NATIVE_DROPOUT:
            continue
        schema = node.target._schema.arguments
        given = {a.name: a.default_value for a in schema if a.has_default_value()}
        given.update(zip((a.name for a in schema), node.args))
        given.update(node.kwargs)
        if given["p"] != 0 and given["train"] is not False:
            continue
        source = given["input"]
        if target == _NATIVE_DROPOUT:
            if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users if u.users):
                continue  # the mask is read
            for item in list(node.users):
                item.replace_all_uses_with(source)
                graph.erase_node(item)
        else:
            node.replace_all_uses_with(source)
        graph.erase_node(node)


def _is_check(node: torch.fx.Node) -> bool:
    """Export's metadata assertions: no value, no users; capture leaves them out."""
    return str(node.target).startswith("aten._assert") and not node.users


def _is_mutating(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


# NOTE: [Grad-mode regions]
# Code under `torch.no_grad()` or `torch.autocast` inside forward exports as a higher-order operator
# around a submodule (`wrap_with_set_grad_enabled`, `wrap_with_autocast`): transformers 5.17's
# rotary embedding (`@torch.no_grad()` on its forward) did, and capture refused every Qwen2 and
# Llama with "cannot schedule wrap_with_set_grad_enabled". `run_decompositions` traces the region's
# ATen operators inline, as they ran under the region's mode; what they compute is the same. Inlined,
# a no-grad region would pass gradients that eager stops, so capture takes one only where no
# parameter reaches it (the rotary embedding reads a buffer and the positions) and refuses the rest.
_GRAD_REGIONS = ("wrap_with_set_grad_enabled", "wrap_with_autocast")


def _is_grad_region(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") in _GRAD_REGIONS


def _check_no_grad_regions(exported) -> None:
    """Refuse a `torch.no_grad()` region in forward that a parameter reaches (NOTE: [Grad-mode regions])."""
    params = set(exported.graph_signature.inputs_to_parameters)
    reached: set[torch.fx.Node] = set()
    for node in exported.graph_module.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "placeholder" and node.name in params or any(n in reached for n in inputs):
            reached.add(node)
        if getattr(node.target, "__name__", "") == "wrap_with_set_grad_enabled" and node.args[0] is False \
                and any(n in reached for n in inputs):
            where = ([""] + _module_paths(node))[-1]
            raise TraceError(f"forward computes under torch.no_grad() from a value that depends on a parameter"
                             f"{f' (module {where})' if where else ''}; lazytrain cannot keep eager's gradients "
                             "through it. Detach that value with .detach() instead of a no_grad block")


def _strip(path: str) -> str:
    """Module path relative to the user's model: "L__self__._lt_model.model.layers.0" -> "model.layers.0"."""
    if _WRAPPED in path:
        path = path.split(_WRAPPED, 1)[1].lstrip(".")
    return path


def _module_paths(node: torch.fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [_strip(v[0]) for v in stack.values()]


def _find_block_container(gm) -> str | None:
    """The shallowest module container with numbered children (`model.layers`), or None."""
    indices: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        for path in _module_paths(node):
            parts = path.split(".") if path else []
            for i, part in enumerate(parts):
                if part.isdigit():
                    indices.setdefault(".".join(parts[:i]), set()).add(part)
    if not indices:
        return None
    return min(indices, key=lambda p: (p.count(".") + (p != ""), -len(indices[p])))


def _block_of(paths: list[str], container: str | None) -> str | None:
    if container is None:
        return None
    pattern = re.compile(rf"^{re.escape(container + '.') if container else ''}(\d+)(\.|$)")
    for path in paths:
        match = pattern.match(path)
        if match:
            return (container + "." if container else "") + match.group(1)
    return None


def _spec(val) -> Value:
    if isinstance(val, torch.Tensor):
        return TensorSpec(tuple(int(d) for d in val.shape), str(val.dtype).removeprefix("torch."))
    if isinstance(val, (tuple, list)):
        return tuple(_spec(v) if isinstance(v, torch.Tensor) else None for v in val)
    return None


def _encode(arg, where: str, names: dict[str, str]):
    if isinstance(arg, torch.fx.Node):
        return Sym("ref", names.get(arg.name, arg.name))
    if isinstance(arg, (list, tuple)):
        return tuple(_encode(a, where, names) for a in arg)
    if isinstance(arg, torch.dtype):
        return Sym("dtype", str(arg).removeprefix("torch."))
    if isinstance(arg, torch.device):
        return Sym("device", str(arg))
    if isinstance(arg, torch.layout):
        return Sym("layout", str(arg).removeprefix("torch."))
    if isinstance(arg, torch.memory_format):
        return Sym("memory_format", str(arg).removeprefix("torch."))
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return arg
    raise TraceError(f"node {where} has an argument of type {type(arg).__name__} ({arg!r}) that lazytrain cannot encode")


def _convert(exported, gm, source: str, device: str) -> Graph:
    mutated = [spec.target for spec in exported.graph_signature.output_specs if spec.kind.name != "USER_OUTPUT"]
    if mutated:
        raise TraceError(
            f"forward() updates {', '.join(_strip(t) for t in mutated[:3] if t)} in place (e.g. BatchNorm running "
            "statistics); lazytrain compiles a step without side effects: use LayerNorm/RMSNorm or freeze the "
            "statistics (eval mode) for those modules")
    kinds = {}
    for spec in exported.graph_signature.input_specs:
        kind = {"PARAMETER": OpKind.PARAM, "BUFFER": OpKind.BUFFER, "CONSTANT_TENSOR": OpKind.BUFFER,
                "USER_INPUT": OpKind.INPUT}.get(spec.kind.name)
        if kind is None:
            raise TraceError(f"unsupported graph input {spec.arg.name} of kind {spec.kind.name}")
        kinds[spec.arg.name] = (kind, _strip(spec.target) if spec.target else spec.arg.name)
    # Placeholders are renamed after what they hold ("p_model_layers_0_mlp_up_proj_weight").
    names = {
        name: name if kind is OpKind.INPUT else ("p_" if kind is OpKind.PARAM else "b_") + re.sub(r"\W", "_", target)
        for name, (kind, target) in kinds.items()
    }
    taken = {n.name for n in gm.graph.nodes if n.op != "placeholder"}
    if clash := taken & set(names.values()):
        raise TraceError(f"placeholder names {sorted(clash)} clash with operator nodes; rename the parameters")
    # NOTE: [Hash-seed independent capture] in ir/canonical.py
    weights = {spec.arg.name: i for i, spec in enumerate(exported.graph_signature.input_specs)
               if kinds[spec.arg.name][0] is not OpKind.INPUT}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ops, renames = canonical_order([n for n in gm.graph.nodes if n.op == "call_function" and not _is_check(n)],
                                   {name: target for name, (_, target) in kinds.items()}, weights)
    names.update(renames)

    container = _find_block_container(gm)
    nodes: list[Node] = []
    output = None
    for n in placeholders + ops + [n for n in gm.graph.nodes if n.op not in ("placeholder", "call_function")]:
        paths = _module_paths(n)
        module = paths[-1] if paths else ""
        if n.op == "placeholder":
            kind, target = kinds[n.name]
            if kind is not OpKind.INPUT and not n.users:
                continue  # a second name of a tied weight: the graph reads it under the other one
            nodes.append(Node(names[n.name], kind, target, value=_spec(n.meta.get("val"))))
        elif n.op == "call_function":
            if n.target is operator.getitem:
                op, target = OpKind.GETITEM, "getitem"
            elif isinstance(n.target, torch._ops.OpOverload):
                op, target = OpKind.CALL, str(n.target)
            else:
                raise TraceError(
                    f"node {n.name} calls {getattr(n.target, '__name__', n.target)}, which lazytrain cannot "
                    f"schedule (module {module or '<top>'}); only ATen operators are supported"
                )
            nodes.append(Node(
                names.get(n.name, n.name), op, target, _encode(tuple(n.args), n.name, names),
                tuple((k, _encode(v, n.name, names)) for k, v in n.kwargs.items()),
                _spec(n.meta.get("val")), module, _block_of(paths, container),
            ))
        elif n.op == "output":
            outs = n.args[0]
            if len(outs) != 1 or not isinstance(outs[0], torch.fx.Node):
                raise TraceError(f"the model returned {len(outs)} values; it must return one scalar loss (or an object with .loss)")
            output = names.get(outs[0].name, outs[0].name)
    graph = Graph(nodes=tuple(nodes), output=output, source=source, device=device)
    loss = graph[output].value
    if not isinstance(loss, TensorSpec) or loss.shape != () or not loss.is_float:
        raise TraceError(f"the model's output {output} is {loss}; it must be a scalar floating-point loss")
    return graph
