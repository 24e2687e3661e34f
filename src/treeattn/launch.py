"""Start p local ranks (gloo on loopback by default), run a function on each, and fail fast.

The rendezvous is a ``file://`` store in a private temporary directory, so no port is
opened for it; gloo's own connections bind to the loopback interface unless
``GLOO_SOCKET_IFNAME`` says otherwise. Nothing is unpickled from the ranks: a failing rank
writes its traceback as text, which the launcher reads and reports.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

__all__ = ["LaunchError", "launch", "torchrun_group", "under_torchrun"]


class LaunchError(RuntimeError):
    """A rank failed, died or the group timed out. ``rank`` is the first failing rank
    (None on a timeout) and ``details`` its traceback text when it left one."""

    def __init__(self, msg: str, rank: int | None = None, details: str = "") -> None:
        super().__init__(msg + (f"\n--- rank {rank} traceback ---\n{details}" if details else ""))
        self.rank = rank
        self.details = details


def _exit_code(code: int | None) -> str:
    """``exit code 1``, or ``exit code -9 (SIGKILL)`` for a rank ended by a signal."""
    if code is not None and code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def _first_failed(procs, errdir: str) -> tuple[int, int] | None:
    """(rank, exit code) of the failed rank to blame, or None. Several ranks may be seen
    dead at once: one that left no traceback (killed, crashed, ``os._exit``) caused the
    others' errors (they write one before exiting), so it comes first, then the lowest rank."""
    bad = [(r, pr.exitcode) for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
    bad.sort(key=lambda b: (os.path.exists(os.path.join(errdir, f"{b[0]}.txt")), b[0]))
    return bad[0] if bad else None


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank if the launching process dies (even by SIGKILL)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _entry(fn, rank, nproc, local_size, store, errdir, threads, backend, coll_timeout, env, args):
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank % local_size), LOCAL_WORLD_SIZE=str(local_size)
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    faulthandler.enable()  # a crash in native code still prints this rank's Python stack
    _die_with_parent()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=nproc,
            timeout=datetime.timedelta(seconds=coll_timeout),
        )
        fn(*args)
    except BaseException:
        # written before the group is torn down (by exiting), so the root cause's file is
        # older than the "connection closed" errors it causes on the peers
        Path(errdir, f"{rank}.txt").write_text(f"{time.monotonic_ns()}\n{traceback.format_exc()}")
        raise SystemExit(1) from None
    dist.destroy_process_group()
    # Skip interpreter finalization: tearing down torch/gloo's native threads in static
    # destructors at exit intermittently aborts ("terminate called without an active
    # exception", SIGSEGV) after the work has finished; the rank's result is already final.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(
    fn: Callable[..., object],
    nproc: int,
    args: Sequence = (),
    *,
    timeout: float = 600.0,
    collective_timeout: float = 120.0,
    threads: int = 1,
    backend: str = "gloo",
    ranks_per_node: int | None = None,
    env: dict[str, str] | None = None,
    grace: float = 5.0,
) -> None:
    """Run ``fn(*args)`` on ``nproc`` freshly spawned ranks with torch.distributed initialised.

    ``fn`` must be importable (module level). Each rank gets ``threads`` compute threads,
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (``ranks_per_node``, default
    ``nproc``) and a collective timeout of ``collective_timeout`` seconds. Returns when every
    rank exits 0. Raises :class:`LaunchError` naming the first failing rank (with its
    traceback) as soon as one fails — the others get ``grace`` seconds, then are killed (the
    message lists them: a rank that stalled is among them) — or when ``timeout`` seconds
    pass. A rank that died without a traceback (killed, crashed) is named with its exit
    code, e.g. ``exit code -9 (SIGKILL)``. No process outlives the call, and the temporary
    directory holding the file store is removed.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    local = ranks_per_node or nproc
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="treeattn-") as tmp:
        store, errdir = os.path.join(tmp, "store"), os.path.join(tmp, "err")
        os.mkdir(errdir)
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, nproc, local, store, errdir, threads, backend, collective_timeout, env or {}, tuple(args)),
                daemon=True,
            )
            for r in range(nproc)
        ]
        for pr in procs:
            pr.start()
        deadline = time.monotonic() + timeout
        failed: tuple[int, int] | None = None
        timed_out = False
        stopped: list[int] = []  # ranks still running at the deadline, killed by us
        try:
            while any(pr.exitcode is None for pr in procs):
                if failed is None:
                    failed = _first_failed(procs, errdir)
                    if failed is not None:
                        deadline = min(deadline, time.monotonic() + grace)
                if time.monotonic() > deadline:
                    timed_out = failed is None
                    stopped = [r for r, pr in enumerate(procs) if pr.exitcode is None]
                    break
                time.sleep(0.05)
        finally:
            for pr in procs:
                if pr.exitcode is None:
                    pr.kill()
                pr.join(5)
        if timed_out:
            raise LaunchError(f"timed out after {timeout:.0f} s; the ranks still running were killed")
        if failed is None:
            failed = _first_failed(procs, errdir)
        if failed is not None:
            errs = {int(f.stem): f.read_text().split("\n", 1) for f in Path(errdir).glob("*.txt")}
            if failed[0] not in errs:  # the first rank to die left no traceback: killed or crashed
                oom = " (out of memory? Linux's OOM killer sends SIGKILL: see dmesg)" if failed[1] == -9 else ""
                r, how, text = failed[0], f"{_exit_code(failed[1])}, killed or crashed without a traceback{oom}", ""
                if errs:
                    o = min(errs, key=lambda x: int(errs[x][0]))
                    text = f"(then rank {o} failed with:)\n{errs[o][1]}"
            else:  # the root cause wrote its traceback first
                r = min(errs, key=lambda x: int(errs[x][0]))
                how, text = _exit_code(procs[r].exitcode), errs[r][1]
            if stopped:  # a rank that neither finished nor failed may be the one that stalled
                how += f"; rank(s) {stopped} still running {grace:g} s later were killed"
            raise LaunchError(f"rank {r} of {nproc} failed ({how})", rank=r, details=text)


def under_torchrun() -> bool:
    """Whether this process is a torchrun rank whose process group is not set up yet."""
    import torch.distributed as dist

    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized()


@contextlib.contextmanager
def torchrun_group(backend: str, threads: int = 1, collective_timeout: float = 120.0) -> Iterator[None]:
    """Under torchrun: the process group from its environment, with ``threads`` compute threads
    and the same collective timeout :func:`launch` gives; destroyed on the way out, whatever
    happened (the CLIs' torchrun path, so it cannot drift from the launcher's)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=collective_timeout))
    try:
        yield
    finally:
        dist.destroy_process_group()
