"""Procedural tiny Python repositories with exactly one injected bug: the problems of the `repo` task.

A generated repository is two files, stdlib only:
- `lib.py`: 1 + `distractors` short functions (a few lines each, the whole module a few hundred bytes so
  that a `cat` fits the tiny models' ~1k-token context), exactly one of them with one injected bug;
- `test_lib.py`: unittest cases for every function, run with `python3 -m unittest -q` (well under a second).

Each function template carries a few hand-written bug sites (kind, original text, buggy text); the
mutation operators (`MUTATIONS`: a comparison or arithmetic operator swapped, a `+ 1` dropped, a constant changed,
two arguments swapped) add one site for every place in its body where they apply and a test case exposes the
change. A site's texts are the smallest run of whole words around the change that occurs once in the body, so an
edit names a few words, not a line. Bug kinds (`BUG_KINDS`): off_by_one, wrong_operator, swapped_arguments,
wrong_constant, missing_case, wrong_variable. The issue text reports one failing call as a user would
("clamp(5, 0, 3) returns 5, expected 3."), never the fix.

Splits (seeds as base.split_seeds: train below EVAL_SEED_START, held out from it on):
- function NAMES: every template has four names; names 0-1 are train names, names 2-3 held-out names;
  every function of a repository (the buggy one and the distractors) takes a name of its seed's split, and a
  training repository's function half the time a made-up one instead (`made_name`: syllables such as "kalo",
  never a held-out name), so that in training a name does not tell the function's shape: a fix has to read the
  body;
- bug SITES: all sites of all templates, in a fixed order, are dealt alternately to train and held out within
  each kind (`site_split`), so every kind with two or more sites has sites in both splits, and no (template,
  site) is in both.
So no held-out repository contains a function name or a (template, site) bug seen in any training repository;
the templates (the functions' shapes) and the kinds of change (the mutation operators) are shared: fixing a
held-out bug is undoing a kind of change seen in training at a place never seen there (`split_kinds()` lists
each split's kinds).

Every repository is a pure function of (seed, distractors): `generate(seed)` draws from random.Random(seed).
The reference fix (`RepoProblem.buggy_text` -> `fix_text` in `lib.py`) is the generator's ground truth: the
scripted demonstrator reads it, the model never sees it.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mixfleet.runner.rollout.tasks.base import split_of

MODULE = "lib.py"
TEST_FILE = "test_lib.py"
TEST_COMMAND = "python3 -m unittest -q"
BUG_KINDS = ("off_by_one", "wrong_operator", "swapped_arguments", "wrong_constant", "missing_case",
             "wrong_variable")
MAX_DISTRACTORS = 3


@dataclass(frozen=True)
class Site:
    kind: str                      # one of BUG_KINDS
    original: str                  # text in the template (exactly once)
    buggy: str                     # what the bug puts in its place


@dataclass(frozen=True)
class Template:
    key: str
    names: tuple[str, str, str, str]     # 0-1 train, 2-3 held out
    body: str                            # "def {n}(...):\n    ..." (no single quotes, no tabs)
    sites: tuple[Site, ...]              # the hand-written sites (`sites_of`: these + the mutations')
    cases: tuple[tuple[Any, ...], ...]   # argument tuples the tests call it with


TEMPLATES: tuple[Template, ...] = (
    Template("clamp", ("clamp", "bound", "limit", "pin"),
             "def {n}(x, lo, hi):\n    return min(max(x, lo), hi)\n",
             (Site("wrong_variable", "max(x, lo)", "max(x, hi)"),
              Site("swapped_arguments", "min(max(x, lo), hi)", "max(min(x, lo), hi)")),
             ((5, 0, 3), (-2, 0, 3), (2, 0, 3), (3, 0, 3), (9, 1, 4))),
    Template("count_above", ("count_above", "num_over", "tally_gt", "n_bigger"),
             "def {n}(xs, t):\n    c = 0\n    for x in xs:\n        if x > t:\n            c += 1\n    return c\n",
             (Site("wrong_operator", "x > t", "x >= t"), Site("off_by_one", "c = 0", "c = 1")),
             (([1, 5, 7], 4), ([2, 2, 3], 2), ([], 1), ([9, 8], 0))),
    Template("range_sum", ("range_sum", "span_total", "sum_between", "add_upto"),
             "def {n}(a, b):\n    return sum(range(a, b + 1))\n",
             (Site("off_by_one", "range(a, b + 1)", "range(a, b)"),
              Site("swapped_arguments", "range(a, b + 1)", "range(b, a + 1)")),
             ((1, 4), (3, 3), (2, 6), (0, 2))),
    Template("pad_left", ("pad_left", "lpad", "fill_left", "right_align"),
             "def {n}(s, width, ch):\n    return ch * (width - len(s)) + s\n",
             (Site("swapped_arguments", "ch * (width - len(s)) + s", "s + ch * (width - len(s))"),
              Site("wrong_operator", "width - len(s)", "width + len(s)")),
             (("7", 3, "0"), ("ab", 4, "."), ("xyz", 3, "-"), ("", 2, "*"))),
    Template("sign", ("sign", "signum", "polarity", "sgn"),
             "def {n}(x):\n    if x > 0:\n        return 1\n    return -1 if x < 0 else 0\n",
             (Site("wrong_constant", "return 1\n", "return 2\n"),
              Site("missing_case", "return -1 if x < 0 else 0", "return -1")),
             ((5,), (-3,), (0,), (1,))),
    Template("mean", ("mean", "average", "avg", "midvalue"),
             "def {n}(xs):\n    return sum(xs) / len(xs) if xs else 0.0\n",
             (Site("missing_case", "sum(xs) / len(xs) if xs else 0.0", "sum(xs) / len(xs)"),
              Site("wrong_operator", "sum(xs) / len(xs)", "sum(xs) // len(xs)")),
             (([1, 2],), ([],), ([4, 4, 4],), ([1, 2, 4],))),
    Template("argmax", ("argmax", "max_index", "best_pos", "top_index"),
             "def {n}(xs):\n    best = 0\n    for i in range(1, len(xs)):\n        if xs[i] > xs[best]:\n"
             "            best = i\n    return best\n",
             (Site("off_by_one", "range(1, len(xs))", "range(1, len(xs) - 1)"),
              Site("wrong_operator", "xs[i] > xs[best]", "xs[i] < xs[best]")),
             (([3, 9, 2],), ([1, 2, 5],), ([7],), ([4, 4, 1],))),
    Template("percent", ("percent", "pct", "share_of", "ratio100"),
             "def {n}(part, total):\n    return round(100 * part / total, 1)\n",
             (Site("wrong_constant", "100 * part", "10 * part"),
              Site("swapped_arguments", "part / total", "total / part")),
             ((1, 4), (3, 3), (1, 8), (5, 2))),
    Template("is_leap", ("is_leap", "leap_year", "has_feb29", "long_year"),
             "def {n}(y):\n    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)\n",
             (Site("missing_case", "(y % 100 != 0 or y % 400 == 0)", "y % 100 != 0"),
              Site("wrong_constant", "y % 400", "y % 300")),
             ((2000,), (1900,), (2024,), (2023,), (2100,), (1500,))),
    Template("repeat_join", ("repeat_join", "join_n", "rep_sep", "multi_join"),
             "def {n}(s, n, sep):\n    return sep.join([s] * n)\n",
             (Site("swapped_arguments", "sep.join([s] * n)", "s.join([sep] * n)"),
              Site("off_by_one", "[s] * n", "[s] * (n - 1)")),
             (("ab", 3, "-"), ("x", 1, ","), ("hi", 2, " "), ("q", 0, "+"))),
)


@dataclass(frozen=True, kw_only=True)
class RepoProblem:
    """One generated repository and its ground truth."""

    seed: int
    files: dict[str, str]          # relpath -> content (lib.py, test_lib.py)
    issue: str                     # the user's report of one failing call
    function: str                  # the buggy function's name
    template: str                  # its template key
    kind: str                      # the bug's kind
    site: int                      # index of the bug site in the template
    buggy_text: str                # the text to replace in lib.py (exactly once there) ...
    fix_text: str                  # ... with this: the reference fix
    test_files: tuple[str, ...] = (TEST_FILE,)
    test_command: str = TEST_COMMAND


def split_names(template: Template, split: str) -> tuple[str, ...]:
    """The template's own names of a split: names 0-1 for train, 2-3 held out (a training repository also takes
    made-up names, `made_name`)."""
    return template.names[:2] if split == "train" else template.names[2:]


# made-up names of training functions: two or three of these syllables, sometimes joined by "_" (so a name says
# nothing of its function's shape, and a policy must read the body to fix it); none is a held-out name
_SYLLABLES = ("ka", "lo", "mi", "ru", "te", "zo", "vi", "ne", "pa", "su", "go", "bi")
MADE_NAME_SHARE = 0.5     # share of a training repository's functions that take a made-up name


def made_name(rng: random.Random) -> str:
    """A made-up function name (`_SYLLABLES`), e.g. "kalo" or "mi_rute"."""
    parts = [rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))]
    cut = rng.randrange(1, len(parts)) if rng.random() < 0.3 else len(parts)
    return "".join(parts[:cut]) + ("_" + "".join(parts[cut:]) if cut < len(parts) else "")


@functools.cache
def _held_out_names() -> frozenset[str]:
    return frozenset(n for t in TEMPLATES for n in split_names(t, "eval"))


def _const(m: re.Match[str]) -> str:
    """A changed constant: one more for a digit, a tenth for a larger number (100 -> 10, 400 -> 40)."""
    n = int(m.group(1))
    return str(n + 1) if n < 10 else str(n // 10)


# (kind, pattern, replacement: a template for re's expand, or a function of the match): applied at each match in a
# template's body (the def line excepted)
MUTATIONS: tuple[tuple[str, str, str | Callable[[re.Match[str]], str]], ...] = (
    ("wrong_operator", r" > ", " >= "), ("wrong_operator", r" >= ", " > "), ("wrong_operator", r" < ", " <= "),
    ("wrong_operator", r" <= ", " < "), ("wrong_operator", r" == ", " != "), ("wrong_operator", r" != ", " == "),
    ("wrong_operator", r" \+ ", " - "), ("wrong_operator", r" - ", " + "), ("wrong_operator", r" / ", " // "),
    ("wrong_operator", r" \* ", " + "),
    ("off_by_one", r" \+ 1\b", ""), ("off_by_one", r"\brange\((\w+), (\w+)\)", r"range(\1, \2 - 1)"),
    ("wrong_constant", r"(?<![\w.])([1-9]\d*|0)(?![\w.])", _const),
    ("swapped_arguments", r"\((\w+), (\w+)([,)])", r"(\2, \1\3"),
)


def _window(before: str, after: str, body: str, changed: str) -> tuple[str, str] | None:
    """The smallest run of whole words around the difference of two lines (one word of context each side when
    there is one) whose original text occurs once in `body` and whose changed text once in `changed`."""
    a, b = before.split(" "), after.split(" ")
    lo = 0
    while lo < min(len(a), len(b)) and a[lo] == b[lo]:
        lo += 1
    hi = 0
    while hi < min(len(a), len(b)) - lo and a[-1 - hi] == b[-1 - hi]:
        hi += 1
    for pad in range(1, max(len(a), len(b))):
        i, ja, jb = max(lo - pad, 0), len(a) - max(hi - pad, 0), len(b) - max(hi - pad, 0)
        while i < lo and a[i] == "":                      # no window that starts in the indentation
            i += 1
        orig, bug = " ".join(a[i:ja]), " ".join(b[i:jb])
        if orig and bug and body.count(orig) == 1 and changed.count(bug) == 1:
            return orig, bug
    return None


def _exposed(template: Template, buggy_body: str) -> bool:
    """Whether some test case of the template returns a different value (or raises) with the buggy body."""
    try:
        ref, bug = _compile(template.body.replace("{n}", "f"), "f"), _compile(buggy_body.replace("{n}", "f"), "f")
    except SyntaxError:
        return False
    return any(_call(ref, args) != _call(bug, args) for args in template.cases)


def sites_of(template: Template) -> tuple[Site, ...]:
    """The template's bug sites: its hand-written ones, then one per place a mutation operator applies and a test
    case exposes (duplicates of an earlier site's buggy body dropped). Deterministic: a pure function of the
    template and MUTATIONS (computed once per template)."""
    return _sites(template.key)


@functools.cache
def _sites(key: str) -> tuple[Site, ...]:
    template = next(t for t in TEMPLATES if t.key == key)   # (a Template holds lists: not hashable itself)
    sites = list(template.sites)
    bodies = {template.body.replace(s.original, s.buggy, 1) for s in sites}
    head, _, rest = template.body.partition("\n")
    offset = len(head) + 1
    for kind, pattern, repl in MUTATIONS:
        for m in re.finditer(pattern, rest):
            new = repl(m) if callable(repl) else m.expand(repl)
            line_start = rest.rfind("\n", 0, m.start()) + 1
            line_end = rest.find("\n", m.end())
            line = rest[line_start:line_end]
            changed_line = line[:m.start() - line_start] + new + line[m.end() - line_start:]
            buggy_body = template.body[:offset + line_start] + changed_line + template.body[offset + line_end:]
            if buggy_body in bodies or not _exposed(template, buggy_body):
                continue
            window = _window(line, changed_line, template.body, buggy_body)
            if window is None:
                continue
            bodies.add(buggy_body)
            sites.append(Site(kind, *window))
    return tuple(sites)


@functools.cache
def site_split() -> dict[tuple[str, int], str]:
    """(template key, site index) -> "train" | "eval": within each kind, the sites in template order then site
    order are dealt alternately, the first to train."""
    by_kind: dict[str, list[tuple[str, int]]] = {}
    for t in TEMPLATES:
        for i, site in enumerate(sites_of(t)):
            by_kind.setdefault(site.kind, []).append((t.key, i))
    return {key: ("train" if j % 2 == 0 else "eval") for keys in by_kind.values() for j, key in enumerate(keys)}


def split_sites(template: Template, split: str) -> tuple[int, ...]:
    """Indices (into `sites_of(template)`) of the template's sites in `split` ("train" or "eval")."""
    want = "train" if split == "train" else "eval"
    return tuple(i for i in range(len(sites_of(template))) if site_split()[(template.key, i)] == want)


def split_kinds(split: str) -> tuple[str, ...]:
    """The bug kinds that occur in a split."""
    return tuple(sorted({sites_of(t)[i].kind for t in TEMPLATES for i in split_sites(t, split)}))


def _call(fn: Any, args: tuple[Any, ...]) -> tuple[bool, Any]:
    try:
        return True, fn(*args)
    except Exception as e:  # noqa: BLE001 - a buggy function may raise; that is its observable failure
        return False, type(e).__name__


def _compile(source: str, name: str) -> Any:
    scope: dict[str, Any] = {}
    exec(compile(source, f"<{name}>", "exec"), scope)   # our own generated code, never a model's
    return scope[name]


def _fmt_call(name: str, args: tuple[Any, ...]) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


_ISSUE_FORMS = ("{call} returns {got}, expected {want}.",
                "Bug: {call} gives {got} but should give {want}.",
                "{call} returned {got}; I expected {want}.")
_RAISE_FORMS = ("{call} raises {got}, expected {want}.",
                "Bug: {call} fails with {got}; it should return {want}.")


def generate(seed: int, *, distractors: int = 1) -> RepoProblem:
    """The repository of `seed` (its split decides the name and site pools); see the module docstring."""
    if not isinstance(distractors, int) or not 0 <= distractors <= MAX_DISTRACTORS:
        raise ValueError(f"repo.distractors: {distractors!r} must be an integer in [0, {MAX_DISTRACTORS}]")
    split = split_of(seed)
    rng = random.Random(seed)
    for _ in range(100):   # a draw whose buggy text is not unique in the module is redrawn (deterministic)
        problem = _draw(seed, rng, split, distractors)
        if problem is not None:
            return problem
    raise RuntimeError(f"repo: seed {seed}: no valid repository in 100 draws")   # pragma: no cover


def _draw(seed: int, rng: random.Random, split: str, distractors: int) -> RepoProblem | None:
    first = rng.choice([i for i, t in enumerate(TEMPLATES) if split_sites(t, split)])
    picked = [first, *rng.sample([i for i in range(len(TEMPLATES)) if i != first], distractors)]
    buggy_t = TEMPLATES[picked[0]]
    site_i = rng.choice(split_sites(buggy_t, split))
    site = sites_of(buggy_t)[site_i]
    funcs = []   # (template, name, reference source, shipped source)
    for k, ti in enumerate(picked):
        t = TEMPLATES[ti]
        name = rng.choice(split_names(t, split))
        if split == "train" and rng.random() < MADE_NAME_SHARE:
            name = made_name(rng)
            if name in _held_out_names() or any(name == f[1] for f in funcs):
                return None     # redrawn (deterministic)
        ref = t.body.replace("{n}", name)
        shipped = ref.replace(site.original, site.buggy, 1) if k == 0 else ref
        funcs.append((t, name, ref, shipped))
    order = list(range(len(funcs)))
    rng.shuffle(order)
    module = "\n\n".join(funcs[i][3] for i in order)
    name = funcs[0][1]
    # tests: every case of every function, expected values from the reference implementation
    lines = ["import unittest", "", f"from lib import {', '.join(sorted(f[1] for f in funcs))}", "", "",
             "class TestLib(unittest.TestCase):"]
    failing = None
    for t, fname, ref, shipped in sorted(funcs, key=lambda f: f[1]):
        ref_fn = _compile(ref, fname)
        lines.append(f"    def test_{fname}(self):")
        for args in t.cases:
            ok, want = _call(ref_fn, args)
            assert ok, f"reference {fname}{args} raised"
            lines.append(f"        self.assertEqual({_fmt_call(fname, args)}, {want!r})")
            if fname == name and failing is None:
                bug_ok, got = _call(_compile(shipped, fname), args)
                if not bug_ok or got != want:
                    failing = (args, bug_ok, got, want)
        lines.append("")
    assert failing is not None, f"seed {seed}: no test case exposes {buggy_t.key} site {site_i}"
    args, bug_ok, got, want = failing
    form = rng.choice(_ISSUE_FORMS if bug_ok else _RAISE_FORMS)
    issue = form.format(call=_fmt_call(name, args), got=repr(got) if bug_ok else got, want=repr(want))
    if module.count(site.buggy) != 1 or "'" in module:
        return None
    return RepoProblem(seed=seed, files={MODULE: module, TEST_FILE: "\n".join(lines).rstrip() + "\n"},
                       issue=issue, function=name, template=buggy_t.key, kind=site.kind, site=site_i,
                       buggy_text=site.buggy, fix_text=site.original)
