"""The `repo` task family: the generator (one bug, tests fail before / pass after the reference fix, the
train / held-out split of names and sites), the task-set loader and its errors, the tool-output clip, and
RepoTask end to end in the real sandbox (runner/rollout/sandbox): a correct patch gets reward 1, a wrong one 0,
a patch that edits the tests is judged by the original tests, and the scripted demonstrations run.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import sys
import types
import unittest
from pathlib import Path

import pytest
from mixfleet.runner.rollout.agent import AgentConfig, run_episode
from mixfleet.runner.rollout.demos import (
    DemoConfig,
    demo_stats,
    demonstrator_generate,
    generate_demos,
    repo_edit_command,
)
from mixfleet.runner.rollout.tasks import EVAL_SEED_START, ToolCall, make_task, split_seeds
from mixfleet.runner.rollout.tasks.repo import (
    BUG_KINDS,
    TaskSetError,
    clip_output,
    generate,
    load_task_set,
    split_kinds,
)
from mixfleet.runner.rollout.tasks.repo.generator import MODULE, TEMPLATES, TEST_FILE, Site, sites_of, split_sites
from mixfleet.runner.sampler.engine_api import SamplingParams

EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "tasksets" / "example"


def _run_tests_in_process(files: dict[str, str]) -> bool:
    """Run the generated test file against the generated module without a subprocess (our own code)."""
    lib = types.ModuleType("lib")
    exec(compile(files[MODULE], MODULE, "exec"), lib.__dict__)
    saved = sys.modules.get("lib")
    sys.modules["lib"] = lib
    try:
        mod = types.ModuleType("test_lib")
        exec(compile(files[TEST_FILE], TEST_FILE, "exec"), mod.__dict__)
        suite = unittest.defaultTestLoader.loadTestsFromModule(mod)
        result = unittest.TestResult()
        suite.run(result)
        return result.wasSuccessful()
    finally:
        if saved is None:
            del sys.modules["lib"]
        else:
            sys.modules["lib"] = saved


def _fixed(files: dict[str, str], buggy: str, fix: str) -> dict[str, str]:
    assert files[MODULE].count(buggy) == 1
    return {**files, MODULE: files[MODULE].replace(buggy, fix)}


def test_a_demonstrations_edit_rewrites_the_buggy_line_and_fixes_it() -> None:
    """repo_line_edit (demonstrations' format 5): the buggy line rewritten whole, named by its first words before
    the bug where they occur in no other line (so every bug on that line has the same edit), else the exact line or
    the site's window; applied as sed would, every edit fixes its repository."""
    import re

    from mixfleet.runner.rollout.demos import repo_line_edit

    kinds = {True: 0, False: 0}
    for seed in [*split_seeds("train", 120), *split_seeds("eval", 120)]:
        p = generate(seed)
        edit = repo_line_edit(p)
        module = p.files[MODULE]
        buggy = p.buggy_text.rstrip("\n")
        assert edit.line in module and buggy in edit.line
        if edit.prefix:
            assert edit.line.startswith(edit.old) and edit.fixed.startswith(edit.old), (seed, edit)
            assert sum(edit.old in ln for ln in module.splitlines()) == 1
            new = edit.new
            fixed = "\n".join(re.sub(re.escape(edit.old) + ".*", lambda _m, new=new: new, ln, count=1)
                              for ln in module.splitlines()) + "\n"
        else:
            assert module.count(edit.old) == 1
            fixed = module.replace(edit.old, edit.new)
        kinds[edit.prefix] += 1
        assert _run_tests_in_process({**p.files, MODULE: fixed}), f"seed {seed}: the edit does not fix it: {edit}"
        assert _run_tests_in_process({**p.files, MODULE: module.replace(edit.line, edit.fixed)})   # python's form
    assert kinds[True] > kinds[False] > 0, kinds


@pytest.mark.parametrize("split", ["train", "eval"])
def test_generated_tests_fail_on_the_bug_and_pass_with_the_reference_fix(split: str) -> None:
    for seed in split_seeds(split, 150):
        p = generate(seed)
        assert p.kind in BUG_KINDS
        assert not _run_tests_in_process(p.files), f"seed {seed}: the buggy repository passes its tests"
        assert _run_tests_in_process(_fixed(p.files, p.buggy_text, p.fix_text)), f"seed {seed}: fix fails"
        assert p.function in p.issue and p.fix_text not in p.issue
        assert len(p.files[MODULE].encode()) <= 300          # a `cat lib.py` fits the tiny context


def test_generation_is_a_pure_function_of_the_seed() -> None:
    assert generate(17) == generate(17)
    assert generate(17, distractors=2) == generate(17, distractors=2)
    assert {generate(s).files[MODULE] for s in range(40)} != {generate(0).files[MODULE]}
    with pytest.raises(ValueError, match=r"repo.distractors: 9 must be an integer in \[0, 3\]"):
        generate(1, distractors=9)


def test_held_out_split_has_unseen_names_and_bug_sites() -> None:
    def seen(split: str) -> tuple[set[str], set[tuple[str, int]]]:
        names: set[str] = set()
        sites: set[tuple[str, int]] = set()
        for s in split_seeds(split, 400):
            p = generate(s, distractors=2)
            names |= {line[4:line.index("(")] for line in p.files[MODULE].splitlines() if line.startswith("def ")}
            sites.add((p.template, p.site))
        return names, sites

    train_names, train_sites = seen("train")
    eval_names, eval_sites = seen("eval")
    assert train_names and eval_names and not train_names & eval_names
    assert train_sites and eval_sites and not train_sites & eval_sites
    for split, drawn in (("train", train_sites), ("eval", eval_sites)):   # every site of each split is drawn
        assert drawn == {(t.key, i) for t in TEMPLATES for i in split_sites(t, split)}
    assert len(train_sites) >= 20 and len(eval_sites) >= 15
    # a held-out bug is a kind of change seen in training, at a place never seen there
    assert set(split_kinds("eval")) <= set(split_kinds("train")) and len(split_kinds("train")) == len(BUG_KINDS)


def test_mutation_sites_are_exposed_and_name_a_unique_text() -> None:
    for t in TEMPLATES:
        sites = sites_of(t)
        assert len(sites) >= len(t.sites) >= 2 and sites[:len(t.sites)] == t.sites
        bodies = set()
        for site in sites:
            assert t.body.count(site.original) == 1, (t.key, site)
            buggy = t.body.replace(site.original, site.buggy, 1)
            assert buggy.count(site.buggy) == 1 and buggy not in bodies, (t.key, site)
            bodies.add(buggy)
    # the operators add places: e.g. sign's `x > 0` -> `x >= 0` (sign(0) returns 1)
    assert Site("wrong_operator", "x > 0:", "x >= 0:") in sites_of(next(t for t in TEMPLATES if t.key == "sign"))
    assert EVAL_SEED_START == split_seeds("eval", 1)[0]


def test_clip_output_keeps_head_and_tail_and_marks_the_cut() -> None:
    assert clip_output("short", 300) == "short"
    text = "H" * 500 + "T" * 500
    out = clip_output(text, 300)
    head, rest = out.split("\n[... ", 1)
    cut, tail = rest.split(" bytes cut ...]\n")
    assert head == "H" * 108 and tail == "T" * 164 and int(cut) == 1000 - 108 - 164
    assert len(out.encode()) <= 300
    assert clip_output("é" * 400, 100).encode("utf-8")   # never splits a character into invalid bytes


def test_repo_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"repo.sandboxes: 0 must be an integer in \[1, 64\]"):
        make_task("repo", sandboxes=0)
    with pytest.raises(ValueError, match=r"repo.clip_bytes: 10 must be"):
        make_task("repo", clip_bytes=10)
    with pytest.raises(ValueError, match="unknown option 'pool'"):
        make_task("repo", pool=3)


def test_example_task_set_loads() -> None:
    specs = load_task_set(EXAMPLE)
    assert [s.name for s in specs] == ["fizzbuzz", "median", "slugify", "wordcount"]
    by = {s.name: s for s in specs}
    assert by["median"].test_files == ("test_stats.py",)
    assert by["slugify"].test_files == ("tests/test_text.py",)
    assert by["wordcount"].test_files == ("check.py",)
    assert by["fizzbuzz"].setup_command.startswith("cp ")


def _copy_task(tmp_path: Path, name: str = "median") -> Path:
    root = tmp_path / "set"
    shutil.copytree(EXAMPLE / name, root / name)
    return root


@pytest.mark.parametrize(("toml", "message"), [
    ('test_command = ""\n', "task 'median': test_command = ''; allowed: a non-empty bash command string"),
    ('test_command = 3\n', "task 'median': test_command = 3; allowed: a non-empty bash command string"),
    ('test_command = "x"\ntimeout = 5\n', "task 'median': timeout = 5; allowed: one of the fields"),
    ('test_command = "x"\ntest_files = ["nope.py"]\n', "task 'median': test_files = ['nope.py']; allowed: a list"),
    ('test_command = "x"\nsetup_command = 1\n', "task 'median': setup_command = 1; allowed: a bash command string"),
    ('test_command = \n', "task 'median': task.toml = "),
])
def test_malformed_task_names_folder_field_and_value(tmp_path: Path, toml: str, message: str) -> None:
    root = _copy_task(tmp_path)
    (root / "median" / "task.toml").write_text(toml)
    with pytest.raises(TaskSetError) as e:
        load_task_set(root)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_pieces_are_named(tmp_path: Path) -> None:
    root = _copy_task(tmp_path)
    (root / "median" / "issue.md").unlink()
    with pytest.raises(TaskSetError, match="task 'median': issue.md = "):
        load_task_set(root)
    shutil.rmtree(root / "median" / "repo")
    (root / "median" / "issue.md").write_text("x")
    with pytest.raises(TaskSetError, match="task 'median': repo = "):
        load_task_set(root)
    with pytest.raises(TaskSetError, match="task_set = .*allowed: a folder of task folders"):
        load_task_set(tmp_path / "absent")
    with pytest.raises(ValueError, match="task 'median': repo = "):
        make_task("repo", task_set=str(root))


# ---- in the real sandbox -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sandbox_ok() -> None:
    sandbox = pytest.importorskip("mixfleet.runner.rollout.sandbox", reason="the sandbox module (issue 40 item 1)")
    if not hasattr(sandbox, "check_sandbox"):
        pytest.skip("the sandbox module (issue 40 item 1) is not complete yet")
    sandbox.check_sandbox()       # raises SandboxUnavailable (names the install step) rather than skipping


async def _episode(calls: list[str], seed: int, **options) -> tuple[float, list[str], dict]:
    task = make_task("repo", **options)
    outputs = []
    try:
        prompt = await task.areset(seed)
        outputs.append(prompt)
        for c in calls:
            name, _, args = c.partition(" ")
            res = await task.astep(ToolCall(name=name, args=args))
            outputs.append(res.output)
            if res.done:
                break
        return task.reward(), outputs, task.metrics()
    finally:
        await task.aclose()


def test_generated_repos_in_the_sandbox(sandbox_ok: None) -> None:
    async def main() -> list:
        out = []
        for seed in (3, EVAL_SEED_START + 4):
            p = generate(seed)
            fix = repo_edit_command(p.buggy_text.rstrip("\n"), p.fix_text.rstrip("\n"))
            out.append((seed, "wrong", await _episode(["bash python3 -m unittest -q", "submit"], seed)))
            out.append((seed, "fixed", await _episode([f"bash {fix}", "bash python3 -m unittest -q", "submit"], seed)))
            # the fix plus a test file gutted to pass: the tests edit is dropped, the fix still judged on the originals
            gut = "bash printf 'import unittest\\n' > test_lib.py"
            out.append((seed, "gut", await _episode([gut, "submit"], seed)))
            out.append((seed, "gut+fix", await _episode([gut, f"bash {fix}", "submit"], seed)))
        return out

    results = asyncio.run(main())
    rewards = {(s, k): r[0] for s, k, r in results}
    for seed in (3, EVAL_SEED_START + 4):
        assert rewards[(seed, "wrong")] == 0.0 and rewards[(seed, "gut")] == 0.0
        assert rewards[(seed, "fixed")] == 1.0 and rewards[(seed, "gut+fix")] == 1.0
    for _seed, k, (reward, outputs, metrics) in results:
        assert outputs[-1] == ("submitted: tests pass" if reward else "submitted: tests fail")
        assert len(metrics["sandbox_start_s"]) == len(metrics["pool_wait_s"]) == 2   # working + fresh
        assert metrics["commands"] == len(metrics["command_s"]) >= 2
        if k == "wrong":
            assert "FAILED" in outputs[1] and "[exit 1]" in outputs[1]
        if k == "fixed":
            assert outputs[2].rstrip().endswith("OK")


def test_example_task_set_through_the_sandbox(sandbox_ok: None) -> None:
    fixes = {
        "median": "python3 -c \"import pathlib;p=pathlib.Path('stats.py');p.write_text(p.read_text().replace("
                  "'return s[n // 2]','return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2'))\"",
        "slugify": "sed -i 's/title.split()/title.lower().split()/' text.py",
        "fizzbuzz": "sed -i 's/^    if n % 3 == 0:/    if n % 15 == 0:\\n        return \"FizzBuzz\"\\n&/' fizz.py",
        "wordcount": "sed -i 's/split(\" \")/split()/' words.py",
    }
    names = [s.name for s in load_task_set(EXAMPLE)]

    async def main() -> dict:
        out = {}
        for i, name in enumerate(names):
            out[name, "fix"] = await _episode([f"bash {fixes[name]}", "submit"], i, task_set=str(EXAMPLE))
            out[name, "none"] = await _episode(["submit"], i, task_set=str(EXAMPLE))
        # wordcount: editing its test script (named in test_files) does not count
        i = names.index("wordcount")
        out["wordcount", "cheat"] = await _episode(["bash echo 'print(1)' > check.py", "submit"], i,
                                                   task_set=str(EXAMPLE))
        return out

    res = asyncio.run(main())
    for name in names:
        assert res[name, "fix"][0] == 1.0, (name, res[name, "fix"][1])
        assert res[name, "none"][0] == 0.0, name
    assert res["wordcount", "cheat"][0] == 0.0
    assert "setup_s" in res["fizzbuzz", "fix"][2] and res["fizzbuzz", "fix"][2]["setup_s"] > 0


def test_repo_demonstrations_run_and_mostly_succeed(sandbox_ok: None) -> None:
    eps = generate_demos(DemoConfig(task="repo", num_episodes=8, seed=5, noise=0.25))
    stats = demo_stats(eps)
    assert all(e.finish_reason in ("done", "max_turns", "no_tool_call_3x") for e in eps)
    assert 0.5 <= stats["reward"] <= 1.0
    assert all(len(e.tokens) <= 1024 for e in eps)
    calls = [t.call.name for e in eps for t in e.turns if t.call is not None]
    assert "bash" in calls and "submit" in calls
    again = generate_demos(DemoConfig(task="repo", num_episodes=8, seed=5, noise=0.25))
    assert [[t.call for t in e.turns] for e in again] == [[t.call for t in e.turns] for e in eps]


def test_pool_bounds_live_sandboxes(sandbox_ok: None) -> None:
    from mixfleet.runner.rollout.tasks.repo import pool_stats

    async def main() -> dict:
        await asyncio.gather(*[_episode(["bash sleep 0.3", "submit"], s, sandboxes=2) for s in range(4)])
        return pool_stats()

    stats = asyncio.run(main())["pool=train,max_live=2,timeout_s=10"]
    assert stats["max_live"] == 2 and stats["starts"] == 8 and stats["live"] == 0
    assert stats["waits"] >= 1 and stats["wait_s_total"] > 0


def test_an_evaluation_takes_its_sandboxes_from_a_pool_of_its_own(sandbox_ok: None, tmp_path: Path) -> None:
    """A run's held-out evaluation (rollout/evaluation.py) took its episodes' sandboxes from the training episodes'
    pool: on repo-cpu the evaluation's 64 episodes queued with training's and training's tool seconds per update
    rose to 1373 s. Now its episodes take a pool of their own, of the same size: here a training episode holds the
    one training sandbox while a 2-problem evaluation runs, and the evaluation's starts are all in its own pool."""
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.checkpoint.init_model import init_model
    from mixfleet.runner.rollout.evaluation import EvalConfig, pass_at_k_eval
    from mixfleet.runner.rollout.tasks.repo import pool_stats

    init = init_model(load_model_spec("tiny"), tmp_path / "init", seed=0)

    async def main() -> tuple:
        train = asyncio.create_task(_episode(["bash sleep 2", "submit"], 0, sandboxes=1))
        await asyncio.sleep(0.2)
        res = await pass_at_k_eval(init, EvalConfig(task="repo", task_options={"sandboxes": 1}, problems=2, k=1,
                                                    max_turns=1, max_new_tokens=4))
        return res, await train, pool_stats()

    res, (_, _, metrics), stats = asyncio.run(main())
    assert res.problems == 2
    train, ev = stats["pool=train,max_live=1,timeout_s=10"], stats["pool=eval,max_live=1,timeout_s=10"]
    assert ev["starts"] == 2 and ev["live"] == 0                     # one sandbox per evaluation episode
    assert train["starts"] == 2 and train["waits"] == 0              # the working one and the submission's fresh one
    assert len(metrics["pool_wait_s"]) == 2


def test_demo_episode_through_run_episode_is_repeatable(sandbox_ok: None) -> None:
    async def one() -> list:
        task = make_task("repo")
        gen = demonstrator_generate(DemoConfig(task="repo", noise=0.0, no_call_rate=0.0), random.Random(0), task)
        ep = await run_episode(task, 11, gen, config=AgentConfig(sampling=SamplingParams(max_new_tokens=128)),
                               clock=lambda: 0.0)
        return [ep.reward, ep.finish_reason, [t.call for t in ep.turns], ep.tool_s, task.metrics()]

    a = asyncio.run(one())
    assert a[0] == 1.0 and a[1] == "done" and a[2][-1].name == "submit"
    # the episode's tool seconds (what the run log records per trajectory and per update) hold every sandbox
    # start and command the task measured itself: the model's commands and the submission's tests
    m = a[4]
    inside = sum(m["sandbox_start_s"]) + sum(m["command_s"])
    assert m["commands"] >= len(a[2]) and inside > 0 and a[3] >= inside


def test_the_repo_plan_pretrains_on_repo_demonstrations() -> None:
    from mixfleet.policies.plan import load_plan
    from mixfleet.runner.orchestration.pretrain import plan_base_config

    plan = load_plan("repo-cpu")
    assert plan.embedded.task == "repo" and plan.embedded.max_new_tokens >= 128
    demos = plan_base_config(plan).demos
    assert demos.task == "repo"
    make_task("repo", **plan.embedded.task_options)      # the plan's options configure the task
    # its 24-sandbox pool and its options at their defaults train the base `mixfleet pretrain --task repo` makes
    # (the same cache entry); an option that changes what a demonstration holds gives another base
    from mixfleet.runner.orchestration.pretrain import PretrainConfig, cache_key, demo_options
    from mixfleet.runner.rollout.demos import DemoConfig

    assert demos.task_options == ()
    assert cache_key(plan_base_config(plan)) == cache_key(PretrainConfig(demos=DemoConfig(task="repo")))
    assert demo_options("repo", {"sandboxes": 8, "clip_bytes": 200, "max_turns": 10}) == {"clip_bytes": 200}
    with pytest.raises(ValueError, match="colour"):
        demo_options("repo", {"colour": 1})


def test_every_demonstration_reply_fits_the_reply_cap() -> None:
    from mixfleet.runner.rollout.demos import DEMO_REPLY_TOKENS, _repo_plan, reply_ids

    config = DemoConfig(task="repo", noise=0.5)
    longest = max(len(reply_ids(r)) for s in [*split_seeds("train", 200), *split_seeds("eval", 200)]
                  for r in _repo_plan(generate(s), random.Random(s), config))
    assert longest <= DEMO_REPLY_TOKENS["repo"]


def test_run_task_set_flag_goes_into_the_plan_and_bad_sets_are_refused(tmp_path: Path) -> None:
    from mixfleet.policies.plan import load_plan
    from mixfleet.runner.orchestration.pretrain import plan_base_config
    from mixfleet.runner.orchestration.recipe import apply_overrides
    from mixfleet.ui.cli import app
    from mixfleet.ui.commands.run_live import flag_overrides
    from typer.testing import CliRunner

    def with_task_set(plan, task_set, task):  # noqa: ANN001, ANN202 - what --task-set (and --task) do to the plan
        return apply_overrides(plan, flag_overrides([], task_set=task_set, task=task))

    plan = with_task_set(load_plan("repo-cpu"), str(EXAMPLE), None)
    assert plan.embedded.task == "repo" and plan.embedded.task_options["task_set"] == str(EXAMPLE)
    assert plan.embedded.task_options["sandboxes"] == 24
    assert "task_set" not in dict(plan_base_config(plan).demos.task_options)   # demonstrations: generated repos
    assert with_task_set(load_plan("tiny-cpu"), str(EXAMPLE), "repo").embedded.task_options == {
        "task_set": str(EXAMPLE)}
    runner = CliRunner()
    bad = tmp_path / "set"
    shutil.copytree(EXAMPLE / "median", bad / "median")
    (bad / "median" / "task.toml").write_text("test_command = 1\n")
    res = runner.invoke(app, ["run", "data/plans/repo-cpu.toml", "--out", str(tmp_path / "r1"), "--task-set", str(bad)])
    assert res.exit_code == 2 and "task 'median': test_command = 1" in res.output
    res = runner.invoke(app, ["run", "data/plans/tiny-cpu.toml", "--out", str(tmp_path / "r2"), "--task-set",
                              str(EXAMPLE)])
    assert res.exit_code == 2 and "task_set" in res.output and "needs the repo task" in res.output
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()
