"""Failure propagation: a rank that stalls or is killed mid-step never leaves its peers
hanging. Peers raise CollectiveError naming the operation within the collective timeout
(+10 s), the launcher raises LaunchError naming the rank, no process outlives launch() and
its temporary directory is removed.

(A rank that *raises* during a step, or exits mid-collective, is covered by
tests/test_launch.py::test_root_cause_named_when_peers_fail_in_a_collective and
::test_rank_dies_mid_collective.)

Run with ``-s`` to see the measured time-to-failure figures (docs/reliability.md quotes them).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from procs import watch_children as no_orphans  # the no-orphan check shared with tests/test_launch.py
from treeattn.launch import LaunchError, launch

P = 2  # every failure needs its own launch: the smallest group keeps the suite fast
COLLECTIVE_TIMEOUT = 5.0  # the world group's (launch(collective_timeout=...))
SUB_TIMEOUT = 2.0  # sub-groups of the stall test: init_process_group/new_group(timeout=...)
SLACK = 10.0  # the promise: peers fail within the timeout + 10 s


def _record_dirs(monkeypatch) -> list[str]:
    made: list[str] = []
    real = tempfile.TemporaryDirectory

    def recording(*a, **kw):
        d = real(*a, **kw)
        made.append(d.name)
        return d

    monkeypatch.setattr(tempfile, "TemporaryDirectory", recording)
    return made


def _check_dirs_removed(made: list[str]) -> None:
    assert made, "launch() created no temporary directory"
    for d in made:
        assert Path(d).parent == Path(tempfile.gettempdir()) and Path(d).name.startswith("treeattn-"), d
        assert not os.path.exists(d), f"launch() left {d} behind"


@pytest.fixture
def launch_dirs(monkeypatch):
    """Names of the temporary directories launch() creates (it must remove them)."""
    made = _record_dirs(monkeypatch)
    yield made
    _check_dirs_removed(made)


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, 4, 1, 8, generator=g),
        torch.randn(1, 2, 6, 8, generator=g),
        torch.randn(1, 2, 6, 8, generator=g),
    )


def _write(outdir: str, name: str, record: dict) -> None:
    Path(outdir, f"{name}.json").write_text(json.dumps(record))


class _Stalled(Exception):
    """Raised by the stalled rank after its stall, to skip the rest of the call."""


@contextlib.contextmanager
def _patched(module, name: str, replacement):
    orig = getattr(module, name)
    setattr(module, name, replacement(orig))
    try:
        yield
    finally:
        setattr(module, name, orig)


def _stall_in_local_attention(seconds: float):
    def make(orig):
        def slow(*a, **kw):
            time.sleep(seconds)  # a slow rank: its peers are already waiting in the reduction
            raise _Stalled

        return slow

    return make


# ---------------------------------------------------------------------------------------
# a rank that stalls


def stall_worker(outdir: str) -> None:
    """Three stalls: mid tree_decode on rank 0 (sub-group, 2 s timeout), mid ring_decode on
    rank 1 (sub-group, 2 s), then rank P-1 before tree_decode on the world group (5 s) —
    the last one ends the run (the peers' CollectiveError propagates to launch())."""
    import treeattn
    import treeattn.parallel.ring as ring_mod
    import treeattn.parallel.tree as tree_mod
    from treeattn.comm.collectives import CollectiveError
    from treeattn.comm.topology import Topology, node_groups

    rank = dist.get_rank()
    q, k, v = _data(rank)
    sub = [dist.new_group(timeout=datetime.timedelta(seconds=SUB_TIMEOUT)) for _ in range(2)]
    record: dict = {}
    # the groups the hierarchical strategy creates: their collective timeout (private API)
    record["node group timeouts"] = [
        g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in node_groups(None, Topology(1))
    ]
    scenarios = [  # (name, stalled rank, module and function that stall, call)
        ("tree allreduce2", 0, tree_mod, "attention_state",
         lambda: treeattn.tree_decode(q, k, v, group=sub[0], strategy="allreduce2")),
        # the ring posts its first transfer before its own block's attention: stall before the post
        ("ring", 1, ring_mod, "sendrecv", lambda: treeattn.ring_decode(q, k, v, group=sub[1])),
    ]  # fmt: skip
    for name, stalled, mod, fn, call in scenarios:
        dist.barrier()  # on the world group, which stays healthy
        t0 = time.monotonic()
        try:
            if rank == stalled:
                with _patched(mod, fn, _stall_in_local_attention(SUB_TIMEOUT + 1)):
                    call()
            else:
                call()
            record[name] = {"error": None}
        except _Stalled:
            record[name] = {"stalled": True}
        except CollectiveError as e:
            record[name] = {"took": time.monotonic() - t0, "op": e.op, "caller": e.caller, "msg": str(e)}
    dist.barrier()
    if rank == P - 1:  # stalls before the call: the peers wait in the validation all-gather
        _write(outdir, f"rank{rank}", record)
        time.sleep(COLLECTIVE_TIMEOUT + 3)  # killed by launch() before this ends
        return
    t0 = time.monotonic()
    try:
        treeattn.tree_decode(q, k, v)
    except CollectiveError as e:
        record["world tree_decode"] = {"took": time.monotonic() - t0, "op": e.op, "caller": e.caller, "msg": str(e)}
        _write(outdir, f"rank{rank}", record)
        raise
    _write(outdir, f"rank{rank}", record)


@pytest.fixture(scope="module")
def stall_run(tmp_path_factory):
    """One launch with three stalls (see stall_worker): (LaunchError, seconds, per-rank records)."""
    out = tmp_path_factory.mktemp("stall")
    with pytest.MonkeyPatch.context() as mp:
        made = _record_dirs(mp)
        t0 = time.monotonic()
        with no_orphans(P), pytest.raises(LaunchError) as ei:
            launch(stall_worker, P, (str(out),), timeout=120, collective_timeout=COLLECTIVE_TIMEOUT, grace=1)
        total = time.monotonic() - t0
    _check_dirs_removed(made)
    return ei.value, total, {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(P)}


def test_stalled_rank_gives_collective_error_naming_the_operation(stall_run):
    error, total, recs = stall_run
    expect = {  # scenario -> (stalled rank, op, caller, timeout)
        "tree allreduce2": (0, "all_reduce", "allreduce2", SUB_TIMEOUT),
        "ring": (1, "send-recv", "ring", SUB_TIMEOUT),
        "world tree_decode": (P - 1, "all_gather", "tree_decode", COLLECTIVE_TIMEOUT),
    }
    for name, (stalled, op, caller, timeout) in expect.items():
        for r in range(P):
            if r == stalled:
                continue
            got = recs[r].get(name)
            assert got and "took" in got, f"{name}: rank {r} did not raise CollectiveError: {got}"
            assert got["op"] == op and got["caller"] == caller, f"{name} rank {r}: {got}"
            assert f"treeattn {op} failed on rank {r} of {P}" in got["msg"], got["msg"]
            assert "Timed out" in got["msg"], got["msg"]  # the backend's message is kept
            assert timeout <= got["took"] + 0.1 and got["took"] <= timeout + SLACK, (
                f"{name} rank {r}: {got['took']:.2f} s"
            )
            print(
                f"\nstall, {name}: rank {r} raised CollectiveError({op}) after {got['took']:.2f} s (timeout {timeout:g} s)"
            )
    # the launcher: a peer's CollectiveError, its message, and the stalled rank among those killed
    err = str(error)
    assert error.rank in range(P - 1), err
    assert f"treeattn all_gather failed on rank {error.rank} of {P} (caller: tree_decode" in err, err
    assert "CollectiveError" in err and f"rank(s) [{P - 1}] still running" in err, err
    print(
        f"stall: launch() raised LaunchError {total:.1f} s after it started (incl. ~{SUB_TIMEOUT * 2 + 2:g} s of sub-group stalls)"
    )


# ---------------------------------------------------------------------------------------
# a rank killed mid-step


def _kill_in_local_attention(outdir: str):
    def make(orig):
        def die(*a, **kw):
            time.sleep(0.3)  # the peers are inside the reduction / the ring by now
            Path(outdir, "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        return die

    return make


def kill_worker(kind: str, outdir: str) -> None:
    import treeattn
    import treeattn.parallel.ring as ring_mod
    import treeattn.parallel.tree as tree_mod
    from treeattn.comm.collectives import CollectiveError

    rank = dist.get_rank()
    q, k, v = _data(rank)
    mod, fn, call = (  # the ring posts its transfer before its own block's attention: die before the post
        (tree_mod, "attention_state", lambda: treeattn.tree_decode(q, k, v, strategy="allgather"))
        if kind == "tree"
        else (ring_mod, "sendrecv", lambda: treeattn.ring_decode(q, k, v))
    )
    call()  # one good step first
    if rank == 1:
        with _patched(mod, fn, _kill_in_local_attention(outdir)):
            call()
    try:
        call()
    except CollectiveError as e:
        _write(outdir, f"rank{rank}", {"at": time.time(), "op": e.op, "caller": e.caller, "msg": str(e)})
        raise
    time.sleep(60)  # not reached: the peers' step fails (the launcher would kill us anyway)


@pytest.mark.parametrize("kind,op", [("tree", "all_gather"), ("ring", "send-recv")])
def test_killed_rank_is_named_and_survivors_stopped(kind, op, tmp_path, launch_dirs):
    with no_orphans(P), pytest.raises(LaunchError) as ei:
        launch(kill_worker, P, (kind, str(tmp_path)), timeout=120, collective_timeout=60, grace=2)
    done = time.time()
    killed_at = float((tmp_path / "killed_at").read_text())
    took = done - killed_at
    assert took < 30, took
    err = str(ei.value)
    assert ei.value.rank == 1 and f"rank 1 of {P} failed (exit code -9 (SIGKILL)" in err, err
    assert "out of memory?" in err, err  # the likeliest cause of a SIGKILL nobody sent by hand
    print(f"\nSIGKILL mid-{kind}: LaunchError {took:.2f} s after the kill (collective timeout 60 s)")
    for r in set(range(P)) - {1}:  # the survivors saw a broken connection at once, not a timeout
        f = tmp_path / f"rank{r}.json"
        if f.exists():
            rec = json.loads(f.read_text())
            assert rec["op"] == op and f"treeattn {op} failed on rank {r} of {P}" in rec["msg"], rec
            print(
                f"SIGKILL mid-{kind}: rank {r} raised CollectiveError({op}) {rec['at'] - killed_at:.2f} s after the kill"
            )
    assert "CollectiveError" in ei.value.details, ei.value.details  # a survivor's error is shown too


# ---------------------------------------------------------------------------------------
# success leaves nothing behind either


def ok_worker() -> None:
    assert dist.get_world_size() == 1


def test_temp_dir_removed_after_success(launch_dirs):
    with no_orphans(1):
        launch(ok_worker, 1, timeout=60)
    assert len(launch_dirs) == 1


def test_hierarchical_groups_keep_the_collective_timeout(stall_run):
    """The intra-/inter-node groups of the hierarchical strategy inherit the parent group's
    timeout (not torch's 30-minute default), so a stall inside hierarchical fails as fast."""
    _, _, recs = stall_run
    for r in range(P):
        assert recs[r]["node group timeouts"] == [COLLECTIVE_TIMEOUT] * 2, recs[r]["node group timeouts"]
