"""Cost profiles: a cluster's fitted constants in a small JSON file, and which model ``auto`` uses.

A profile (written by ``treeattn simulate --calibrate ... --profile-out PATH``) holds the
alpha/beta of each link level, the attention bandwidth and efficiency, the layout, the
machine and git commit it was fitted on, and a format version::

    {"format": "treeattn-cost-profile", "format_version": 1, "name": "...",
     "levels": {"intra": {"alpha": 5e-05, "beta": 2.7e9}, "inter": {...}, "p2p": {...}},
     "collective_alpha": 2e-4, "attention": {"mem_bw": 1e10, "efficiency": 0.6, "alpha": 5e-5},
     "topology": {"nodes": 1, "devices_per_node": 64, "compute_slots": 2},
     "algorithms": {"allreduce": "ring", "allgather": "ring"},
     "fitted_on": {"hostname": "...", "cpu": "...", "git_commit": "...", "date": "..."}, ...}

Times in seconds, bandwidths in bytes/second.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model import Cluster
from .presets import default_cluster

FORMAT = "treeattn-cost-profile"
FORMAT_VERSION = 1
ENV_VAR = "TREEATTN_PROFILE"


class ProfileError(ValueError):
    """A cost profile that cannot be read: names the file and the field."""


# (json path, Cluster field, kind); kinds: pos (> 0), nonneg (>= 0), "?..." (may be null), int, str, choice
_SCHEMA: tuple[tuple[str, str, str], ...] = (
    ("levels.intra.alpha", "intra_alpha", "nonneg"),
    ("levels.intra.beta", "intra_beta", "pos"),
    ("levels.inter.alpha", "inter_alpha", "nonneg"),
    ("levels.inter.beta", "inter_beta", "pos"),
    ("levels.p2p.alpha", "p2p_alpha", "?nonneg"),
    ("levels.p2p.beta", "p2p_beta", "?pos"),
    ("collective_alpha", "collective_alpha", "nonneg"),
    ("attention.mem_bw", "device_mem_bw", "pos"),
    ("attention.efficiency", "attn_efficiency", "pos"),
    ("attention.alpha", "attn_alpha", "nonneg"),
    ("topology.nodes", "nodes", "int1"),
    ("topology.devices_per_node", "devices_per_node", "int1"),
    ("topology.compute_slots", "compute_slots", "int0"),
    ("algorithms.allreduce", "allreduce_algo", "ring|tree|auto"),
    ("algorithms.allgather", "allgather_algo", "ring|rd|auto"),
    ("device_mem", "device_mem", "?pos"),
)


@dataclass(frozen=True)
class Profile:
    """A loaded profile: ``cluster`` (the constants), where it came from and what it was fitted on."""

    cluster: Cluster
    path: str | None = None
    fitted_on: dict[str, Any] = field(default_factory=dict)
    fit: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        host = self.fitted_on.get("hostname") or "?"
        commit = (self.fitted_on.get("git_commit") or "?")[:10]
        return f"profile {self.path} ({self.cluster.name!r}, fitted on {host} at commit {commit})"


def git_commit() -> str | None:
    """The commit of the treeattn source tree, or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def machine() -> dict[str, Any]:
    """Hostname, CPU model and usable cores of this machine."""
    cpu = platform.processor() or "unknown"
    try:
        cpu = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text()).group(1)
    except (OSError, AttributeError):
        pass
    return {"hostname": platform.node(), "cpu": cpu, "cores": os.cpu_count()}


def to_dict(cluster: Cluster, fitted_on: dict[str, Any] | None = None, fit: dict[str, Any] | None = None) -> dict:
    """The JSON document of ``cluster``; ``fitted_on`` defaults to this machine and commit, now."""
    doc: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION, "name": cluster.name}
    for path, attr, _ in _SCHEMA:
        *parents, leaf = path.split(".")
        d = doc
        for k in parents:
            d = d.setdefault(k, {})
        d[leaf] = getattr(cluster, attr)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    doc["fitted_on"] = fitted_on if fitted_on is not None else {**machine(), "git_commit": git_commit(), "date": now}
    doc["fit"] = fit or {}
    doc["notes"] = cluster.notes
    return doc


def save_profile(path: str | os.PathLike, cluster: Cluster, *, fit: dict[str, Any] | None = None) -> Path:
    """Write ``cluster`` as a profile (see the module doc), fitted on this machine and commit."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(to_dict(cluster, fit=fit), indent=1) + "\n")
    return p


def _field(doc: dict, path: str, kind: str, where: str) -> Any:
    d: Any = doc
    for k in path.split("."):
        if not isinstance(d, dict) or k not in d:
            raise ProfileError(f"cost profile {where}: missing field {path!r}")
        d = d[k]
    if kind.startswith("?"):
        if d is None:
            return None
        kind = kind[1:]
    if "|" in kind:
        if d not in kind.split("|"):
            raise ProfileError(f"cost profile {where}: field {path!r} must be one of {kind.split('|')}, got {d!r}")
        return d
    if kind.startswith("int"):
        if not isinstance(d, int) or isinstance(d, bool) or d < int(kind[3:]):
            raise ProfileError(f"cost profile {where}: field {path!r} must be an integer >= {kind[3:]}, got {d!r}")
        return d
    ok = isinstance(d, int | float) and not isinstance(d, bool) and d == d and d != float("inf")
    if not ok or (kind == "pos" and d <= 0) or d < 0:
        want = "a number > 0" if kind == "pos" else "a number >= 0"
        raise ProfileError(f"cost profile {where}: field {path!r} must be {want}, got {d!r}")
    return float(d)


def from_dict(doc: Any, where: str = "<dict>") -> Profile:
    """Validate a profile document; :class:`ProfileError` names ``where`` and the bad field."""
    if not isinstance(doc, dict):
        raise ProfileError(f"cost profile {where}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise ProfileError(f"cost profile {where}: field 'format' must be {FORMAT!r}, got {doc.get('format')!r}")
    if doc.get("format_version") != FORMAT_VERSION:
        raise ProfileError(
            f"cost profile {where}: field 'format_version' {doc.get('format_version')!r} is not supported "
            f"(this treeattn reads version {FORMAT_VERSION})"
        )
    kw = {attr: _field(doc, path, kind, where) for path, attr, kind in _SCHEMA}
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise ProfileError(f"cost profile {where}: field 'name' must be a non-empty string, got {name!r}")
    fitted_on = doc.get("fitted_on", {})
    if not isinstance(fitted_on, dict):
        raise ProfileError(f"cost profile {where}: field 'fitted_on' must be an object, got {fitted_on!r}")
    try:
        cluster = Cluster(name=name, notes=str(doc.get("notes") or ""), **kw)
    except ValueError as e:
        raise ProfileError(f"cost profile {where}: {e}") from None
    fit = doc.get("fit") if isinstance(doc.get("fit"), dict) else {}
    return Profile(cluster, where, fitted_on, fit)


def load_profile(path: str | os.PathLike) -> Profile:
    """Read and validate a profile file.

    Raises:
        ProfileError (a ValueError): the file is absent/unreadable, not JSON, or a field is
            missing or malformed; the message names the file and the field.
    """
    where = os.fspath(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ProfileError(f"cost profile {where}: cannot read it ({e.strerror or e})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"cost profile {where}: not valid JSON ({e})") from None
    return from_dict(doc, where)


_CACHE: dict[tuple, Profile] = {}


def _cached(path: str) -> Profile:
    try:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
    except OSError:
        return load_profile(path)  # raises with the file's name
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = load_profile(path)
    return _CACHE[key]


def resolve(model: Any = None, backend: str | None = None) -> tuple[Cluster, str]:
    """The cluster ``auto`` decides with, and a description of where it came from.

    ``model``: a :class:`Cluster`, a :class:`Profile`, a profile path, or None: the file named
    by ``$TREEATTN_PROFILE`` if set, else the built-in preset for ``backend``
    (:func:`~treeattn.cost.presets.default_cluster`). Files are re-read only when they change.
    """
    if isinstance(model, Cluster):
        return model, f"cluster {model.name!r}"
    if isinstance(model, Profile):
        return model.cluster, model.describe()
    if model is None:
        env = os.environ.get(ENV_VAR, "").strip()
        if not env:
            c = default_cluster(backend)
            return c, f"built-in preset {c.name!r}"
        prof = _cached(env)
        return prof.cluster, f"{prof.describe()} from ${ENV_VAR}"
    if isinstance(model, str | os.PathLike):
        prof = _cached(os.fspath(model))
        return prof.cluster, prof.describe()
    raise TypeError(f"profile must be a path, a Cluster, a Profile or None, got {type(model).__name__}")
