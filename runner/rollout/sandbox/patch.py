"""Unified diffs of a work tree against its source, and applying them host-side, in Python (no `patch` run).

`tree_diff` writes what `apply_patch` reads: per changed text file `--- a/REL` / `+++ b/REL` (or /dev/null for a
file added or deleted) and difflib hunks with `\\ No newline at end of file` markers. Ignored on both sides:
`__pycache__` folders, `*.pyc` files and symlinks. A file that is not UTF-8 text is listed as
`Binary files a/REL and b/REL differ`, which apply_patch refuses (naming the file).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_NO_EOL = "\\ No newline at end of file"


def _files(root: Path) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__" and not os.path.islink(os.path.join(dirpath, d))]
        for n in filenames:
            full = os.path.join(dirpath, n)
            if n.endswith(".pyc") or os.path.islink(full):
                continue
            out.add(PurePosixPath(os.path.relpath(full, root)).as_posix())
    return out


def _text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_inside(root: Path, rel: str) -> bytes | None:
    """The bytes of root/rel if it is a regular file whose path stays inside root (a folder replaced by a symlink
    to a host path, e.g. `pkg -> /etc`, must not make the host read its own files into the diff)."""
    path = root / rel
    real = os.path.realpath(path)
    if not real.startswith(os.path.realpath(root) + os.sep) or os.path.islink(path) or not os.path.isfile(real):
        return None
    return path.read_bytes()


def tree_diff(source: Path, work: Path) -> str:
    """Unified diff of `work` against `source` (paths a/REL, b/REL); "" if they hold the same files."""
    chunks: list[str] = []
    for rel in sorted(_files(source) | _files(work)):
        a, b = source / rel, work / rel
        a_bytes = _read_inside(source, rel)
        b_bytes = _read_inside(work, rel)
        if a_bytes == b_bytes:
            continue
        a_text = "" if a_bytes is None else _text(a)
        b_text = "" if b_bytes is None else _text(b)
        if a_text is None or b_text is None:
            chunks.append(f"Binary files a/{rel} and b/{rel} differ\n")
            continue
        lines = difflib.unified_diff(a_text.splitlines(keepends=True), b_text.splitlines(keepends=True),
                                     "/dev/null" if a_bytes is None else f"a/{rel}",
                                     "/dev/null" if b_bytes is None else f"b/{rel}")
        for line in lines:
            chunks.append(line if line.endswith("\n") else f"{line}\n{_NO_EOL}\n")
    return "".join(chunks)


def _relpath(header: str, workdir: Path) -> str | None:
    """REL of a `--- a/REL` / `+++ b/REL` header (None for /dev/null); refuses anything outside workdir."""
    name = header.split("\t")[0].strip()
    if name == "/dev/null":
        return None
    if name.startswith(("a/", "b/")):
        name = name[2:]
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or name.startswith("~"):
        raise ValueError(f"patch path {header.strip()!r}: must be a relative path inside the work folder "
                         "(no absolute path, no '..')")
    real = os.path.realpath(workdir / p)
    if not real.startswith(os.path.realpath(workdir) + os.sep):
        raise ValueError(f"patch path {header.strip()!r}: resolves outside the work folder")
    return p.as_posix()


def _parse(patch: str, workdir: Path) -> list[tuple[str | None, str | None, list[tuple[int, list[str], list[str]]]]]:
    """[(old REL, new REL, [(old start, old lines, new lines) per hunk])]"""
    lines = patch.splitlines(keepends=True)
    files: list[tuple[str | None, str | None, list[tuple[int, list[str], list[str]]]]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("Binary files "):
            raise ValueError(f"patch: {line.strip()!r}: binary files cannot be applied")
        if not (line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        old, new = _relpath(line[4:], workdir), _relpath(lines[i + 1][4:], workdir)
        if old is None and new is None:
            raise ValueError("patch: a file from /dev/null to /dev/null")
        hunks: list[tuple[int, list[str], list[str]]] = []
        i += 2
        while i < len(lines) and (m := _HUNK.match(lines[i])):
            old_n = 1 if m.group(2) is None else int(m.group(2))
            new_n = 1 if m.group(4) is None else int(m.group(4))
            old_lines: list[str] = []
            new_lines: list[str] = []
            prev = " "
            i += 1
            while i < len(lines) and (len(old_lines) < old_n or len(new_lines) < new_n or lines[i].startswith("\\")):
                body = lines[i]
                tag, text = body[:1], body[1:]
                if tag == "\\":              # the line before has no newline at end of file
                    for seq in ([old_lines, new_lines] if prev == " " else [old_lines] if prev == "-" else [new_lines]):
                        if seq and seq[-1].endswith("\n"):
                            seq[-1] = seq[-1][:-1]
                elif tag in (" ", "\n"):
                    text = text if tag == " " else "\n"
                    old_lines.append(text)
                    new_lines.append(text)
                elif tag == "-":
                    old_lines.append(text)
                elif tag == "+":
                    new_lines.append(text)
                else:
                    raise ValueError(f"patch: {new or old}: hunk {len(hunks) + 1}: unexpected line {body[:60]!r}")
                prev = tag if tag != "\n" else " "
                i += 1
            if len(old_lines) != old_n or len(new_lines) != new_n:
                raise ValueError(f"patch: {new or old}: hunk {len(hunks) + 1} is cut short")
            hunks.append((int(m.group(1)), old_lines, new_lines))
        files.append((old, new, hunks))
    return files


def _find(content: list[str], block: list[str], guess: int) -> int:
    """Index where `block` occurs in content, nearest to `guess`; -1 if nowhere."""
    n = len(block)
    for d in range(len(content) + 1):
        for at in (guess - d, guess + d) if d else (guess,):
            if 0 <= at <= len(content) - n and content[at:at + n] == block:
                return at
    return -1


def apply_patch(workdir: Path, patch: str, *, exclude: Callable[[str], bool] | None = None) -> list[str]:
    """Apply a unified diff (as Sandbox.diff writes it) to the files of `workdir`; hunks of files for which
    exclude(relpath) is True are skipped. All or nothing: a patch that does not apply changes no file and raises
    ValueError naming the file and the hunk. Returns the relpaths changed."""
    workdir = Path(workdir)
    writes: dict[str, str | None] = {}
    for old, new, hunks in _parse(patch, workdir):
        rel = new if new is not None else old
        assert rel is not None
        if exclude is not None and exclude(rel):
            continue
        path = workdir / (old or rel)
        if old is None:
            if path.exists():
                raise ValueError(f"patch: {rel}: the patch adds it, but it already exists")
            content: list[str] = []
        else:
            text = writes.get(old) if old in writes else (_text(path) if path.is_file() else None)
            if text is None:
                raise ValueError(f"patch: {old}: no such text file in the work folder")
            content = text.splitlines(keepends=True)
        shift = 0
        for k, (start, old_lines, new_lines) in enumerate(hunks, 1):
            guess = max(0, start - 1 + shift) if old_lines else min(len(content), max(0, start + shift))
            at = _find(content, old_lines, guess)
            if at < 0:
                raise ValueError(f"patch: {rel}: hunk {k} (@@ -{start}) does not apply: its lines are not in the file")
            content[at:at + len(old_lines)] = new_lines
            shift += len(new_lines) - len(old_lines)
        if new is None:
            writes[old or rel] = None
        else:
            writes[new] = "".join(content)
            if old is not None and old != new:
                writes[old] = None
    for rel, text in writes.items():
        path = workdir / rel
        if text is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    return sorted(writes)
