"""The timeline view: Chrome-trace JSON, the PNG, and measured-timeline files."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from lazytrain.errors import ScheduleMismatch
from lazytrain.ir.events import Kind, Stream
from lazytrain.pipeline import compile_model
from lazytrain.runtime.schedule import load_source
from lazytrain.timeline import chrome_trace, load_measured, memory_curve, plot_png, save_measured, write_trace
from models import tiny_gpt_pair, unique_name

BUDGET = 420 * 1024  # small enough that weights stream and activations offload


@pytest.fixture(scope="module")
def run():
    """(schedule module, measured timeline of one real step)."""
    meta, real, batch = tiny_gpt_pair()
    compiled = compile_model(meta, batch, BUDGET, "cpu", source="tests/tiny_gpt")
    module = load_source(compiled.source_text, unique_name("lt_test_timeline"))
    trainer = module.bind(real)
    trainer.record_timeline = True
    trainer.step(batch)
    assert len(trainer.timeline) == len(module.EVENTS)
    return module, list(trainer.timeline)


def by_pid(trace: dict, pid: int, *phases: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["pid"] == pid and e["ph"] in phases]


def test_trace_is_well_formed(run, tmp_path):
    module, measured = run
    path = write_trace(module, tmp_path / "trace.json", measured)
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(chrome_trace(module, measured)))
    assert trace["displayTimeUnit"] == "ms"
    assert trace["metadata"]["fingerprint"] == module.FINGERPRINT
    assert trace["metadata"]["budget"] == module.BUDGET

    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert procs == {1: "predicted", 2: "measured"}
    used = {e.stream.value for e in module.EVENTS}
    for pid in procs:
        lanes = {e["args"]["name"] for e in by_pid(trace, pid, "M") if e["name"] == "thread_name"}
        assert lanes == used and lanes <= {s.value for s in Stream}
        spans = by_pid(trace, pid, "X", "i")
        assert Counter(e["args"]["id"] for e in spans) == Counter(range(len(module.EVENTS)))
        for e in spans:
            assert e["ts"] >= 0
            if e["ph"] == "X":
                assert e["dur"] >= 0
            ev = module.EVENTS[e["args"]["id"]]
            assert e["args"]["stream"] == ev.stream.value and e["args"]["kind"] == ev.kind.value
        assert all(e["ph"] == "i" for e in spans if e["cat"] == Kind.FREE.value)

    names = {e["name"] for e in by_pid(trace, 1, "X", "i")}
    assert any(n.endswith(" fwd") for n in names) and any(n.startswith("prefetch w:") for n in names)
    assert any(n.startswith("free ") for n in names) and any(n.startswith("opt_step ") for n in names)

    counters = by_pid(trace, 1, "C")
    values = [c["args"]["bytes"] for c in counters]
    assert counters and max(values) <= module.BUDGET
    assert max(values) == module.PREDICTED_PEAK  # the same replay as the verifier
    stamps = [c["ts"] for c in counters]
    assert stamps == sorted(stamps)


def test_trace_without_measured_and_deterministic(run):
    module, _ = run
    a, b = chrome_trace(module), chrome_trace(module)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert {e["pid"] for e in a["traceEvents"]} == {1}
    assert memory_curve(module)[-1][1] == sum(b.bytes for b in module.BUFFERS if b.pool == "gpu" and b.persistent)


def test_png(run, tmp_path):
    import matplotlib.image

    module, measured = run
    for name, m in (("both.png", measured), ("predicted.png", None)):
        path = plot_png(module, tmp_path / name, m)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = matplotlib.image.imread(path)
        assert img.shape[0] > 200 and img.shape[1] > 400
        assert img[..., :3].std() > 0.01  # something was drawn


def test_measured_round_trip_and_mismatch(run, tmp_path):
    module, measured = run
    path = save_measured(tmp_path / "m.json", measured, module)
    assert load_measured(path, module) == [(int(i), float(s), float(t)) for i, s, t in measured]
    assert load_measured(path) == load_measured(path, module)

    data = json.loads(path.read_text())
    for key, value, message in (("fingerprint", "not-this-one", "fingerprint"),
                                ("checksum", "another-plan", "another plan of this model")):
        wrong = tmp_path / f"wrong-{key}.json"
        wrong.write_text(json.dumps({**data, key: value}))
        with pytest.raises(ScheduleMismatch, match=message):
            load_measured(wrong, module)

    far = save_measured(tmp_path / "far.json", measured + [(len(module.EVENTS), 0.0, 1.0)], module)
    with pytest.raises(ScheduleMismatch, match="event ids"):
        load_measured(far, module)
    with pytest.raises(ScheduleMismatch, match="event ids"):
        chrome_trace(module, [(-1, 0.0, 1.0)])

    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ScheduleMismatch, match="not a measured timeline"):
        load_measured(tmp_path / "junk.json", module)
