"""A `treeattn serve` subprocess for tests: start, plain-HTTP calls, server-sent events, the
process tree."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from procs import _is_tracker


def descendants(pid: int) -> set[int]:
    """Live (non-zombie) processes below ``pid``."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                state, ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if state != "Z":
                kids.setdefault(int(ppid), []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pids) -> set[int]:
    out = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(p)
    return out


def _json(data: bytes) -> dict:
    """A response body as JSON; one that is not (a bare 500 page) as ``{"raw": text}``."""
    try:
        return json.loads(data)
    except ValueError:
        return {"raw": data.decode(errors="replace")}


class Server:
    """``python -m treeattn serve ARGS --port 0``; ``url`` once its status line says where it listens."""

    def __init__(self, *args: str, timeout: float = 600.0, api_key: str | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "treeattn", "serve", "--port", "0", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
        self.api_key = api_key
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(r"listening on (http://[\d.]+:\d+)", self.output())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not start:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def ranks(self) -> list[int]:
        """The rank processes, in start order (rank 0 first)."""
        return sorted(p for p in descendants(self.proc.pid) if not _is_tracker(p))

    def request(self, method: str, path: str, body=None, *, raw: bytes | None = None, key: str | None = "default",
                timeout: float = 600.0) -> tuple[int, dict]:  # fmt: skip
        """(status, JSON body) of one plain-HTTP call."""
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        key = self.api_key if key == "default" else key
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, _json(r.read())
        except urllib.error.HTTPError as e:
            return e.code, _json(e.read())

    def events(self, path: str, body: dict, timeout: float = 600.0):
        """The ``data:`` payloads of a streamed call, as they arrive (``[DONE]`` as a str)."""
        req = urllib.request.Request(self.url + path, data=json.dumps({**body, "stream": True}).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        r = urllib.request.urlopen(req, timeout=timeout)
        try:
            for line in r:
                line = line.decode().rstrip("\n")
                if line.startswith("data: "):
                    d = line[6:]
                    yield d if d == "[DONE]" else json.loads(d)
        finally:
            r.close()

    def stop(self, sig=signal.SIGINT, timeout: float = 30.0) -> tuple[int | None, float, set[int]]:
        """Send ``sig``; (exit code, seconds to exit, processes left behind)."""
        tree = descendants(self.proc.pid)
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        dt = time.monotonic() - t0
        left = alive(tree)
        while left and time.monotonic() - t0 < timeout:
            time.sleep(0.1)
            left = alive(tree)
        return self.proc.poll(), dt, left

    def kill(self) -> None:
        for p in descendants(self.proc.pid) | {self.proc.pid}:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
