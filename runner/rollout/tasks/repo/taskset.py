"""Bring your own repository tasks: a task-set folder loaded by the `repo` task's `task_set` option.

Format (docs/tasks.md): one folder per task, in a task-set folder; tasks are taken in sorted folder-name order
and seed s plays task s % count (train and eval seeds alike: a task set has no held-out split of its own; keep
a second folder for held-out tasks).

    TASKSET/
      fix-clamp/
        task.toml       test_command = "python3 -m unittest -q"    (required: a bash command, exit 0 = pass)
                        setup_command = "..."                      (optional: run before the episode's first
                                                                    command and before the tests on submit)
                        test_files = ["test_lib.py"]               (optional: relpaths whose edits do not count;
                                                                    default: every test_*.py / *_test.py and
                                                                    everything under tests/)
        issue.md        the issue as the user reports it (the first user message)
        repo/           the repository's files (the sandbox's /work/repo)

A malformed task raises TaskSetError with one line naming the task folder, the field and the value.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MAX_ISSUE_BYTES = 2000
MAX_REPO_FILES = 200
TASK_FIELDS = ("test_command", "setup_command", "test_files")


class TaskSetError(ValueError):
    """A task set that cannot be loaded; the message names the task folder, the field and the value."""


@dataclass(frozen=True, kw_only=True)
class RepoSpec:
    """One repository task, generated or loaded: what RepoTask needs to run an episode."""

    name: str                              # task folder name, or "gen-<seed>"
    files: dict[str, str]                  # relpath -> content
    issue: str
    test_command: str
    setup_command: str = ""
    test_files: tuple[str, ...] = ()       # relpaths whose edits a submission drops (empty: is_test_path)


def is_test_path(rel: str) -> bool:
    """The default test-file rule: test_*.py, *_test.py, or anything under a tests/ folder."""
    p = PurePosixPath(rel)
    return p.name.startswith("test_") and p.suffix == ".py" or p.name.endswith("_test.py") or "tests" in p.parts[:-1]


def _bad(task: Path, field: str, value: object, allowed: str) -> TaskSetError:
    return TaskSetError(f"task set: task {task.name!r}: {field} = {value!r}; allowed: {allowed}")


def load_task(folder: Path) -> RepoSpec:
    """One task folder (see the module docstring); TaskSetError names the folder, field and value."""
    toml_path, issue_path, repo = folder / "task.toml", folder / "issue.md", folder / "repo"
    if not toml_path.is_file():
        raise _bad(folder, "task.toml", str(toml_path), "a task.toml file in the task folder")
    try:
        raw = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise _bad(folder, "task.toml", str(e), "valid TOML") from None
    for key in raw:
        if key not in TASK_FIELDS:
            raise _bad(folder, key, raw[key], "one of the fields " + ", ".join(TASK_FIELDS))
    test_command = raw.get("test_command")
    if not isinstance(test_command, str) or not test_command.strip():
        raise _bad(folder, "test_command", test_command, "a non-empty bash command string")
    setup = raw.get("setup_command", "")
    if not isinstance(setup, str):
        raise _bad(folder, "setup_command", setup, "a bash command string")
    if not issue_path.is_file():
        raise _bad(folder, "issue.md", str(issue_path), "an issue.md file in the task folder")
    issue = issue_path.read_text(encoding="utf-8").strip()
    if not issue or len(issue.encode()) > MAX_ISSUE_BYTES:
        raise _bad(folder, "issue.md", f"{len(issue.encode())} bytes", f"1..{MAX_ISSUE_BYTES} bytes of text")
    if not repo.is_dir():
        raise _bad(folder, "repo", str(repo), "a repo/ folder with the repository's files")
    files: dict[str, str] = {}
    for path in sorted(repo.rglob("*")):
        if path.is_symlink():
            raise _bad(folder, "repo", str(path.relative_to(folder)), "plain files and folders (no links)")
        if path.is_file():
            rel = path.relative_to(repo).as_posix()
            try:
                files[rel] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise _bad(folder, "repo", rel, "UTF-8 text files") from None
    if not files or len(files) > MAX_REPO_FILES:
        raise _bad(folder, "repo", f"{len(files)} files", f"1..{MAX_REPO_FILES} files")
    test_files = raw.get("test_files")
    if test_files is None:
        tests = tuple(rel for rel in files if is_test_path(rel))
    else:
        if not isinstance(test_files, list) or not all(isinstance(t, str) and t in files for t in test_files):
            raise _bad(folder, "test_files", test_files, "a list of relpaths of files under repo/")
        tests = tuple(test_files)
    return RepoSpec(name=folder.name, files=files, issue=issue, test_command=test_command,
                    setup_command=setup, test_files=tests)


def load_task_set(root: str | Path) -> tuple[RepoSpec, ...]:
    """Every task folder of `root`, in sorted name order."""
    root = Path(root)
    if not root.is_dir():
        raise TaskSetError(f"task set: task_set = {str(root)!r}; allowed: a folder of task folders")
    tasks = tuple(load_task(p) for p in sorted(root.iterdir()) if p.is_dir())
    if not tasks:
        raise TaskSetError(f"task set: task_set = {str(root)!r} holds no task folder; allowed: a folder of task "
                           f"folders (each with task.toml, issue.md, repo/)")
    return tasks
