"""NOTE: [Run lock] in train/lock.py: one run at a time in a run directory; a second is refused
naming the process that holds it, before it writes anything, and a holder killed with SIGKILL
leaves nothing that blocks the next run."""

import os
import signal
import subprocess
import sys

import pytest

from lazytrain.cli import main
from lazytrain.errors import CheckpointError
from lazytrain.train.lock import LOCK_FILE, RunLock

HOLD = "import sys, time; from pathlib import Path; from lazytrain.train.lock import RunLock; " \
       "RunLock.take(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)"


@pytest.fixture
def held(tmp_path):
    """`tmp_path / "run"` locked by another process, which is killed with SIGKILL afterwards."""
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield run, holder
    holder.kill()
    holder.wait()


def test_a_second_lock_names_the_holder(held):
    run, holder = held
    with pytest.raises(CheckpointError, match=rf"in use by another lazytrain run \(process {holder.pid} on "):
        RunLock.take(run)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    RunLock.take(run).release()  # the kernel dropped the dead holder's lock
    assert (run / LOCK_FILE).exists()


def test_lock_is_released_for_the_next_run(tmp_path):
    first = RunLock.take(tmp_path)
    first.release()
    RunLock.take(tmp_path).release()


@pytest.mark.parametrize("resume", [False, True])
def test_train_beside_a_running_run_is_refused(held, capsys, resume):
    run, holder = held
    (run / "log.jsonl").write_text('{"step": 1}\n')
    code = main(["train", "--steps", "2", "--no-progress", "--checkpoint-dir", str(run)] + (["--resume"] if resume else []))
    err = capsys.readouterr().err
    assert code == 2 and f"in use by another lazytrain run (process {holder.pid}" in err
    assert len(err.strip().splitlines()) == 1
    assert (run / "log.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "log.jsonl"]
