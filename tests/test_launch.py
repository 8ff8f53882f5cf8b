"""`lazytrain train` on several ranks (NOTE: [Launching] in train/distributed.py), on 2 CPU ranks over
gloo: through torch's launcher (`--nproc-per-node 2`, a subprocess) and, for the failure cases, as
ranks spawned here with torchrun's environment (launch_worker.py).

The runs share one model (a 2-layer Llama without biases, a global batch of 4 x 32) and are made
once per module (`runs`): 2 ranks for 4 steps, 1 rank for 4 steps, and from each run's step-2
checkpoint, resumes at 1 and at 2 ranks.

Tolerances. 2 ranks and 1 rank train on the same global batches; their gradients differ only by the
order of fp32 sums (two half-batch means averaged, against one batch mean), so losses agree to
`LOSS_RTOL` (1e-5; measured within 1e-7). AdamW's update `lr * m / (sqrt(v) + eps)` normalises each
element on its own, so an element whose gradient nearly cancels (its sum is within rounding of 0)
gets an update of up to lr whose size rests on that rounding: after 4 steps a handful of the 140k
weights differ by up to ~7e-6 (0.25% of lr = 3e-3), while the mean difference per tensor stays at
rounding level (~3e-9). So: every tensor's mean difference <= `WEIGHT_MEAN_ATOL` (1e-7), and every
element within `WEIGHT_MAX_ATOL` (1e-4, 3% of one step's update). Training on other rows, skipping
or repeating a batch, or losing the optimizer state moves most elements by a sizeable part of lr
and fails both. (Adam does not see the gradients' scale, so averaging against summing over ranks
is left to the runtime's tests, which use a large eps.) A run resumed at the same world size reads
the same rows and runs the same operations, so it is bit-identical.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import launch_worker
from lazytrain.cli import main
from lazytrain.train import checkpoint as ckpt
from lazytrain.train.checkpoint_load import load_latest
from lazytrain.train.data import CORPUS_PATH, PackedBatches, builtin_tokenizer

ROOT = Path(__file__).resolve().parents[1]
WEIGHT_MEAN_ATOL = 1e-7
WEIGHT_MAX_ATOL = 1e-4
LOSS_RTOL = 1e-5

MODEL = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM

def build_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, use_cache=False, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, attn_implementation="sdpa"))

def example_batch():
    ids = torch.zeros(4, 32, dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone()}
'''


def train_argv(model, run_dir, *extra) -> list[str]:
    return [str(a) for a in ("train", "--model", model, "--checkpoint-dir", run_dir, "--no-progress",
                             "--print-every", 1, *extra)]


def launch(argv: list[str], nproc: int = 2, timeout: float = 300, path: tuple = ()) -> subprocess.CompletedProcess:
    """`python -m lazytrain <argv> --nproc-per-node N`: torch's launcher starts the ranks."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "lazytrain", *argv, "--nproc-per-node", str(nproc)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def back_to_step_2(run_dir: Path) -> None:
    root = run_dir / "checkpoints"
    shutil.rmtree(root / "step-00000004")
    (root / "LATEST").write_text("step-00000002\n")


def log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"]) for r in log(run_dir)]


def final(run_dir: Path) -> ckpt.Checkpoint:
    found = load_latest(run_dir / "checkpoints", None)
    assert found.step == 4
    return found


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("launch_model") / "llama.py"
    path.write_text(MODEL)
    return path


@pytest.fixture(scope="module")
def runs(model_file, tmp_path_factory):
    """{name: (run directory, process result or None)}: "2" and "1" ranks for 4 steps (checkpoints at
    2 and 4), and "2->1", "2->2", "1->2": resumed from that run's step 2 at the other count."""
    base = tmp_path_factory.mktemp("launch_runs")
    out = {}
    two = launch(train_argv(model_file, base / "2", "--steps", 4, "--checkpoint-every", 2))
    assert two.returncode == 0, two.stderr
    out["2"] = (base / "2", two)
    assert main(train_argv(model_file, base / "1", "--steps", 4, "--checkpoint-every", 2)) == 0
    out["1"] = (base / "1", None)
    for name, source, nproc in (("2->1", "2", 1), ("2->2", "2", 2), ("1->2", "1", 2)):
        run_dir = base / name
        shutil.copytree(base / source, run_dir)
        back_to_step_2(run_dir)
        if nproc == 1:
            assert main(train_argv(model_file, run_dir, "--resume")) == 0
            out[name] = (run_dir, None)
        else:
            done = launch(train_argv(model_file, run_dir, "--resume"))
            assert done.returncode == 0, done.stderr
            out[name] = (run_dir, done)
    return out


def assert_same_weights(a: ckpt.Checkpoint, b: ckpt.Checkpoint, exact: bool = False) -> None:
    assert list(a.model_state) == list(b.model_state)
    for name, want in a.model_state.items():
        got = b.model_state[name]
        if exact:
            assert torch.equal(got, want), f"{name} differs"
        else:
            err = (got - want).abs()
            assert err.mean().item() <= WEIGHT_MEAN_ATOL, f"{name} differs by {err.mean().item():.3g} on average"
            assert err.max().item() <= WEIGHT_MAX_ATOL, f"{name} differs by up to {err.max().item():.3g}"
    mine, theirs = moments(a), moments(b)
    assert sorted(mine) == sorted(theirs)
    for name, entry in mine.items():
        for key, want in entry.items():
            got = theirs[name][key]
            if exact or key == "step":
                assert torch.equal(got, want), (name, key)
            else:  # the moments: rounding-level on average, as the weights
                assert (got - want).abs().mean() <= 1e-4 * want.abs().mean(), (name, key)


def moments(found: ckpt.Checkpoint) -> dict:
    """A checkpoint's AdamW moments and steps by parameter name, flattened, whichever layout holds
    them (NOTE: [Distributed checkpoints]): torch.optim's by index (the run's schedule names them) or
    the sharded one's by name."""
    from lazytrain.runtime.schedule import load_schedule
    from lazytrain.train.dist_checkpoint import DEFERRED, SHARDED, whole_sharded

    keys = ("exp_avg", "exp_avg_sq", "step")
    state = found.optimizer_state
    if SHARDED in state:
        entries = whole_sharded(state[SHARDED]["state"], state[SHARDED][DEFERRED])
        return {name: {k: e[k].reshape(-1) if k != "step" else e[k] for k in keys} for name, e in entries.items()}
    schedule = load_schedule(found.path.parent.parent / "schedule.py")
    params = [p for stage in schedule.STAGES for p in stage.params] + list(schedule.SHARED)
    return {schedule.PLACEHOLDERS[params[i]][1]: {k: e[k].reshape(-1) if k != "step" else e[k] for k in keys}
            for i, e in state["state"].items()}


def test_two_ranks_train_as_one_on_the_global_batch(runs):
    """Same losses (the ranks' mean) and, after 4 steps, the same weights and AdamW moments as one
    process on the same global batches, within the tolerances of the module docstring."""
    two, one = log(runs["2"][0]), log(runs["1"][0])
    assert [r["step"] for r in two] == [1, 2, 3, 4] == [r["step"] for r in one]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL)
        assert b["lr"] == a["lr"]
    assert_same_weights(final(runs["1"][0]), final(runs["2"][0]))
    assert one[0]["loss"] - one[-1]["loss"] > 0.05, "the runs did not train: the comparison checks nothing"


def test_checkpoints_of_two_ranks_are_dcp_with_one_copy_of_the_state(runs):
    """A run on 2 ranks saves through torch.distributed.checkpoint (format 2): both ranks wrote a
    file, and the replicated state is stored once (about one process's checkpoint, not two); one
    process still writes format 1."""
    two = runs["2"][0] / "checkpoints" / "step-00000004"
    one = runs["1"][0] / "checkpoints" / "step-00000004"
    assert json.loads((two / "meta.json").read_text())["format"] == ckpt.DCP_FORMAT
    assert json.loads((one / "meta.json").read_text())["format"] == ckpt.FORMAT_VERSION
    shards = sorted(p.name for p in two.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards
    stored = sum(p.stat().st_size for p in two.glob("*.distcp"))
    single = (one / ckpt.MODEL_FILE).stat().st_size + (one / ckpt.OPTIMIZER_FILE).stat().st_size
    # DCP's per-entry framing adds ~1 KiB per tensor; a second copy would double it
    assert stored < 1.5 * single, f"{stored} bytes of shards for a {single}-byte state: not deduplicated"
    rng = torch.load(two / ckpt.RNG_FILE, weights_only=True)
    assert len(rng["ranks"]) == 2


def test_resume_at_the_same_world_size_is_exact(runs):
    """2 ranks, resumed from step 2 on 2 ranks: bit-identical weights, optimizer state, losses and data position."""
    assert_same_weights(final(runs["2"][0]), final(runs["2->2"][0]), exact=True)
    assert losses(runs["2->2"][0]) == losses(runs["2"][0])
    assert "resumed from" in runs["2->2"][1].stdout and "saved on" not in runs["2->2"][1].stdout


@pytest.mark.parametrize("name,reference", [("2->1", "2"), ("1->2", "1")])
def test_resume_at_another_world_size_continues_the_same_run(runs, name, reference):
    """Saved at 2 ranks and resumed at 1 (and 1 -> 2): the data goes on at the same global row (no
    batch repeated or skipped: the same losses), and the weights match the uninterrupted run."""
    run_dir = runs[name][0]
    got, want = final(run_dir), final(runs[reference][0])
    assert got.extra["data"] == want.extra["data"]
    assert got.extra["data"]["row"] == 4 * 4  # 4 steps of 4 global rows
    for a, b in zip(log(runs[reference][0]), log(run_dir)):
        assert b["step"] == a["step"] and b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL)
    assert_same_weights(want, got)
    if name == "1->2":
        assert "saved on 1 rank)" in runs[name][1].stdout


def test_only_rank_0_prints_and_logs(runs):
    """One summary, one compile, one line per step on stdout; no errors; the log has one record per step."""
    out = runs["2"][1].stdout
    assert out.count("compiling ") == 1 and "for batch [2, 32] on each of 2 ranks" in out
    assert out.count("schedule for ") == 1
    for step in range(1, 5):
        assert out.count(f"step {step:>5}  loss") == 1, out
    assert "lazytrain: error" not in runs["2"][1].stderr
    assert len(log(runs["2"][0])) == 4
    # tokens/s counts the global batch: 4 x 32 tokens per step
    record = log(runs["2"][0])[-1]
    assert record["tokens_per_s"] == pytest.approx(4 * 32 / record["step_s"], rel=1e-9)
    # and TFLOPS its attention too (NOTE: [Model FLOPs] in lazytrain/train/flops.py): all 4 rows, each
    # one 32-token sequence (the documents attend across each other), in 2 layers of 2 heads x 32
    space = {}
    exec(MODEL, space)
    n_params = sum(p.numel() for p in space["build_model"]().parameters())
    assert record["tflops_counts_attention"] is True
    assert record["tflops"] * record["step_s"] * 1e12 == pytest.approx(
        6 * n_params * 4 * 32 + 14 * 2 * 64 * 4 * (32 * 33 // 2), rel=1e-9)


# ---- data slices -----------------------------------------------------------------------------------

def test_ranks_read_disjoint_rows_of_the_global_batch():
    """Rank r of w reads rows [r*b, (r+1)*b) of each global batch (b = batch / w), epoch boundaries and
    reshuffled epochs included: the ranks' rows stacked are the one-process batch, and each rank's
    position is the global one; a position saved at 2 ranks resumes at 3 where 1 rank would be."""
    tok = builtin_tokenizer()
    one = PackedBatches([CORPUS_PATH], tok, 6, 512, seed=3)
    ranks = [PackedBatches([CORPUS_PATH], tok, 6, 512, seed=3, rank=r, world=2) for r in range(2)]
    steps = 2 * one.rows_per_epoch // 6 + 3  # into the third epoch (shuffled) and across its boundaries
    for i in range(steps):
        want = next(one)
        got = [next(r) for r in ranks]
        assert all(g["input_ids"].shape == (3, 512) for g in got)
        for key in ("input_ids", "labels"):
            assert torch.equal(torch.cat([g[key] for g in got]), want[key]), f"step {i}: {key}"
        assert all(r.state_dict() == one.state_dict() for r in ranks)
    three = [PackedBatches([CORPUS_PATH], tok, 6, 512, seed=3, rank=r, world=3) for r in range(3)]
    for r in three:
        r.load_state_dict(ranks[0].state_dict())
    for _ in range(3):
        want = next(one)
        assert torch.equal(torch.cat([next(r)["input_ids"] for r in three]), want["input_ids"])


# ---- refusals and failures --------------------------------------------------------------------------

def test_world_size_that_does_not_divide_the_global_batch_is_refused(model_file, tmp_path):
    """3 ranks for a global batch of 4: every rank refuses before reading data; rank 0 alone says why
    and how to fix it."""
    done = launch(train_argv(model_file, tmp_path / "run", "--steps", 2), nproc=3)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("lazytrain: error: ")]
    assert errors[0] == ("lazytrain: error: the global batch of 4 rows cannot be split evenly over 3 ranks; run on a "
                         "number of ranks that divides 4 (1, 2, 4), or make the global batch a multiple of 3 rows "
                         f"(example_batch() in {model_file}, e.g. 6)"), done.stderr
    assert len(errors) == 2 and "exited with code 2, and the launcher stopped the others; its own output is above" in errors[1], done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


def two_rank_schedule(tmp_path: Path, capsys, *extra: str) -> Path:
    """`lazytrain compile --world-size 2` of the model at half its batch (2 rows a rank)."""
    schedule = tmp_path / "s.py"
    half = tmp_path / "half.py"
    half.write_text(MODEL.replace("torch.zeros(4, 32", "torch.zeros(2, 32"))
    assert main(["compile", str(half), "-o", str(schedule), "--hardware", "cpu", "--budget", "1GiB",
                 "--world-size", "2", *extra]) == 0
    capsys.readouterr()
    return schedule


def test_schedule_for_another_world_size_is_refused(model_file, tmp_path, capsys):
    """A --schedule compiled for 2 ranks (2 rows each), given to a run of one process."""
    schedule = two_rank_schedule(tmp_path, capsys)
    code = main(train_argv(model_file, tmp_path / "run", "--steps", 2, "--schedule", schedule))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert (f"{schedule} was compiled for 2 ranks and a batch of [2, 32] per rank; this run has 1 rank sharing a "
            "global batch of [4, 32], [4, 32] per rank") in err, err


@pytest.mark.parametrize("mode", ["exit", "stall"])
def test_a_lost_rank_stops_the_others_with_an_error(model_file, tmp_path, capsys, mode):
    """Rank 1 exits (or hangs) as it reads its batch for step 3, outside any launcher that would stop
    rank 0: rank 0's step 3 fails with one line naming the failed reduction and the timeout instead of
    hanging (a closed connection at once; a hung rank after --dist-timeout, 3 s here). The schedule is
    compiled beforehand: rank 1 would wait for rank 0's compile within the same 3 s."""
    schedule = two_rank_schedule(tmp_path, capsys, "--replicate-state")
    argv = train_argv(model_file, tmp_path / "run", "--steps", 6, "--checkpoint-every", 2, "--dist-timeout", 3,
                      "--schedule", schedule)
    got = launch_worker.run_ranks(argv, tmp_path / "out", fault=(mode, 3), deadline_s=240)
    code, out, err = got[0]
    assert code == 2, err
    assert "step     2  loss" in out and "step     3" not in out
    lines = [line for line in err.splitlines() if line.startswith("lazytrain: error: ")]
    assert len(lines) == 1 and "failed on rank 0 of 2" in lines[0] and "timeout (3 s)" in lines[0], err
    assert (tmp_path / "run" / "checkpoints" / "LATEST").read_text() == "step-00000002\n"


def test_a_rank_that_dies_under_the_launcher_ends_the_run(model_file, tmp_path):
    """Through `--nproc-per-node`: rank 1 dies (exit code 7) reading its batch for step 3 (made so by a
    sitecustomize on its path); the launcher stops rank 0 and the command ends with one line naming
    the rank, instead of hanging."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from launch_worker import die_at\n"
        "    die_at(3)\n")
    done = launch(train_argv(model_file, tmp_path / "run", "--steps", 6), path=(site, Path(__file__).parent),
                  timeout=240)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == ("lazytrain: error: rank 1 of 2 exited with code 7, and the launcher "
                                            "stopped the others; its own output is above"), done.stderr
    assert "step     2  loss" in done.stdout and "step     3" not in done.stdout


def test_nproc_per_node_that_disagrees_with_torchrun_is_refused(model_file, tmp_path, monkeypatch, capsys):
    """Under torchrun (its environment: 2 ranks on this host), `--nproc-per-node 3` is refused before
    any process group is joined."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    code = main(train_argv(model_file, tmp_path / "run", "--steps", 2, "--nproc-per-node", 3))
    err = capsys.readouterr().err
    assert code == 2 and err == ("lazytrain: error: --nproc-per-node 3 was given, but the launcher started 2 ranks on "
                                 "this host; drop --nproc-per-node under torchrun (its own flag sets the ranks)\n"), err


@pytest.mark.parametrize("change,message", [
    ('attn_implementation="sdpa"', None),  # unchanged: the control
    ('hidden_act="gelu", attn_implementation="sdpa"', "was written for model fingerprint"),
    ("torch.zeros(4, 32", "was trained on a global batch of [4, 32] (2 ranks of [2, 32]), this run's is [8, 32]"),
])
def test_resume_at_another_world_size_checks_the_model(runs, tmp_path, capsys, change, message):
    """A checkpoint of 2 ranks resumed by one process: its fingerprint is checked against the model
    captured at the checkpoint's per-rank batch, so another activation (same weights' shapes) is
    refused; so is another global batch. The unchanged model resumes (the control)."""
    model = tmp_path / "model.py"
    text = MODEL.replace('attn_implementation="sdpa"', change) if "zeros" not in change else \
        MODEL.replace(change, "torch.zeros(8, 32")
    model.write_text(text)
    run_dir = tmp_path / "run"
    shutil.copytree(runs["2"][0], run_dir)
    back_to_step_2(run_dir)
    code = main(train_argv(model, run_dir, "--resume"))
    err = capsys.readouterr().err
    if message is None:
        assert code == 0, err
        return
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_checkpoints_of_sharded_state_hold_each_ranks_pieces(runs):
    """By default 2 ranks shard the state (NOTE: [State in train]): the checkpoint holds it by
    parameter name, each rank's file its own pieces, and the masters once (as the model's weights)."""
    from lazytrain.train.dist_checkpoint import SHARDED

    found = final(runs["2"][0])
    entries = found.optimizer_state[SHARDED]["state"]
    assert entries and all(set(e) == {"exp_avg", "exp_avg_sq", "step"} for e in entries.values())
    # read whole only when a trainer asks: a sharded one reads its pieces alone
    assert all(e["exp_avg"].is_meta and not e["step"].is_meta for e in entries.values())
    shards = sorted(p.name for p in found.path.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    sizes = [(found.path / p).stat().st_size for p in shards]
    assert min(sizes) > 0.3 * max(sizes), sizes  # both ranks wrote moments, not one rank everything


def test_a_replicated_run_resumes_sharded(runs, model_file, tmp_path, capsys):
    """Two steps on 2 ranks with replicated state (a --replicate-state --schedule: torch.optim's
    layout), resumed for two more with the default sharded schedule: each rank takes its pieces of
    the whole state, and the run ends where the sharded run of 4 steps does."""
    from lazytrain.train.dist_checkpoint import SHARDED

    run_dir = tmp_path / "run"
    schedule = two_rank_schedule(tmp_path, capsys, "--replicate-state")
    done = launch(train_argv(model_file, run_dir, "--steps", 4, "--checkpoint-every", 2, "--schedule", schedule))
    assert done.returncode == 0, done.stderr
    assert SHARDED not in load_latest(run_dir / "checkpoints", None).optimizer_state
    back_to_step_2(run_dir)
    (run_dir / "schedule.py").unlink(missing_ok=True)  # none: it ran a --schedule; the resume compiles
    done = launch(train_argv(model_file, run_dir, "--resume"))
    assert done.returncode == 0, done.stderr
    got = final(run_dir)
    assert SHARDED in got.optimizer_state
    assert_same_weights(final(runs["2"][0]), got)


def test_the_launcher_shares_the_cores_among_its_ranks(monkeypatch):
    """NOTE: [Launching]: torch's launcher would give each rank one OpenMP thread; `--nproc-per-node`
    gives each its share of the host's cores, unless the user set OMP_NUM_THREADS."""
    import torch.distributed.run

    from lazytrain.train import distributed

    seen = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda config: seen.append(os.environ.get("OMP_NUM_THREADS")))
    monkeypatch.setattr(distributed, "host_cores", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    distributed.relaunch(4, ["train"])
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    distributed.relaunch(4, ["train"])
    assert seen == ["4", "3"]


def test_a_rank_with_one_thread_on_a_bigger_host_is_warned_about(monkeypatch, capsys):
    """Under torchrun with its default of one thread a rank, rank 0 names the fix."""
    import torch.distributed as dist

    from lazytrain.train import distributed

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(distributed, "host_cores", lambda: 16)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        distributed.from_env(None, "cpu", 5.0)
        assert "set OMP_NUM_THREADS=8" in capsys.readouterr().err
        torch.set_num_threads(8)
        distributed.from_env(None, "cpu", 5.0)
        assert capsys.readouterr().err == ""
    finally:
        torch.set_num_threads(threads)


def test_profile_under_torchrun_measures_as_a_rank_trains(monkeypatch):
    """`lazytrain profile` under torchrun: each rank takes its share of the cores, as training ranks
    do, instead of the launcher's one thread (host rates 30x too low on the 2-GPU box)."""
    from lazytrain import profile
    from lazytrain.train import distributed

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(distributed, "host_cores", lambda: 8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        profile._as_rank()
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(threads)


def test_other_ranks_wait_for_rank_0_to_report(monkeypatch):
    """A rank stopped by another's failure exits only once rank 0 has printed why, or after the
    bound when rank 0 never does (NOTE: [Launching])."""
    import time

    import torch.distributed as dist

    from lazytrain.train import distributed

    store = dist.HashStore()
    monkeypatch.setattr(distributed, "REPORT_WAIT_S", 0.5)
    monkeypatch.setattr(distributed, "_STORE", store)
    monkeypatch.setattr(distributed, "_RANK", 1)
    start = time.monotonic()
    distributed.await_report()  # no mark: waits out the bound
    assert time.monotonic() - start >= 0.5
    distributed.reported()  # rank 1 does not mark
    assert not store.check([distributed.REPORTED])
    monkeypatch.setattr(distributed, "_RANK", 0)
    distributed.reported()
    assert store.check([distributed.REPORTED])
    start = time.monotonic()
    distributed.await_report()
    assert time.monotonic() - start < 0.5
