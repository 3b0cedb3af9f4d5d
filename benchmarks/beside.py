"""Another commit of this repository, built beside this tree, for benchmarks that compare the two in one session.

`build(rev, where)` clones this repository at `rev` into `where`, installs it editable (its compiled core built)
in its own virtual environment that sees this Python's packages, and returns the folder of its executables
(`mixfleet`, `python`). Used by planner_speed.py (--beside) and same_results.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def head(root: Path = ROOT) -> str:
    """The commit checked out at `root`, with "+dirty" when tracked files differ from it."""
    rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return rev + ("+dirty" if dirty else "")


def build(rev: str, where: Path) -> Path:
    """`rev` cloned into `where` and installed in `where/.venv`; returns `where/.venv/bin`."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], check=True)
    subprocess.run(["git", "-C", str(where), "checkout", "-q", rev], check=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(where / ".venv")], check=True)
    pip = [str(where / ".venv" / "bin" / "python"), "-m", "pip", "-q"]
    # the venv's own setuptools may predate bdist_wheel support for editable installs: use this Python's
    subprocess.run([*pip, "uninstall", "-y", "setuptools"], check=False, capture_output=True)
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", "-e", str(where)], check=True)
    return where / ".venv" / "bin"
