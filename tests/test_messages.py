"""What the command line says, as a new user reads it: the plan of a CPU run names no GPU, a minimum
budget reads the same wherever it is printed, and every `train` flag is documented where the user
looks (its --help and the README's synopsis)."""

import re
from pathlib import Path

import pytest

from lazytrain.cli import main, parser

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = str(ROOT / "lazytrain/examples/tiny_gpt.py")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_cpu_plan_names_no_gpu(tmp_path, capsys):
    """On the CPU one processor is both the device and the host: the summary and the schedule's header
    say "device" and "host", never "GPU" or "optimizer gpu"."""
    schedule = tmp_path / "s.py"
    code, out, err = run(capsys, "compile", TINY_GPT, "-o", str(schedule), "--budget", "420KiB", "--hardware", "cpu")
    assert code == 0, err
    header = "\n".join(line for line in schedule.read_text().splitlines() if line.startswith("#"))
    assert "GPU" not in out and " gpu\n" not in out
    assert "GPU memory" not in header and "GPU bytes" not in header and "optimizer on gpu" not in header
    assert "predicted device memory per window" in out and "420.0 KiB device memory" in header
    assert re.search(r"outputs keep +optimizer on host\n", out) and "optimizer on host" in header
    assert "optimizer on gpu" not in out


def test_the_smallest_budget_reads_the_same_where_it_is_printed(tmp_path, capsys):
    """`--budget min` prints the budget the refusal of a smaller one names (rounded up: it can be
    passed back as --budget)."""
    code, _, err = run(capsys, "compile", TINY_GPT, "-o", str(tmp_path / "a.py"), "--budget", "10KiB", "--hardware", "cpu")
    assert code == 2
    refused = re.search(r"smallest feasible budget: ([0-9.]+ [KMG]?i?B)", err).group(1)
    code, out, err = run(capsys, "compile", TINY_GPT, "-o", str(tmp_path / "b.py"), "--budget", "min", "--hardware", "cpu")
    assert code == 0, err
    assert re.search(r"^budget ([0-9.]+ [KMG]?i?B);", out, re.M).group(1) == refused
    assert f"<= budget {refused})" in out


def test_an_unknown_train_flag_points_at_train_help(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--no-such-flag"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "lazytrain train: error: unrecognized arguments: --no-such-flag; see `lazytrain train --help`"


def _train_flags() -> dict[str, object]:
    train = parser()._commands["train"]
    return {a.option_strings[-1]: a for a in train._actions if a.option_strings and a.dest != "help"}


def test_every_train_flag_has_help():
    undocumented = [flag for flag, action in _train_flags().items() if not action.help]
    assert not undocumented


def test_the_readme_synopsis_lists_every_train_flag():
    readme = (ROOT / "README.md").read_text()
    synopsis = re.search(r"^lazytrain train .*?(?=^lazytrain profile)", readme, re.S | re.M).group(0)
    missing = [flag for flag in _train_flags() if flag not in synopsis]
    assert not missing


def test_compiling_in_place_ops_prints_no_torch_deprecation(tmp_path, capsys):
    """torch's FutureWarning about `LeafSpec` (raised inside its own functionalisation of in-place
    ops) is not the user's to act on: compile prints none."""
    import warnings

    model = tmp_path / "inplace.py"
    model.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.w = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        y = self.w(x)\n"
        "        y.add_(1.0)\n"
        "        return y.relu_().sum()\n"
        "def build_model(): return M()\n"
        "def example_batch(): return {'x': torch.ones(2, 8)}\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = run(capsys, "compile", str(model), "-o", str(tmp_path / "s.py"), "--hardware", "cpu")
    assert code == 0, err
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]


def test_a_config_error_is_one_line(tmp_path, capsys):
    """transformers' refusal of a config spans several lines; lazytrain quotes its first."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no-such-architecture"}')
    code, _, err = run(capsys, "train", "--model", str(model), "--steps", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "cannot be read as a Hugging Face config" in err
