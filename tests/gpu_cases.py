"""The GPU tier's plans (tests/test_gpu.py): the tiny Qwen, its batches, and each case's schedule,
compiled here or, where the solver is missing, read from `.gpu/` (`python tests/test_gpu.py` writes
them on a machine with python-mip)."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PREBUILT = ROOT / ".gpu"
# "resident": every stage resident and saving, stepped on the GPU as its backward ends. The solver's
# own plan at an unlimited budget streams this tiny model and steps it on the host: exactly clipped,
# a device step waits for the host to issue it (0.47 ms a tensor, NOTE: [Steps the host issues after
# backward] in lazytrain/hardware/__init__.py), dearer than the host's for tensors this small.
CASES = {"fp32_max": (None, "resident"), "fp32_min": (None, "min"), "bf16_min": (torch.bfloat16, "min"),
         "fp32_max_8bit": (None, "resident"), "fp32_min_8bit": (None, "min"),
         "fp32_gpu_step": (None, "gpu_step"),  # every stage streamed, optimizer steps on the GPU
         "fp32_min_chunked": (None, "min"), "bf16_min_chunked": (torch.bfloat16, "min"),  # loss stage in chunks
         # bf16 masters with 8-bit states: resident, and streamed with GPU steps (the 7B bench's plans)
         "bf16master_max_8bit": (torch.bfloat16, "resident"), "bf16master_min_8bit": (torch.bfloat16, "min"),
         # offloaded outputs split by the tile between the device, host memory and disk (NOTE: [Boundary tiles])
         "fp32_split": (None, "split")}


def tiny_qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg)


def tiny_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (4, 32), generator=g)
    return {"input_ids": ids, "labels": torch.randint(0, 256, (4, 32), generator=g)}


def ragged_batch(seed=0):
    """Labels ignored (-100) unevenly over the rows: a chunked loss must divide by the global count."""
    batch = tiny_batch(seed)
    for row, start in enumerate((0, 32, 8, 20)):
        batch["labels"][row, start:] = -100
    return batch


def schedule_source(case: str, fused: bool = True) -> str:
    """The case's schedule, planned with fused stage bodies or eager ones: a plan priced fused runs
    only fused on a GPU (NOTE: [Fused plans run fused] in lazytrain/runtime/fused.py)."""
    if importlib.util.find_spec("mip") is None:  # no solver here: use the prebuilt schedule
        # (lazytrain.pipeline imports without it and fails at the solve: NOTE: [Analysis without the solver])
        path = PREBUILT / f"{case}{'' if fused else '.eager'}.py"
        if not path.exists():
            pytest.skip(f"no solver and no prebuilt {path}; run `python tests/test_gpu.py` where python-mip is installed")
        return path.read_text()
    from lazytrain.pipeline import compile_model, minimum_budget

    dtype, budget = CASES[case]
    with torch.device("meta"):
        meta = tiny_qwen()
    if dtype is not None:
        meta = meta.to(dtype)
    if budget == "gpu_step":
        return _gpu_stepped(meta, fused)
    if budget == "split":
        return _split(meta, fused)
    opts = {"fuse_stages": fused, "optimizer_states": "8bit" if case.endswith("8bit") else "32bit",
            "master_weights": "bf16" if case.startswith("bf16master") else "fp32"}
    if budget == "resident":
        return _resident(meta, opts)
    if case.endswith("chunked"):  # the loss stage in one chunk per token (NOTE: [Chunked loss])
        opts["loss_chunk_bytes"] = 1
    if budget == "min":
        budget = minimum_budget(meta, tiny_batch(), "h200", **opts)
    return compile_model(meta, tiny_batch(), budget, "h200", **opts).source_text


def _rendered(graph, stages, decs, hw, **precision) -> str:
    """The schedule of fixed decisions at an unlimited budget (`precision`: render's optimizer_states,
    master_weights and fused_factor)."""
    from lazytrain.codegen.render import render
    from lazytrain.passes.lower import lower
    from lazytrain.solver.solve import evaluate

    plan = evaluate(stages, hw, 1 << 40, decs)
    return render(graph, stages, plan, lower(stages, plan, hw), tiny_batch(), hw.name, **precision)


def _gpu_stepped(meta, fused: bool) -> str:
    from lazytrain import hardware
    from lazytrain.pipeline import analyse
    from plans import decisions

    hw = hardware.load("h200")
    graph, stages = analyse(meta, tiny_batch(), hw, fuse_stages=fused)
    last = len(stages) - 1
    decs = decisions([("G" if g.param_bytes > 0 else "-") + ("R" if s != last else "r") + "k" for s, g in enumerate(stages)])
    return _rendered(graph, stages, decs, hw)


def _resident(meta, opts: dict) -> str:
    """The plan keeping every stage resident and saved, stepped on the GPU (`heuristics`)."""
    from lazytrain import hardware
    from lazytrain.pipeline import analyse
    from lazytrain.solver.solve import heuristics

    hw = hardware.load("h200")
    graph, stages = analyse(meta, tiny_batch(), hw, **opts)
    return _rendered(graph, stages, heuristics(stages)["everything resident and saved"], hw,
                     optimizer_states=opts["optimizer_states"], master_weights=opts["master_weights"],
                     fused_factor=hw.fused_elementwise_factor)


# tiny Qwen's stages: the prologue, 4 layers, the loss. The prologue's and first layers' outputs
# (last read by stage S-3 or before) may go to disk; each is cut in 4 tiles.
SPLITS = {0: ("o", (1, 0)), 1: ("f", (1, 2)), 2: ("f", (0, 1)), 3: ("o", (3, 0))}


def _split(meta, fused: bool) -> str:
    """A forced plan whose offloaded outputs are split by the tile (NOTE: [Boundary tiles] in
    lazytrain/solver/boundary.py): kept and host; kept, host and disk; host and disk; kept and host."""
    import dataclasses

    from lazytrain import hardware
    from lazytrain.ir.placement import Split
    from lazytrain.pipeline import analyse
    from lazytrain.solver import boundary
    from plans import decisions

    hw = hardware.load("h200")
    graph, stages = analyse(meta, tiny_batch(), hw, fuse_stages=fused)
    stages = dataclasses.replace(stages, disk=True)
    old, boundary.TILE_BYTES = boundary.TILE_BYTES, -(-stages[1].out_bytes // 4)
    try:
        last = len(stages) - 1
        spec = ["-R" + SPLITS.get(s, ("k",))[0] if s != last else "-rk" for s in range(len(stages))]
        decs = [dataclasses.replace(d, split=Split(*SPLITS[s][1], boundary.tiles(stages[s]))) if s in SPLITS else d
                for s, d in enumerate(decisions(spec))]
        return _rendered(graph, stages, decs, hw)
    finally:
        boundary.TILE_BYTES = old


def bind(case: str, model, **kw):
    from lazytrain.runtime.schedule import load_source

    fused = kw.get("fuse_stages") is not False
    return load_source(schedule_source(case, fused), f"lt_gpu_{case}_{fused}").bind(model, device="cuda", **kw)
