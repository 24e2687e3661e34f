"""treeattn.launch: a failing, dying or hanging rank gives LaunchError quickly, and no
process outlives the call."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from procs import P, watch_children
from treeattn.launch import LaunchError, launch


def raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("deliberate failure on rank one: 7f3a")
    time.sleep(60)  # the others are still busy; launch() must not wait for them


def raise_while_peers_in_collective() -> None:
    if dist.get_rank() == 1:
        time.sleep(0.5)  # the others are inside the all_reduce by now
        raise RuntimeError("root cause on rank one: 91c2")
    dist.all_reduce(torch.ones(8))  # fails with a gloo error once rank 1 is gone


def exit_mid_collective() -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        time.sleep(0.5)  # the others are inside the all_reduce by now
        os._exit(3)
    dist.all_reduce(torch.ones(8))


def sleep_forever() -> None:
    time.sleep(3600)


def test_rank_exception_is_reported():
    t0 = time.monotonic()
    with watch_children(), pytest.raises(LaunchError) as ei:
        launch(raise_on_rank_1, P, timeout=120, grace=2)
    assert time.monotonic() - t0 < 30
    assert ei.value.rank == 1
    assert "deliberate failure on rank one: 7f3a" in str(ei.value)
    assert "RuntimeError" in ei.value.details


def test_root_cause_named_when_peers_fail_in_a_collective():
    t0 = time.monotonic()
    with watch_children(), pytest.raises(LaunchError) as ei:
        launch(raise_while_peers_in_collective, P, timeout=120, collective_timeout=60)
    assert time.monotonic() - t0 < 30
    assert ei.value.rank == 1 and "root cause on rank one: 91c2" in str(ei.value)


def test_rank_dies_mid_collective():
    t0 = time.monotonic()
    with watch_children(), pytest.raises(LaunchError) as ei:
        launch(exit_mid_collective, P, timeout=120, collective_timeout=60)
    assert time.monotonic() - t0 < 30
    assert ei.value.rank == 0 and "exit code 3" in str(ei.value)


def test_timeout():
    t0 = time.monotonic()
    with watch_children(), pytest.raises(LaunchError) as ei:
        launch(sleep_forever, P, timeout=5)
    took = time.monotonic() - t0
    assert 5 <= took < 30, took
    assert ei.value.rank is None
    assert "timed out" in str(ei.value)


def test_torchrun_group_has_the_collective_timeout_and_is_destroyed(monkeypatch):
    """The CLIs' torchrun path: the group comes from torchrun's environment with the given
    collective timeout (serve's copy once ignored --collective-timeout) and is destroyed on
    the way out, an exception included."""
    import socket

    from treeattn.comm.shm_small import _timeout
    from treeattn.launch import torchrun_group, under_torchrun

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert under_torchrun()
    with pytest.raises(KeyError), torchrun_group("gloo", threads=torch.get_num_threads(), collective_timeout=37):
        assert dist.is_initialized() and not under_torchrun()
        assert _timeout(None) == 37
        raise KeyError("a failing worker")
    assert not dist.is_initialized()
