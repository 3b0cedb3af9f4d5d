"""Fixtures shared by several test files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module: on a shared CPU, more threads make these small ops much slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _main_module_restored():
    """Streamlit's AppTest replaces sys.modules["__main__"] with its script's module and leaves it there; a later
    test that spawns processes (torch.multiprocessing.spawn re-imports __main__ from its file) then runs that
    script in the child and fails. Every test leaves __main__ as it found it."""
    main = sys.modules.get("__main__")
    yield
    if main is not None and sys.modules.get("__main__") is not main:
        sys.modules["__main__"] = main


@pytest.fixture()
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own state folder (the app's record key, local Ray records)."""
    d = tmp_path / "state"
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(d))
    return d
