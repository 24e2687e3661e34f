"""No module of treeattn imports a private name (or a private module) of another of its
packages: what a package offers the others is public (``treeattn.ops`` re-exports its
kernels' entry points). The root's own private modules (``treeattn._host``,
``treeattn._argtypes``) are the bottom layer every package shares (import-linter's contract
in pyproject.toml) and are allowed."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "treeattn"


def _module(path: Path, root: Path) -> list[str]:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def offences(root: Path = SRC) -> list[str]:
    """``file:line: what`` for every import of another package's private name or module."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        here = _module(path, root)
        pkg = here[:2] if len(here) > 1 else here  # treeattn.<package>
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here if is_pkg else here[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = base + (node.module.split(".") if node.module else [])
                else:
                    target = (node.module or "").split(".")
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                target, names = None, []
                for a in node.names:
                    if a.name.startswith("treeattn."):
                        target = a.name.split(".")
            else:
                continue
            if not target or target[0] != "treeattn" or target[:2] == pkg or len(target) < 2:
                continue
            if len(target) == 2 and target[1] in ("_host", "_argtypes"):
                continue  # the root's shared bottom layer
            private = [x for x in target[2:] if x.startswith("_") and not x.startswith("__")]
            private += [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                bad.append(f"{path.relative_to(root.parent)}:{node.lineno}: {'.'.join(target)} {private}")
    return bad


def test_no_private_name_of_another_package_is_imported():
    assert offences() == []


def test_the_check_sees_an_offence(tmp_path):
    pkg = tmp_path / "treeattn"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    for f in ("__init__.py", "a/__init__.py", "b/__init__.py", "a/_k.py"):
        (pkg / f).write_text("")
    (pkg / "b" / "m.py").write_text("from ..a._k import f\nfrom ..a import _g\nfrom .x import _ok\n")
    got = offences(pkg)
    assert len(got) == 2 and "treeattn.a._k ['_k']" in got[0] and "['_g']" in got[1], got
