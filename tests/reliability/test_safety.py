"""Safety by default: nothing in the package unpickles data from peers or loads pickled files,
no remote code is trusted, only the entry points create process groups, and the launcher
rendezvouses through a file (no port) with gloo bound to the loopback interface.

Every check is also run against a bad snippet / a socket bound to every interface, to show
that it can fail.
"""

from __future__ import annotations

import ast
import json
import os
import socket
from pathlib import Path

import pytest
import torch.distributed as dist

import treeattn
from treeattn.launch import launch

PACKAGE = Path(treeattn.__file__).parent
OBJECT_COLLECTIVES = {
    "all_gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "gather_object",
    "send_object_list",
    "recv_object_list",
}
PICKLERS = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve", "marshal"}
# the command-line entry points may create a process group; library code never does
MAY_INIT = {"launch.py", "cli/model.py"}


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def scan(source: str, relpath: str) -> list[str]:
    """Violations of the safety rules in one module's source (``relpath`` relative to the package)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        where = f"{relpath}:{getattr(node, 'lineno', '?')}"
        # object collectives: by attribute (dist.all_gather_object), name, import or string (getattr)
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        if name in OBJECT_COLLECTIVES:
            bad.append(f"{where}: object collective {name} (unpickles data from peers)")
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for m in mods:
                if m.split(".")[0] in PICKLERS:
                    bad.append(f"{where}: imports {m}")
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name in OBJECT_COLLECTIVES:
                        bad.append(f"{where}: imports object collective {a.name}")
                    if (node.module or "").split(".")[0] == "torch" and a.name == "load":
                        bad.append(f"{where}: imports torch.load (call it as torch.load(..., weights_only=True))")
        if isinstance(node, ast.Call):
            kw = {k.arg: k.value for k in node.keywords}
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if fname == "load" and owner == "torch" and not _is_true(kw.get("weights_only")):
                bad.append(f"{where}: torch.load without weights_only=True")
            if _is_true(kw.get("trust_remote_code")):
                bad.append(f"{where}: trust_remote_code=True")
            if _is_true(kw.get("allow_pickle")):
                bad.append(f"{where}: allow_pickle=True")
            if fname == "init_process_group" and relpath not in MAY_INIT:
                bad.append(f"{where}: init_process_group in library code (only {sorted(MAY_INIT)} may)")
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = node.args
            pos = a.posonlyargs + a.args
            pairs = list(zip(pos[len(pos) - len(a.defaults) :], a.defaults, strict=True))
            pairs += [(x, d) for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
            for arg, default in pairs:
                if arg.arg == "trust_remote_code" and _is_true(default):
                    bad.append(f"{where}: trust_remote_code defaults to True")
    return bad


def package_sources() -> dict[str, str]:
    return {p.relative_to(PACKAGE).as_posix(): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_package_passes_the_scan():
    sources = package_sources()
    assert len(sources) > 20 and "comm/collectives.py" in sources and "launch.py" in sources
    bad = [v for rel, src in sources.items() for v in scan(src, rel)]
    assert not bad, "\n".join(bad)


BAD_SNIPPETS = [
    ("comm/x.py", "import torch.distributed as dist\ndist.all_gather_object(out, obj)\n", "object collective"),
    ("comm/x.py", "from torch.distributed import broadcast_object_list\n", "object collective"),
    ("comm/x.py", "torch.distributed.scatter_object_list(a, b, src=0)\n", "scatter_object_list"),
    ("comm/x.py", "dist.gather_object(o, lst)\n", "gather_object"),
    ("comm/x.py", "dist.send_object_list([o], dst=1)\n", "send_object_list"),
    ("comm/x.py", "dist.recv_object_list(lst, src=0)\n", "recv_object_list"),
    ("comm/x.py", "f = getattr(dist, 'all_gather_object')\n", "all_gather_object"),
    ("ops/x.py", "import pickle\n", "imports pickle"),
    ("ops/x.py", "from pickle import loads\n", "imports pickle"),
    ("ops/x.py", "import cloudpickle as cp\n", "imports cloudpickle"),
    ("ops/x.py", "import dill\n", "imports dill"),
    ("hf/x.py", "import torch\nsd = torch.load(path)\n", "torch.load without weights_only=True"),
    ("hf/x.py", "import torch\nsd = torch.load(path, weights_only=False)\n", "torch.load without"),
    ("hf/x.py", "from torch import load\n", "imports torch.load"),
    ("hf/x.py", "np.load(path, allow_pickle=True)\n", "allow_pickle=True"),
    ("hf/x.py", "AutoModel.from_pretrained(path, trust_remote_code=True)\n", "trust_remote_code=True"),
    ("hf/x.py", "def build(path, trust_remote_code=True):\n    pass\n", "defaults to True"),
    ("hf/x.py", "def build(path, *, trust_remote_code: bool = True):\n    pass\n", "defaults to True"),
    ("parallel/x.py", "dist.init_process_group('gloo')\n", "init_process_group in library code"),
    ("bench/latency.py", "torch.distributed.init_process_group(backend='gloo')\n", "init_process_group"),
]


@pytest.mark.parametrize("relpath,source,expect", BAD_SNIPPETS, ids=[f"{i}" for i in range(len(BAD_SNIPPETS))])
def test_scanner_catches(relpath, source, expect):
    found = scan(source, relpath)
    assert any(expect in v for v in found), f"{source!r}: {found}"


def test_scanner_allows_the_safe_forms():
    ok = (
        "import torch\nimport torch.distributed as dist\n"
        "sd = torch.load(path, weights_only=True)\n"
        "m = AutoModel.from_pretrained(p, trust_remote_code=False, use_safetensors=True)\n"
        "def build(path, trust_remote_code=False):\n    pass\n"
        "dist.all_gather_into_tensor(out, t)\n"
    )
    assert scan(ok, "hf/x.py") == []
    assert scan("dist.init_process_group('gloo')\n", "launch.py") == []  # an entry point may


# ---------------------------------------------------------------------------------------
# the launcher's network exposure


def listening_addresses(pid: int | str = "self") -> list[tuple[str, int]]:
    """(address, port) of every TCP socket of process ``pid`` in the LISTEN state."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for fam in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{fam}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                hexaddr, port = f[1].split(":")
                raw = bytes.fromhex(hexaddr)
                if fam == "tcp":
                    addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:  # four little-endian 32-bit words
                    addr = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
                out.append((addr, int(port, 16)))
    return out


def _loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "::ffff:127.0.0.1")


def exposure_worker(outdir: str) -> None:
    from torch.distributed import distributed_c10d as c10d

    store, chain = c10d._get_default_store(), []
    while store is not None:
        chain.append(type(store).__name__)
        store = getattr(store, "underlying_store", None)
    dist.barrier()  # gloo's connections are up
    info = {
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR"),
        "MASTER_PORT": os.environ.get("MASTER_PORT"),
        "store": chain,
        "listening": listening_addresses(),
    }
    Path(outdir, f"rank{dist.get_rank()}.json").write_text(json.dumps(info))


def test_launch_binds_loopback_and_rendezvous_through_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # the default, not the caller's choice
    launch(exposure_worker, 1, (str(tmp_path),), timeout=60)
    info = json.loads((tmp_path / "rank0.json").read_text())
    assert info["GLOO_SOCKET_IFNAME"] == "lo", info
    assert info["store"][-1] == "FileStore" and "TCPStore" not in info["store"], info
    assert info["MASTER_ADDR"] is None and info["MASTER_PORT"] is None, info
    assert info["listening"], "gloo opened no listening socket? the check below would be vacuous"
    exposed = [a for a in info["listening"] if not _loopback(a[0])]
    assert not exposed, f"a rank listens beyond loopback: {exposed}"


def test_exposure_check_can_fail():
    """A socket bound to every interface is reported by the same check."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        found = [a for a in listening_addresses() if a[1] == port]
        assert found == [("0.0.0.0", port)]
        assert not _loopback(found[0][0])
