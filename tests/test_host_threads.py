"""NOTE: [Host step threads] in runtime/streams.py: the host worker's OpenMP teams take every CPU
the process may run on, but for a launcher's OMP_NUM_THREADS, and `LAZYTRAIN_HOST_THREADS` sets them."""

import os

import pytest
import torch

from lazytrain.errors import ResourceError
from lazytrain.runtime.streams import HOST_THREADS_ENV, host_threads


def test_host_steps_take_every_cpu_the_process_may_use(monkeypatch):
    for name in (HOST_THREADS_ENV, "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)  # torch's count: the physical cores
    assert host_threads() == 16


def test_a_launchers_thread_count_is_kept(monkeypatch):
    """torchrun sets OMP_NUM_THREADS to share the host between ranks: the worker keeps torch's count."""
    monkeypatch.delenv(HOST_THREADS_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert host_threads() == 4


def test_the_environment_sets_the_host_steps_threads(monkeypatch):
    monkeypatch.setenv(HOST_THREADS_ENV, "3")
    assert host_threads() == 3
    monkeypatch.setenv(HOST_THREADS_ENV, "0")
    assert host_threads() == 1


def test_a_thread_count_that_is_not_a_number_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv(HOST_THREADS_ENV, "many")
    with pytest.raises(ResourceError, match="LAZYTRAIN_HOST_THREADS='many' is not a number of threads; unset it"):
        host_threads()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams need a GPU")
def test_a_step_shortens_the_gil_switch_interval_and_puts_it_back():
    """NOTE: [Host steps and the GIL]: host steps get the GIL back within `SWITCH_INTERVAL_S` while
    a step runs; the caller's interval returns when its streams finish."""
    import sys

    from lazytrain.runtime.streams import SWITCH_INTERVAL_S, CudaStreams

    before = sys.getswitchinterval()
    streams = CudaStreams(torch.device("cuda"))
    streams.begin(record=False)
    try:
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    finally:
        streams.finish()
    assert sys.getswitchinterval() == pytest.approx(before)
    streams.begin(record=False)  # a step that raised: the trainer abandons its streams
    streams.abandon()
    assert sys.getswitchinterval() == pytest.approx(before)
