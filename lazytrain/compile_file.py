"""`lazytrain compile`: a model file -> schedule.py, written atomically."""

from __future__ import annotations

from pathlib import Path

from lazytrain import hardware as hw_profiles
from lazytrain.files import write_atomic
from lazytrain.ir.capture import build_on_meta, check_batch, load_model_file
from lazytrain.passes.chunk import LOSS_CHUNK_BYTES
from lazytrain.pipeline import Compiled, compile_model


def compile_file(model_path, output, budget="max", hardware=None, time_limit=60.0, dump_dir=None,
                 time_passes=False, dtype=None, optimizer_states="32bit", master_weights="fp32",
                 loss_chunk_bytes=LOSS_CHUNK_BYTES, world_size=1, shard_state=None, clipping="exact",
                 disk=False) -> Compiled:
    """Compile `model_path` for `budget` (bytes, "min" or "max") and write the schedule to `output`."""
    build_model, example_batch = load_model_file(model_path)
    batch = check_batch(example_batch())
    model = build_on_meta(build_model)
    if dtype is not None:
        model = model.to(dtype)
    hw = hw_profiles.load(hardware)
    if budget == "max" or budget is None:
        budget = hw.max_budget
    compiled = compile_model(model, batch, budget, hw, source=str(model_path), time_limit=time_limit,
                             dump_dir=dump_dir, time_passes=time_passes, optimizer_states=optimizer_states,
                             master_weights=master_weights, loss_chunk_bytes=loss_chunk_bytes, world_size=world_size,
                             shard_state=shard_state, clipping=clipping, disk=disk)
    if compiled.plan.solver.message:
        print(f"lazytrain: note: {compiled.plan.solver.message}")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(output, compiled.source_text)
    return compiled
