"""bench/tile_rates.py runs where CI does: every case once, its tile counts those the capture uses."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import tile_rates  # noqa: E402
from lazytrain.kernels.tiling import tiles_for  # noqa: E402


def test_each_budget_is_timed_with_the_tiles_capture_would_give(capsys):
    rows = tile_rates.main(["--tokens", "96", "--hidden", "8", "--intermediate", "16", "--budgets", "1KiB", "4KiB",
                            "--reps", "1"])
    tiles = {name: n for name, n, ms, _ in rows}
    assert tiles == {"mlp eager": 1, "mlp 1.0 KiB": tiles_for(96, 16, 4, 1024), "mlp 4.0 KiB": tiles_for(96, 16, 4, 4096),
                     "norm eager": 1, "norm 1.0 KiB": tiles_for(96, 8, 4, 1024), "norm 4.0 KiB": tiles_for(96, 8, 4, 4096)}
    assert tiles["mlp 1.0 KiB"] > tiles["mlp 4.0 KiB"] > 1
    assert all(ms > 0 for _, _, ms, _ in rows)
    assert "| mlp 1.0 KiB |" in capsys.readouterr().out
