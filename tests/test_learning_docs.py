"""docs/learning.md and the README's learning rows agree with the results files they quote.

The check (benchmarks/check_learning_docs.py) re-makes the generated blocks from benchmarks/results/learning*.json
and compares every inline figure its claims list against the fact it names. These tests run it on the repository
and on a copy of the pages with one figure changed, which must fail, naming the figure and its file's value.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check(benchmark_script):
    return benchmark_script("check_learning_docs")


def _copy_pages(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "learning.md", tmp_path / "docs" / "learning.md")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def test_pages_agree_with_the_results(check):
    assert check.check() == []


def test_an_inline_figure_changed_by_hand_fails(check, tmp_path):
    root = _copy_pages(tmp_path)
    page = root / "docs" / "learning.md"
    text = page.read_text()
    quoted = "**Mean 0.419 -> 0.560 at version 30"
    assert text.count(quoted) == 1
    page.write_text(text.replace(quoted, "**Mean 0.419 -> 0.573 at version 30"))
    errors = check.check(root=root)
    assert len(errors) == 1
    assert "quotes 0.573 for d-a300.v30, the results say 0.560" in errors[0]


def test_a_readme_figure_changed_by_hand_fails(check, tmp_path):
    root = _copy_pages(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    quoted = "no-tool-call share at the last update 100 %, 48 %, 0 %"
    assert text.count(quoted) == 1
    readme.write_text(text.replace(quoted, "no-tool-call share at the last update 0 %, 0 %, 0 %"))
    errors = check.check(root=root)
    assert any("README.md" in e and "c-grpo-lr.s0.ntc_last" in e for e in errors), errors


def test_a_generated_table_changed_by_hand_fails_and_write_restores_it(check, tmp_path):
    root = _copy_pages(tmp_path)
    page = root / "docs" / "learning.md"
    original = page.read_text()
    row = ("| d-b300 | MoE: GRPO, runner, async (staleness <= 2), one fp32 group, 300-step base, lr 1.5e-4 | "
           "0, 1, 2 | 30 |")
    assert original.count(row) == 1
    page.write_text(original.replace(row + " 0.445 -> 0.312", row + " 0.445 -> 0.412"))
    errors = check.check(root=root)
    assert len(errors) == 1 and "'learning-table' differs" in errors[0]
    assert check.check(root=root, write=True) == []
    assert page.read_text() == original


def test_a_reworded_claim_fails_instead_of_passing_silently(check, tmp_path):
    root = _copy_pages(tmp_path)
    page = root / "docs" / "learning.md"
    text = page.read_text()
    quoted = "k3 grows 10x, 16x and 254x"
    assert text.count(quoted) == 1
    page.write_text(text.replace(quoted, "k3 rises 10x, 16x and 254x"))
    errors = check.check(root=root)
    assert len(errors) == 1 and "no text matches the claim" in errors[0]


def test_verdict_rule_within_margin(check):
    assert check._verdict_within(-0.04, 0.03) == "shown"
    assert check._verdict_within(-0.117, 0.096) == "not shown (not refuted either)"
    assert check._verdict_within(0.06, 0.2) == "refuted"
