"""The fidelity run's line names the windows furthest over and under the plan (bench/fidelity_table.py)."""

from __future__ import annotations

from bench.fidelity_cases import GiB
from bench.fidelity_table import _windows_off


def test_the_windows_furthest_from_the_plan_are_named_and_pre_is_left_out():
    windows = [{"window": "pre", "predicted_bytes": 0, "measured_bytes": 15 * GiB},  # not priced
               {"window": "F1", "predicted_bytes": 8 * GiB, "measured_bytes": 8 * GiB + GiB // 4},
               {"window": "B2", "predicted_bytes": 16 * GiB, "measured_bytes": 18 * GiB},
               {"window": "B1", "predicted_bytes": 16 * GiB, "measured_bytes": None},  # not read
               {"window": "tail", "predicted_bytes": 13 * GiB, "measured_bytes": 9 * GiB}]
    line = _windows_off({"windows": windows})
    assert line == "; windows over the plan by at most +2.00 GiB (B2), under by at most -4.00 GiB (tail)"
    assert _windows_off({"windows": windows[:1]}) == "" and _windows_off({}) == ""
