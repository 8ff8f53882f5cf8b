"""Invalid inputs: each gets a clear lazytrain error that names the cause (pinned text).

Budgets below the smallest feasible one, untraceable or non-scalar models, schedules bound to the
wrong model or batch, edited schedule files, and hand-broken event lists the verifier must reject.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import re
import sys

import pytest
import torch
from torch import nn

from lazytrain.errors import InfeasibleBudget, ScheduleMismatch, TraceError, VerifyError
from lazytrain.ir.events import Kind, Phase
from lazytrain.passes.verify import verify
from lazytrain.pipeline import compile_model, minimum_budget
from lazytrain.runtime.schedule import FORMAT_VERSION, checksum, load_schedule, load_source
from lazytrain.units import format_size
from models import BlockSpec, ModelSpec, random_block_model, tiny_gpt_pair, tiny_qwen_pair, unique_name

GiB = 1 << 30


@pytest.fixture(scope="module")
def small():
    """A two-block model compiled at 1 GiB: (meta, real, batch, Compiled)."""
    meta, real, batch = random_block_model(ModelSpec((BlockSpec("linear", 16), BlockSpec("linear", 16))))
    return meta, real, batch, compile_model(meta, batch, GiB, "cpu", source="tests/small.py")


@pytest.fixture(scope="module")
def gpt():
    meta, real, batch = tiny_gpt_pair()
    return meta, real, batch, minimum_budget(meta, batch, "cpu")


# ---- budgets --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.99])
def test_budget_below_minimum(gpt, fraction):
    meta, _, batch, smallest = gpt
    budget = int(smallest * fraction)
    with pytest.raises(InfeasibleBudget) as info:
        compile_model(meta, batch, budget, "cpu")
    assert info.value.smallest_feasible == smallest
    assert str(info.value) == (
        f"no plan fits a GPU budget of {format_size(budget)}; smallest feasible budget: "
        f"{format_size(smallest, round_up=True)}. Raise --budget, or shrink the batch")
    assert re.search(r"smallest feasible budget: \d+\.\d (KiB|MiB)\.", str(info.value))


def test_budget_message_tiny_gpt(gpt):
    """The exact text for the tiny GPT (323.5 KiB is the smallest budget, printed rounded up)."""
    meta, _, batch, smallest = gpt
    assert smallest == 331268
    with pytest.raises(InfeasibleBudget, match=re.escape(
            "no plan fits a GPU budget of 200.0 KiB; smallest feasible budget: 323.6 KiB. "
            "Raise --budget, or shrink the batch")):
        compile_model(meta, batch, 200 * 1024, "cpu")


def test_a_plan_past_the_device_says_what_gpu_it_needs_and_where_the_bytes_go(gpt):
    """NOTE: [Past the device] in solver/refusal.py: where the smallest budget is more than the
    device has, raising --budget cannot help; the refusal names the GPU it needs and the largest
    stage's backward, whose parts add up to what it says."""
    import dataclasses

    from lazytrain import hardware
    from lazytrain.pipeline import analyse
    from lazytrain.solver.refusal import backward_floor

    meta, _, batch, smallest = gpt
    small = dataclasses.replace(hardware.load("cpu"), gpu_memory_bytes=smallest // 2)
    with pytest.raises(InfeasibleBudget) as info:
        compile_model(meta, batch, "max", small)
    text = str(info.value)
    assert f"it needs a GPU of at least {format_size(smallest, round_up=True)}" in text, text
    assert "Raise --budget" not in text and "Shrink the tokens per row or the batch" in text
    _, stages = analyse(meta, batch, small)
    floors = [backward_floor(stages, s) for s in range(len(stages.stages))]
    floor, parts = max(floors, key=lambda f: f[0])
    assert floor == sum(parts.values()) and 0 < floor <= smallest
    assert f"backward alone holds {format_size(floor)} under any plan" in text, text


def test_a_state_past_the_host_is_named_and_refused_without_tiles():
    """NOTE: [State past the host] in solver/refusal.py: where the masters and optimizer states alone
    are more than the host holds, the refusal says so, names the options that shrink them, and
    does not search tiles (which shrink activations, not state)."""
    from lazytrain import hardware
    from lazytrain.pipeline import analyse

    meta, _, batch = tiny_qwen_pair()
    cpu = hardware.load("cpu")
    _, stages = analyse(meta, batch, cpu)
    state = (sum(g.param_numel for g in stages.stages) + stages.shared_numel) * 12  # fp32 masters, 32-bit AdamW states
    small = dataclasses.replace(cpu, host_memory_bytes=state // 2, gpu_memory_bytes=state // 4)
    with pytest.raises(InfeasibleBudget) as info:
        compile_model(meta, batch, "max", small)  # clipping exact, the default
    text = str(info.value)
    assert info.value.any_tiles and "in tiles" not in text, text
    assert f"(12 bytes each: {format_size(state)}), is more than the host may hold" in text, text
    assert "Shrink it with --optimizer-states 8bit, --master-weights bf16 (8-bit states and bf16 masters take it to " in text
    assert ", --disk, --clipping previous-norm (" in text, text
    assert "Shrink the tokens per row" not in text
    # with the state small enough for the host, the same device refuses for the activations, in tiles
    roomy = dataclasses.replace(small, host_memory_bytes=100 * state)
    with pytest.raises(InfeasibleBudget) as info:
        compile_model(meta, batch, "max", roomy, clipping="off")
    assert not info.value.any_tiles and "training state" not in str(info.value)


def test_budget_message_distinguishes_budget_from_minimum():
    meta, _, batch = random_block_model(ModelSpec((BlockSpec("mlp", 24), BlockSpec("linear", 16)), table="const"))
    smallest = minimum_budget(meta, batch, "cpu")
    with pytest.raises(InfeasibleBudget) as info:
        compile_model(meta, batch, smallest - 1, "cpu")
    printed = re.match(r"no plan fits a GPU budget of (.+?); smallest feasible budget: (.+?)\. ", str(info.value))
    assert printed.group(1) != printed.group(2), str(info.value)


# ---- untraceable models ---------------------------------------------------------------------------

class DataDependent(nn.Module):
    """Branches on a tensor's value: torch.export cannot capture one static step."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.fc(x)
        if h.sum() > 0:
            h = h * 2
        return ((h - y) ** 2).mean()


class NonScalar(nn.Module):
    """Returns the per-element loss instead of its mean."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        return (self.fc(x) - y) ** 2


class TwoOutputs(NonScalar):
    def forward(self, x, y):
        h = self.fc(x)
        return ((h - y) ** 2).mean(), h


class IntegerLoss(NonScalar):
    def forward(self, x, y):
        return (self.fc(x) > y).sum()


class RunningStats(nn.Module):
    """BatchNorm in training mode updates its running statistics (buffers) during forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x, y):
        return ((self.bn(self.fc(x)) - y) ** 2).mean()


BATCH = {"x": torch.zeros(2, 4), "y": torch.zeros(2, 4)}


def meta_model(cls):
    with torch.device("meta"):
        return cls()


def test_data_dependent_control_flow():
    with pytest.raises(TraceError) as info:
        compile_model(meta_model(DataDependent), BATCH, GiB, "cpu", source=__file__)
    text = str(info.value)
    assert "data-dependent" in text
    assert re.search(r"at test_invalid\.py:\d+ `if h\.sum\(\) > 0:`", text), text
    assert text.startswith("cannot trace the model at test_invalid.py:")
    assert "torch.where" in text  # says how to fix it


@pytest.mark.parametrize("cls, message", [
    (NonScalar, "the model's output pow_1 is float32[2,4]; it must be a scalar floating-point loss"),
    (IntegerLoss, "it must be a scalar floating-point loss"),
    (TwoOutputs, "the model returned 2 values; it must return one scalar loss (or an object with .loss)"),
])
def test_model_must_return_a_scalar_loss(cls, message):
    with pytest.raises(TraceError, match=re.escape(message)):
        compile_model(meta_model(cls), BATCH, GiB, "cpu")


def test_buffer_mutation_is_named():
    with pytest.raises(TraceError) as info:
        compile_model(meta_model(RunningStats), BATCH, GiB, "cpu")
    assert "running_mean" in str(info.value), str(info.value)


def test_batch_must_be_a_dict_of_tensors():
    with pytest.raises(TraceError, match=re.escape("example_batch() must return a non-empty dict of tensors")):
        compile_model(meta_model(NonScalar), {"x": [1, 2]}, GiB, "cpu")


# ---- binding and running a schedule ---------------------------------------------------------------

def test_bind_other_width_names_parameter(small):
    _, _, _, c = small
    _, other, _ = random_block_model(ModelSpec((BlockSpec("linear", 12), BlockSpec("linear", 16))))
    module = load_source(c.source_text, unique_name())
    with pytest.raises(ScheduleMismatch) as info:
        module.bind(other)
    text = str(info.value)
    assert text.startswith(f"schedule tests/small.py (fingerprint {module.FINGERPRINT}) does not fit this model: ")
    assert "blocks.0.fc.weight is float32[12, 16], compiled for float32[16, 16]" in text
    assert "blocks.0.fc.bias is float32[12], compiled for float32[16]" in text
    assert text.endswith("Recompile the schedule for this model with `lazytrain compile`")


def test_bind_other_width_does_not_call_known_parameters_unknown(small):
    _, _, _, c = small
    _, other, _ = random_block_model(ModelSpec((BlockSpec("linear", 12), BlockSpec("linear", 16))))
    with pytest.raises(ScheduleMismatch) as info:
        load_source(c.source_text, unique_name()).bind(other)
    assert "does not know" not in str(info.value), str(info.value)


def test_bind_model_with_extra_parameter(small):
    _, real, _, c = small
    model = copy.deepcopy(real)
    model.extra = nn.Linear(2, 2)
    with pytest.raises(ScheduleMismatch, match=re.escape(
            "it has parameters the schedule does not know: extra.weight, extra.bias")):
        load_source(c.source_text, unique_name()).bind(model)


def test_bind_model_missing_parameter(small):
    _, real, _, c = small
    model = copy.deepcopy(real)
    del model.head
    with pytest.raises(ScheduleMismatch, match=re.escape("it has no param head.weight; it has no param head.bias")):
        load_source(c.source_text, unique_name()).bind(model)


def test_bind_meta_model(small):
    meta, _, _, c = small
    with pytest.raises(ScheduleMismatch, match="is on the meta device; load or initialise the weights first"):
        load_source(c.source_text, unique_name()).bind(meta)


@pytest.mark.parametrize("change, message", [
    (lambda b: {**b, "x": torch.zeros(3, 8)},
     "batch input x is float32[3, 8] but the schedule was compiled for float32[4, 8]; "
     "recompile with example_batch() returning that shape"),
    (lambda b: {**b, "y": torch.zeros(4, 8, dtype=torch.float64)},
     "batch input y is float64[4, 8] but the schedule was compiled for float32[4, 8]"),
    (lambda b: {"x": b["x"]}, "batch has inputs ['x'], the schedule was compiled for ['x', 'y']"),
    (lambda b: {**b, "z": b["x"]}, "batch has inputs ['x', 'y', 'z'], the schedule was compiled for ['x', 'y']"),
])
def test_run_other_batch(small, change, message):
    _, real, batch, c = small
    trainer = load_source(c.source_text, unique_name()).bind(copy.deepcopy(real))
    with pytest.raises(ScheduleMismatch, match=re.escape(message)):
        trainer.forward_backward(change(batch))
    with pytest.raises(ScheduleMismatch, match=re.escape(message)):
        trainer.step(change(batch))


def test_run_other_sequence_length_tiny_gpt(gpt):
    meta, real, batch, _ = gpt
    c = compile_model(meta, batch, GiB, "cpu")
    trainer = load_source(c.source_text, unique_name()).bind(copy.deepcopy(real))
    short = {k: v[:, :8] for k, v in batch.items()}
    with pytest.raises(ScheduleMismatch, match=re.escape(
            "batch input input_ids is int64[2, 8] but the schedule was compiled for int64[2, 16]")):
        trainer.forward_backward(short)


# ---- edited and stale schedule files --------------------------------------------------------------

def event_lines(text: str) -> list[int]:
    return [i for i, line in enumerate(text.splitlines()) if line.lstrip().startswith("Event(")]


@pytest.mark.parametrize("edit", [
    lambda line: line.replace("Kind.COMPUTE, 0, FWD", "Kind.COMPUTE, 0, BWD"),  # a phase
    lambda line: line.replace("reads=(", "reads=( "),  # one space, same meaning
    lambda line: line.replace("t=", "T="),  # inside the trailing comment
])
def test_edited_event_line_fails_checksum(small, edit):
    _, _, _, c = small
    lines = c.source_text.splitlines(keepends=True)
    i = event_lines(c.source_text)[0]
    edited = edit(lines[i])
    assert edited != lines[i]
    lines[i] = edited
    with pytest.raises(ScheduleMismatch, match=r"was edited or is corrupt \(checksum mismatch\); recompile it"):
        load_source("".join(lines), unique_name())


def test_every_single_character_edit_of_events_is_caught(small):
    """Changing any one character of any event line is caught (digit +1 keeps it valid Python)."""
    _, _, _, c = small
    text = c.source_text
    for i in event_lines(text)[:10]:
        line = text.splitlines(keepends=True)[i]
        j = next(k for k, ch in enumerate(line) if ch.isdigit())
        lines = text.splitlines(keepends=True)
        lines[i] = line[:j] + str((int(line[j]) + 1) % 10) + line[j + 1:]
        with pytest.raises(ScheduleMismatch, match="checksum"):
            load_source("".join(lines), unique_name())


def test_edit_below_checksum_line_is_caught(small):
    _, _, _, c = small
    text = c.source_text.replace("return bind_module(sys.modules[__name__], model, **optimizer_args)",
                                 "return bind_module(sys.modules[__name__], model, **{**optimizer_args, 'lr': 1.0})")
    assert text != c.source_text
    with pytest.raises(ScheduleMismatch, match="checksum"):
        load_source(text, unique_name())


def test_truncated_schedule_file(small, tmp_path):
    _, _, _, c = small
    path = tmp_path / "schedule.py"
    path.write_text(c.source_text[: len(c.source_text) // 2])
    with pytest.raises(ScheduleMismatch, match=rf"schedule {re.escape(str(path))} is corrupt \(SyntaxError"):
        load_schedule(path)
    path.write_text(c.source_text.split("CHECKSUM = ")[0])
    with pytest.raises(ScheduleMismatch, match="checksum mismatch"):
        load_schedule(path)


def test_stale_format_and_missing_file(small, tmp_path):
    _, _, _, c = small
    path = tmp_path / "schedule.py"
    path.write_text(c.source_text.replace(f"FORMAT = {FORMAT_VERSION}\n", "FORMAT = 0\n"))
    with pytest.raises(ScheduleMismatch, match=f"has format 0, this lazytrain reads {FORMAT_VERSION}: it is stale; recompile it"):
        load_schedule(path)
    with pytest.raises(ScheduleMismatch, match=re.escape("does not exist; create it with `lazytrain compile model.py -o")):
        load_schedule(tmp_path / "missing.py")



# ---- schedules imported as plain modules ----------------------------------------------------------

TINY_GPT = "lazytrain/examples/tiny_gpt.py"
CHECK_LINE = "check_integrity(globals())  # this whole text against CHECKSUM: an edited schedule is refused on import\n"


@pytest.fixture(scope="module")
def gpt_text(gpt):
    meta, _, batch, _ = gpt
    return compile_model(meta, batch, GiB, "cpu", source=TINY_GPT).source_text


def import_file(path, name=None):
    """`import schedule` of a file, as a user's script does it (here under a fresh module name)."""
    name = name or unique_name()
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def test_edited_schedule_file_is_refused_on_import(gpt, gpt_text, tmp_path):
    """An edited norm eps changes the loss a little (6.2744 against eager's 6.2774 on a larger
    model) and nothing else: importing the edited file must refuse it, naming the file and the fix."""
    _, real, batch, _ = gpt
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    pristine = tmp_path / "a" / "schedule.py"
    pristine.write_text(gpt_text)
    trainer = import_file(pristine).bind(copy.deepcopy(real))
    assert torch.isfinite(trainer.step(batch))
    assert gpt_text.count("1e-05, False)") > 1  # the layer norms' eps
    edited = tmp_path / "b" / "schedule.py"
    edited.write_text(gpt_text.replace("1e-05, False)", "1e-04, False)", 1))
    with pytest.raises(ScheduleMismatch, match=re.escape(
            f"schedule {edited} was edited or is corrupt (checksum mismatch); recompile it with "
            f"`lazytrain compile {TINY_GPT} -o {edited}` and change the model or the budget, not the schedule")):
        import_file(edited)


def test_schedule_without_its_import_check_is_refused_at_bind(gpt, gpt_text, tmp_path):
    """Deleting the import-time check is an edit too: `bind` checks a module no check has passed."""
    _, real, _, _ = gpt
    assert gpt_text.count(CHECK_LINE) == 1
    path = tmp_path / "schedule.py"
    path.write_text(gpt_text.replace(CHECK_LINE, "", 1))
    module = import_file(path)
    with pytest.raises(ScheduleMismatch, match=re.escape(f"schedule {path} was edited or is corrupt (checksum mismatch)")):
        module.bind(copy.deepcopy(real))


def test_schedule_without_import_check_but_intact_still_binds(gpt, gpt_text, tmp_path):
    """A schedule written before the import-time check (same format, its checksum intact) is
    checked at bind and binds."""
    _, real, batch, _ = gpt
    text = gpt_text.replace(CHECK_LINE, "", 1)
    text = re.sub(r'^CHECKSUM = ".*"$', f'CHECKSUM = "{checksum(text)}"', text, flags=re.MULTILINE)
    path = tmp_path / "schedule.py"
    path.write_text(text)
    trainer = import_file(path).bind(copy.deepcopy(real))
    assert torch.isfinite(trainer.step(batch))
    assert torch.isfinite(load_source(text, unique_name()).bind(copy.deepcopy(real)).step(batch))


def test_schedule_from_text_is_checked(gpt, gpt_text):
    """`load_source` (no file): the intact text binds, an edited one is refused as it runs, and the
    failed module is not left in sys.modules."""
    _, real, _, _ = gpt
    load_source(gpt_text, unique_name()).bind(copy.deepcopy(real))
    name = unique_name()
    with pytest.raises(ScheduleMismatch, match=re.escape(
            f"schedule <lazytrain schedule {name}> was edited or is corrupt (checksum mismatch); recompile it with "
            f"`lazytrain compile {TINY_GPT}` and")):
        load_source(gpt_text.replace("1e-05, False)", "1e-04, False)", 1), name)
    assert name not in sys.modules


def test_schedule_whose_text_cannot_be_read_is_refused(gpt_text):
    """Executed from a string with no file or loader behind it, a schedule cannot check itself."""
    with pytest.raises(ScheduleMismatch, match="its source text cannot be read, so its checksum cannot be checked"):
        exec(compile(gpt_text, "<string>", "exec"), {"__name__": unique_name()})

# ---- hand-broken schedules the verifier rejects ---------------------------------------------------

def rebuild(schedule, order: list[int]):
    """A schedule with events `order` (old ids, some removed or moved): ids renumbered to positions,
    waits remapped, waits on removed events dropped."""
    new_id = {old: new for new, old in enumerate(order)}
    events = tuple(
        dataclasses.replace(schedule.events[old], id=new_id[old],
                            waits=tuple(sorted(new_id[w] for w in schedule.events[old].waits if w in new_id)))
        for old in order)
    return dataclasses.replace(schedule, events=events)


@pytest.fixture(scope="module")
def streamed(small):
    """The small model with its middle stages streamed: prefetches, frees and cross-stream waits."""
    _, _, _, c = small
    assert any(e.kind is Kind.PREFETCH for e in c.schedule.events)
    return c.schedule


def test_unbroken_schedule_verifies(streamed):
    assert len(verify(streamed)) == len(streamed.events)
    assert verify(rebuild(streamed, list(range(len(streamed.events))))) == verify(streamed)


def test_missing_prefetch(streamed):
    prefetch = next(e for e in streamed.events if e.kind is Kind.PREFETCH)
    broken = rebuild(streamed, [e.id for e in streamed.events if e.id != prefetch.id])
    user = next(e for e in broken.events if f"w:{prefetch.stage}" in e.reads)
    with pytest.raises(VerifyError, match=re.escape(
            f"event {user.id} (compute stage {prefetch.stage} fwd, compute) reads w:{prefetch.stage}, never produced")):
        verify(broken)


def test_free_before_read(streamed):
    """Move the FREE of a stage's outputs to right after the forward that makes them."""
    free = next(e for e in streamed.events if e.kind is Kind.FREE and e.frees[0].startswith("act:"))
    buf = free.frees[0]
    maker = next(e for e in streamed.events if buf in e.allocs)
    order = [e.id for e in streamed.events if e.id != free.id]
    order.insert(order.index(maker.id) + 1, free.id)
    broken = rebuild(streamed, order)
    reader = next(e for e in broken.events if e.id > maker.id + 1 and buf in e.reads)
    freed_at = maker.id + 1
    phase = reader.phase.value
    with pytest.raises(VerifyError, match=re.escape(
            f"event {reader.id} (compute stage {reader.stage} {phase}, compute) reads {buf}, freed by event {freed_at}")):
        verify(broken)


def test_missing_wait_across_streams(streamed):
    user = next(e for e in streamed.events if e.kind is Kind.COMPUTE and e.waits)
    broken = dataclasses.replace(streamed, events=tuple(
        dataclasses.replace(e, waits=()) if e.id == user.id else e for e in streamed.events))
    (w,) = user.waits
    buf = streamed.events[w].allocs[0]
    with pytest.raises(VerifyError, match=re.escape(
            f"event {user.id} (compute stage {user.stage} {user.phase.value}, compute) reads {buf} "
            f"made by event {w} on another stream without waiting for it")):
        verify(broken)


def test_wait_on_later_event(streamed):
    first = streamed.events[0]
    broken = dataclasses.replace(streamed, events=(dataclasses.replace(first, waits=(3,)),) + streamed.events[1:])
    with pytest.raises(VerifyError, match=r"event 0 \(.*\) waits on event 3, which does not come before it"):
        verify(broken)


def test_double_free_and_leak(streamed):
    free = next(e for e in streamed.events if e.kind is Kind.FREE and e.frees[0].startswith("saved:"))
    k = free.id
    shift = lambda e: dataclasses.replace(e, id=e.id + 1, waits=tuple(w + 1 if w > k else w for w in e.waits))  # noqa: E731
    doubled = dataclasses.replace(streamed, events=streamed.events[: k + 1] + (dataclasses.replace(free, id=k + 1),)
                                  + tuple(shift(e) for e in streamed.events[k + 1:]))
    with pytest.raises(VerifyError, match=re.escape(
            f"event {k + 1} (free stage {free.stage}, compute) frees {free.frees[0]}, which is not live")):
        verify(doubled)
    leaked = rebuild(streamed, [e.id for e in streamed.events if e.id != k])
    with pytest.raises(VerifyError, match=re.escape(f"GPU buffers ['{free.frees[0]}'] are never freed")):
        verify(leaked)


def test_over_budget_names_event(streamed):
    trace = verify(streamed)
    peak_at = trace.index(max(trace))
    e = streamed.events[peak_at]
    with pytest.raises(VerifyError, match=rf"event {peak_at} \({e.kind.value} stage {e.stage}.*\) needs .* of GPU "
                                          r"memory, over the budget of"):
        verify(dataclasses.replace(streamed, budget=max(trace) - 1))


def test_event_ids_must_be_positions(streamed):
    swapped = (streamed.events[1], streamed.events[0]) + streamed.events[2:]
    with pytest.raises(VerifyError, match=r"is at position 0; event ids must be their positions"):
        verify(dataclasses.replace(streamed, events=swapped))


def test_reading_unplanned_buffer(streamed):
    e = next(e for e in streamed.events if e.kind is Kind.COMPUTE and e.phase is Phase.FWD)
    broken = dataclasses.replace(streamed, events=tuple(
        dataclasses.replace(x, reads=x.reads + ("act:99",)) if x.id == e.id else x for x in streamed.events))
    with pytest.raises(VerifyError, match=re.escape(f"event {e.id} (compute stage {e.stage} fwd, compute) reads act:99, "
                                                    "which is not a planned buffer")):
        verify(broken)
