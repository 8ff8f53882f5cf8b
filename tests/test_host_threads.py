"""NOTE: [Host step threads] in runtime/streams.py: the host worker's OpenMP teams are the
process's, and `LAZYTRAIN_HOST_THREADS` sets them."""

import pytest
import torch

from lazytrain.errors import ResourceError
from lazytrain.runtime.streams import HOST_THREADS_ENV, host_threads


def test_host_steps_take_the_process_threads(monkeypatch):
    monkeypatch.delenv(HOST_THREADS_ENV, raising=False)
    assert host_threads() == torch.get_num_threads()


def test_the_environment_sets_the_host_steps_threads(monkeypatch):
    monkeypatch.setenv(HOST_THREADS_ENV, "3")
    assert host_threads() == 3
    monkeypatch.setenv(HOST_THREADS_ENV, "0")
    assert host_threads() == 1


def test_a_thread_count_that_is_not_a_number_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv(HOST_THREADS_ENV, "many")
    with pytest.raises(ResourceError, match="LAZYTRAIN_HOST_THREADS='many' is not a number of threads; unset it"):
        host_threads()
