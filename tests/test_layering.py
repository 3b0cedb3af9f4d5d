"""The import direction of ARCHITECTURE.md, enforced over the real import graph.

costmodel <- policies <- twin / runner <- ui. costmodel imports nothing of ours; policies imports
no twin/runner/ui and no simpy/torch; twin imports neither runner nor torch; runner imports neither
twin nor simpy. Every module under each folder is parsed (ast), so an import hidden inside a
function counts too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("costmodel", "policies", "twin", "runner", "ui")

# package -> names it must never import (ours are given as mixfleet.<pkg>)
FORBIDDEN: dict[str, set[str]] = {
    "costmodel": {"mixfleet.policies", "mixfleet.twin", "mixfleet.runner", "mixfleet.ui", "torch", "simpy"},
    "policies": {"mixfleet.twin", "mixfleet.runner", "mixfleet.ui", "simpy", "torch"},
    "twin": {"mixfleet.runner", "mixfleet.ui", "torch"},
    "runner": {"mixfleet.twin", "mixfleet.ui", "simpy"},
    "ui": set(),
}


def imported_names(path: Path) -> set[str]:
    """Absolute module names imported anywhere in a file (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = path.relative_to(ROOT).parts[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x  -> mixfleet.<pkg>
                names.add(f"mixfleet.{pkg}" + (f".{node.module}" if node.module else ""))
            elif node.module:
                names.add(node.module)
                if node.module == "mixfleet":
                    names.update(f"mixfleet.{a.name}" for a in node.names)
    return names


def violations(pkg: str) -> list[str]:
    found = []
    for path in sorted((ROOT / pkg).rglob("*.py")):
        for name in imported_names(path):
            for bad in FORBIDDEN[pkg]:
                if name == bad or name.startswith(bad + "."):
                    found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("pkg", LAYERS)
def test_imports_follow_the_layers(pkg: str) -> None:
    assert (ROOT / pkg).is_dir()
    assert violations(pkg) == []


def test_the_checker_catches_a_violation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bad import in each layer is reported (so the test above can fail)."""
    fake_root = tmp_path
    for i, (pkg, bad) in enumerate((("costmodel", "mixfleet.twin"), ("policies", "simpy"), ("twin", "torch.nn"),
                                    ("runner", "simpy"), ("policies", "mixfleet.runner.engine"))):
        d = fake_root / pkg
        d.mkdir(exist_ok=True)
        (d / f"bad{i}.py").write_text(f"def f():\n    import {bad}\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    assert violations("costmodel") and violations("twin") and violations("runner")
    assert len(violations("policies")) == 2
