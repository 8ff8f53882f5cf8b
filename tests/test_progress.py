"""NOTE: [Compile progress] in lazytrain/progress.py: a pipeline stage that runs long says so on
stderr inside `reporting()`, and only then."""

import time

from lazytrain import progress
from lazytrain.pipeline import _Hook


def test_a_long_stage_says_what_it_does_and_when_it_ends(capsys, monkeypatch):
    monkeypatch.setattr(progress, "AFTER_S", 0.05)
    with progress.reporting():
        assert _Hook(None, False).run("solve", lambda: time.sleep(0.3) or 7) == 7
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("[lazytrain] searching for the fastest plan") and err[1].startswith("[lazytrain] solve: ")


def test_a_quick_stage_and_one_outside_reporting_say_nothing(capsys, monkeypatch):
    monkeypatch.setattr(progress, "AFTER_S", 0.2)
    with progress.reporting():
        _Hook(None, False).run("capture", lambda: None)
    monkeypatch.setattr(progress, "AFTER_S", 0.01)
    _Hook(None, False).run("capture", lambda: time.sleep(0.1))
    time.sleep(0.05)  # a timer that was left running would have printed by now
    assert capsys.readouterr().err == ""
