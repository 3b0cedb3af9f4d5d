"""Fixtures shared by several test files."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# Files whose tests share a session fixture's real runs: one xdist group, so one worker starts those runs once.
SHARED_RUNS = {"test_run_resume.py": "killed_resumed_run", "test_fidelity_resume.py": "killed_resumed_run"}


# The groups that take longest (a file's tests and its module fixtures' runs together), longest first: xdist hands
# groups out in collection order (pyproject: --no-loadscope-reorder), so these start at once and the many short
# files fill the workers' ends (longest-first scheduling), instead of a 5-minute file starting last. The groups of
# >= 14 s in a `-n 2 --durations=0` run on a quiet machine (2026-12-07, summed per group by
# benchmarks/suite_durations.py; benchmarks/results/suite_durations.json is a later run's); the rest keep their order.
SLOWEST_FIRST = ("test_ui_browser.py", "test_run_crash_points.py", "test_run_resume_recovery.py", "killed_resumed_run",
                 "test_run_group_start.py", "test_ablation.py", "test_local_ray.py", "test_launcher.py",
                 "test_run_faults.py", "test_rehearsal.py", "test_learning_guard.py", "test_run_cluster.py",
                 "test_evaluate_run.py", "test_ui_plan_calibration.py", "test_studies_replan.py", "test_run_attach.py",
                 "test_run_moe.py", "test_validate_user_path.py", "test_export_trackers.py", "test_ui_apptest.py",
                 "test_learning.py", "test_sandbox.py", "test_planner_ray.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `pytest -n N` (pyproject: --dist loadgroup) every test file is one group, as --dist loadfile would
    make it (its module fixtures' runs start once), and the files of SHARED_RUNS share a group; the groups of
    SLOWEST_FIRST come first. Runs before xdist's own hook (in each worker) reads the groups; without -n the marks
    do nothing (and the order changes nothing)."""
    if not config.pluginmanager.hasplugin("xdist"):   # the marker is xdist's
        return
    rank = {group: i for i, group in enumerate(SLOWEST_FIRST)}
    groups = {item.nodeid: SHARED_RUNS.get(item.path.name, item.path.name) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    items.sort(key=lambda item: rank.get(groups[item.nodeid], len(rank)))    # stable: the rest keep their order


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


@pytest.fixture(scope="session")
def killed_resumed_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real run of tests/test_run_resume.py's plan (its child, tests/run_child.py), read by test_run_resume.py
    and test_fidelity_resume.py, which each started their own before (5 process starts, now 3; issue 43):
    started for 4 updates and SIGKILLed after update 2 ("killed"), resumed to 4 ("resumed": the folder as it was
    then is kept in "resumed_copy"), then continued to 5 ("continued", in "out"). Each step is kept as (its exit
    code, None when killed; its stdout lines; its stderr's end), and orchestrator.json after the kill and after
    the resume ("killed_state", "resumed_state"): the tests check them, nothing is checked here."""
    from runplans import run_files
    from test_run_resume import PLAN, _run, _state

    root = tmp_path_factory.mktemp("killed-resumed")
    init, plan = run_files(root, PLAN)
    out = root / "out"
    runs: dict[str, Any] = {"out": out, "resumed_copy": root / "resumed-copy"}

    def step(name: str, argv: list[str], **kw: Any) -> None:
        code, lines = _run([str(plan), str(out), str(init), *argv], root, name, **kw)
        runs[name] = (code, lines, (root / f"{name}.err").read_text()[-2000:])

    step("killed", ["4"], kill_after=2)
    runs["killed_state"] = _state(out) if (out / "trainer_state").exists() else None
    step("resumed", ["4", "--resume"])
    runs["resumed_state"] = _state(out) if (out / "trainer_state").exists() else None
    shutil.copytree(out, runs["resumed_copy"], symlinks=True)
    step("continued", ["5", "--resume"])
    return runs


def _load_script(name: str) -> Any:
    """benchmarks/NAME.py as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" /
                                                  f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod                # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def benchmark_script() -> Any:
    """A loader of benchmarks/ scripts: `benchmark_script("learning")` is benchmarks/learning.py as a module."""
    return _load_script
