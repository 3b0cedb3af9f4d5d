"""Synthetic demonstrations: well-formatted episodes of each task, made by scripted demonstrators.

The base policy (runner/orchestration/pretrain.py) is the tiny model trained to imitate these. A demonstrator is
a policy written in Python that reads the transcript so far and writes the next reply; it is
plugged into the real agent loop (runner/rollout/agent.py) as its generate function, so demonstrations have
exactly the chat format, tool-output encoding and loss mask of the episodes RL will sample.

Demonstrators are good but deliberately imperfect, with controlled noise, so that the imitating
policy starts with a reward that is clearly nonzero but improvable:
- guess: binary search (the midpoint of the interval still possible); with probability `noise` a
  reply guesses a uniformly random number of that interval instead (still consistent, but slower).
- calc: `calc EXPR` with the expression copied from the prompt, then `answer` with the calculator's
  value; with probability `noise` it answers at once, without the calculator, with a "mental" value
  that is right only `mental_accuracy` of the time (off by 1..10 otherwise).
- repo: the fix of a generated repository (the demonstrator reads the generator's ground truth): look
  (`grep -n -A5 "def NAME" lib.py` or `cat lib.py`), run the tests (`python3 -m unittest -q 2>&1 | tail -n 6`),
  edit (`sed -i 's|FIRST WORDS.*|FIXED LINE|' lib.py`: the buggy line named by its first words before the bug
  and rewritten whole, `repo_line_edit`; or 1 time in 4 a one-line `python3 -c` replace of the whole line where
  it is <= 110 bytes), run the tests again, `submit`;
  with probability `noise` each: the look skipped, the first test run skipped, the final test run skipped, a
  wrong edit first (a mistyped pattern that changes nothing; then the tests, and half of those episodes submit
  right away: reward 0).
- all: with probability `no_call_rate` a reply is a short remark without a tool call (the loop
  then nudges, and the next reply calls a tool), so the base policy knows how to recover.
Every draw comes from seeded RNGs (one for guess / calc, one per episode for repo): the same DemoConfig
gives the same episodes.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mixfleet.runner.rollout.agent import (
    CALL_ID,
    ENDCALL_ID,
    EOS_ID,
    AgentConfig,
    Episode,
    decode_plain,
    plain_ids,
    run_episode,
)
from mixfleet.runner.rollout.tasks import make_task, split_seeds, task_config, task_names
from mixfleet.runner.rollout.tasks.repo.generator import MODULE
from mixfleet.runner.sampler.engine_api import RequestResult, SamplingParams, TokenOutput

DEMO_WEIGHT_VERSION = "demo"
_REMARKS = ("Let me think.", "Thinking.", "Hmm.", "OK.")
_GUESS_RANGE_RE = re.compile(r"in 1\.\.(\d+)\.")
_GUESS_STEP_RE = re.compile(r"<\|call\|>guess (\d+)<\|endcall\|><\|tool\|>(higher|lower)<\|eos\|>")
_CALC_EXPR_RE = re.compile(r"Compute ([0-9+\-*() ]+)\.")
_CALC_RESULT_RE = re.compile(r"<\|call\|>calc [^<]*<\|endcall\|><\|tool\|>(-?\d+)<\|eos\|>")


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Which demonstrations to make; part of the pretrain cache key."""

    task: str = "guess"
    task_options: tuple[tuple[str, Any], ...] = ()   # (name, value) pairs for make_task (hashable)
    num_episodes: int = 2000
    noise: float = 0.1                     # share of expert replies replaced by a noisy one (see module doc)
    no_call_rate: float = 0.03             # share of replies that are a remark without a tool call
    mental_accuracy: float = 0.3           # calc: share of correct answers made without the calculator
    seed: int = 0

    def __post_init__(self) -> None:
        if self.task not in task_names():
            raise ValueError(f"demos.task: {self.task!r} is not one of {', '.join(task_names())}")
        if self.task not in DEMONSTRATORS and self.task not in EPISODE_DEMONSTRATORS:
            have = ", ".join(sorted({*DEMONSTRATORS, *EPISODE_DEMONSTRATORS}))
            raise ValueError(f"demos.task: no demonstrator for {self.task!r}; have {have}")
        task_config(self.task, **dict(self.task_options))   # validates the options
        if not isinstance(self.num_episodes, int) or self.num_episodes < 1:
            raise ValueError(f"demos.num_episodes: {self.num_episodes!r} must be an integer >= 1")
        for name in ("noise", "no_call_rate", "mental_accuracy"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
                raise ValueError(f"demos.{name}: {v!r} must be a number in [0, 1]")


Demonstrator = Callable[[str, random.Random, DemoConfig], str]


def _call(name: str, args: str) -> str:
    return f"<|call|>{name} {args}<|endcall|>"


def _last_reply_had_no_call(transcript: str) -> bool:
    """True when the last observation was the loop's nudge (a user message after the first prompt)."""
    return transcript.count("<|user|>") > 1 and transcript.rfind("<|user|>") > transcript.rfind("<|tool|>")


def guess_demonstrator(transcript: str, rng: random.Random, config: DemoConfig) -> str:
    """Binary search over what the transcript's answers still allow, with `noise` random feasible guesses."""
    m = _GUESS_RANGE_RE.search(transcript)
    if m is None:
        raise ValueError("guess demonstrator: no '1..N' range in the prompt")
    lo, hi = 1, int(m.group(1))
    for k, answer in _GUESS_STEP_RE.findall(transcript):
        if answer == "higher":
            lo = max(lo, int(k) + 1)
        else:
            hi = min(hi, int(k) - 1)
    if rng.random() < config.no_call_rate and not _last_reply_had_no_call(transcript):
        return rng.choice(_REMARKS) + "<|eos|>"
    k = rng.randint(lo, hi) if rng.random() < config.noise else (lo + hi) // 2
    return _call("guess", str(k))


def calc_demonstrator(transcript: str, rng: random.Random, config: DemoConfig) -> str:
    """calc then answer; with `noise` an answer without the calculator (right `mental_accuracy` of the time)."""
    m = _CALC_EXPR_RE.search(transcript)
    if m is None:
        raise ValueError("calc demonstrator: no 'Compute EXPR.' in the prompt")
    expr = m.group(1)
    results = _CALC_RESULT_RE.findall(transcript)
    if results:
        return _call("answer", results[-1])
    if rng.random() < config.no_call_rate and not _last_reply_had_no_call(transcript):
        return rng.choice(_REMARKS) + "<|eos|>"
    if rng.random() < config.noise:
        from mixfleet.runner.rollout.tasks.calc import evaluate

        value = evaluate(expr)
        if rng.random() >= config.mental_accuracy:
            value += rng.choice((-1, 1)) * rng.randint(1, 10)
        return _call("answer", str(value))
    return _call("calc", expr)


DEMONSTRATORS: dict[str, Demonstrator] = {"guess": guess_demonstrator, "calc": calc_demonstrator}

REPO_TEST = "python3 -m unittest -q 2>&1 | tail -n 6"
REPO_MAX_EDIT_BYTES = 110     # longer python edits are written as sed (the longest sed edit is ~75 bytes)
_SED_RE_SPECIAL = set("\\.*[]^$|")
_SED_REPL_SPECIAL = set("\\&|")


def _sed_escape(text: str, special: set[str]) -> str:
    return "".join("\\" + c if c in special else c for c in text)


def repo_edit_command(old: str, new: str, *, python: bool = False, prefix: bool = False) -> str:
    """A one-line edit of lib.py replacing `old` with `new`: `sed -i 's|..|..|' lib.py` or a `python3 -c`. prefix:
    `old` is the first words of a line, and the sed edit replaces from them to the line's end (`s|OLD.*|NEW|`)."""
    if python:
        if prefix:
            raise ValueError("repo_edit_command: a python edit replaces exact text, not a line's prefix")
        return f"python3 -c \"s=open('lib.py').read();open('lib.py','w').write(s.replace('{old}','{new}'))\""
    return f"sed -i 's|{_sed_escape(old, _SED_RE_SPECIAL)}{'.*' if prefix else ''}|" \
           f"{_sed_escape(new, _SED_REPL_SPECIAL)}|' lib.py"


@dataclass(frozen=True)
class RepoEdit:
    """What a demonstration's edit replaces in lib.py (`repo_line_edit`)."""

    old: str              # the buggy line's first words (prefix) or text that occurs once in lib.py
    new: str              # the fixed line (from its first non-space) or the fixed text
    prefix: bool          # old is a line's prefix: replace from it to the end of its line
    line: str             # the buggy line, from its first non-space
    fixed: str            # that line fixed

    def command(self, *, python: bool = False) -> str:
        """The edit as a command; a python edit replaces the whole line (exact text)."""
        if python:
            return repo_edit_command(self.line, self.fixed, python=True)
        return repo_edit_command(self.old, self.new, prefix=self.prefix)


def repo_line_edit(problem: Any) -> RepoEdit:
    """A demonstration's edit (format 5): the buggy line of lib.py rewritten whole, named by its shortest run of
    first words that lies before the bug and occurs in no other line (`s|return ch .*|return ch * (width -
    len(s)) + s|`); where no such prefix exists, the whole line (exact text) if it occurs once and its edit fits the
    reply cap, else the bug site's own texts.

    A prefix before the bug is the same for every bug on a line, and the fixed line is the function's correct line:
    so a bug at a site never seen in training, on a line whose correct text was written in training, is fixed by
    the same edit. An exact old text must be copied from the look instead (the tiny base recalled training sites'
    texts there)."""
    buggy, fix = problem.buggy_text.rstrip("\n"), problem.fix_text.rstrip("\n")
    module = problem.files[MODULE]
    lines = module.splitlines()
    line = next((ln.strip() for ln in lines if buggy in ln), None)
    if line is None:
        return RepoEdit(buggy, fix, False, buggy, fix)
    fixed = line.replace(buggy, fix, 1)
    words, fixed_words = line.split(" "), fixed.split(" ")
    same = 0
    while same < min(len(words), len(fixed_words)) and words[same] == fixed_words[same]:
        same += 1
    for k in range(1, same + 1):
        head = " ".join(words[:k])
        if sum(head in ln for ln in lines) == 1:
            return RepoEdit(head, fixed, True, line, fixed)
    fits = len(reply_ids(_call("bash", repo_edit_command(line, fixed)))) <= DEMO_REPLY_TOKENS["repo"]
    if module.count(line) == 1 and fits:
        return RepoEdit(line, fixed, False, line, fixed)
    return RepoEdit(buggy, fix, False, line, fixed)


def _repo_plan(problem: Any, rng: random.Random, config: DemoConfig) -> list[str]:
    """The replies of one repo demonstration, drawn up front (see the module docstring)."""
    edit = repo_line_edit(problem)
    # the python edit (the whole line) only where it is short: every reply must fit DEMO_REPLY_TOKENS
    python = rng.random() < 0.25 and len(edit.command(python=True)) <= REPO_MAX_EDIT_BYTES
    look = f'grep -n -A5 "def {problem.function}" lib.py' if rng.random() < 0.5 else "cat lib.py"
    plan: list[str] = []
    if rng.random() >= config.noise:
        plan.append(_call("bash", look))
    if rng.random() >= config.noise:
        plan.append(_call("bash", REPO_TEST))
    if rng.random() < config.noise:
        old = edit.line if python else edit.old
        wrong = old.replace(" ", "  ", 1) if " " in old else old.replace("(", "( ", 1) if "(" in old else "_" + old
        bad = repo_edit_command(wrong, edit.fixed, python=True) if python else \
            repo_edit_command(wrong, edit.new, prefix=edit.prefix)
        plan += [_call("bash", bad), _call("bash", REPO_TEST)]
        if rng.random() < 0.5:
            plan.append(_call("submit", ""))
    plan.append(_call("bash", edit.command(python=python)))
    if rng.random() >= config.noise:
        plan.append(_call("bash", REPO_TEST))
    plan.append(_call("submit", ""))
    return plan


def repo_demonstrator(task: Any, rng: random.Random, config: DemoConfig) -> Callable[[str], str]:
    """The scripted fixer of one repo episode: reads the generator's ground truth (`task.problem`, set by
    areset) at its first reply and plays the plan drawn then."""
    plan: list[str] = []

    def demonstrate(transcript: str) -> str:
        if not plan:
            problem = getattr(task, "problem", None)
            if problem is None:
                raise ValueError("repo demonstrator: needs a generated repository (a task set has no ground truth)")
            plan.extend(_repo_plan(problem, rng, config))
        if rng.random() < config.no_call_rate and not _last_reply_had_no_call(transcript):
            return rng.choice(_REMARKS) + "<|eos|>"
        done = transcript.count("<|endcall|><|tool|>")
        return plan[min(done, len(plan) - 1)]

    return demonstrate


# demonstrators that need the episode's task (its ground truth): factory(task, rng, config) -> transcript -> reply
EPISODE_DEMONSTRATORS: dict[str, Callable[[Any, random.Random, DemoConfig], Callable[[str], str]]] = {
    "repo": repo_demonstrator}
DEMO_REPLY_TOKENS: dict[str, int] = {"repo": 128}   # reply cap of a task's demonstrations (an edit is ~60-110 bytes)


def reply_ids(reply: str) -> list[int]:
    """A demonstrator's reply text to ids: `<|call|>`, `<|endcall|>` and `<|eos|>` as specials, the rest bytes."""
    ids: list[int] = []
    for piece in re.split(r"(<\|call\|>|<\|endcall\|>|<\|eos\|>)", reply):
        if piece == "<|call|>":
            ids.append(CALL_ID)
        elif piece == "<|endcall|>":
            ids.append(ENDCALL_ID)
        elif piece == "<|eos|>":
            ids.append(EOS_ID)
        elif piece:
            ids.extend(plain_ids(piece))
    return ids


def demonstrator_generate(config: DemoConfig, rng: random.Random, task: Any = None):
    """A GenerateFn (runner/rollout/agent.py) that answers with the task's demonstrator (an episode demonstrator
    is made for `task`, the episode's task)."""
    if config.task in EPISODE_DEMONSTRATORS:
        demonstrate = EPISODE_DEMONSTRATORS[config.task](task, rng, config)
    else:
        demonstrator = DEMONSTRATORS[config.task]

        def demonstrate(transcript: str) -> str:
            return demonstrator(transcript, rng, config)

    async def generate(input_ids: list[int], sampling_params: SamplingParams, session_id: str) -> RequestResult:
        ids = reply_ids(demonstrate(decode_plain(input_ids)))[: sampling_params.max_new_tokens]
        stopped = ids[-1] in (ENDCALL_ID, EOS_ID)
        finish = {"type": "stop", "matched": ids[-1]} if stopped else {"type": "length", "length": len(ids)}
        return RequestResult(rid=session_id, output_ids=ids,
                             tokens=[TokenOutput(token_id=i, logprob=0.0, weight_version=DEMO_WEIGHT_VERSION)
                                     for i in ids],
                             finish_reason=finish, prompt_tokens=len(input_ids), cached_tokens=0,
                             weight_version=DEMO_WEIGHT_VERSION, e2e_latency=0.0)

    return generate


DEMO_CONCURRENCY = 4    # episode demonstrations in flight (their sandbox commands overlap; each has its own RNG)
# demonstration format per task, part of the pretrain cache key where set (a task's entry is bumped when its
# demonstrations change meaning; tasks without one keep the keys of the bases already made)
# repo: 2 mutation-operator bug sites, concurrent episodes; 3 whole-line edits; 4 made-up training names; 5 a line
# named by its first words, rewritten whole (repo_line_edit)
DEMO_FORMAT: dict[str, int] = {"repo": 5}


async def agenerate_demos(config: DemoConfig, *, agent: AgentConfig | None = None,
                          on_episode: Callable[[int, int], Any] | None = None) -> list[Episode]:
    """`config.num_episodes` demonstration episodes on seeds drawn from the train split; `on_episode(done,
    total)` after each (progress: the repo task's take about half a second each on a CPU).

    guess / calc: one RNG, episodes one after another (their bases' digests depend on the order). Episode
    demonstrators (repo): each episode draws from its own RNG (`random.Random(f"{seed}:{i}")`) and
    DEMO_CONCURRENCY of them run at once, so their sandbox commands overlap; the episodes come back in seed order,
    the same for the same config."""
    rng = random.Random(config.seed)
    first = rng.randrange(0, 10**8)
    seeds = split_seeds("train", config.num_episodes, offset=first)
    options = dict(config.task_options)
    agent = agent or AgentConfig()
    if agent.sampling.max_new_tokens < DEMO_REPLY_TOKENS.get(config.task, 0):
        agent = replace(agent, sampling=replace(agent.sampling, max_new_tokens=DEMO_REPLY_TOKENS[config.task]))
    done = 0

    async def one(i: int, seed: int, episode_rng: random.Random) -> Episode:
        nonlocal done
        task = make_task(config.task, **options)
        generate = demonstrator_generate(config, episode_rng, task)
        ep = await run_episode(task, seed, generate, config=agent,
                               session_id=f"demo-{config.task}-{i}", clock=lambda: 0.0)
        if ep.finish_reason == "error":
            raise RuntimeError(f"demonstration {i} (seed {seed}) failed: {ep.error}")
        done += 1
        if on_episode is not None:
            on_episode(done, len(seeds))
        return ep

    if config.task not in EPISODE_DEMONSTRATORS:
        return [await one(i, seed, rng) for i, seed in enumerate(seeds)]   # sequential: one RNG
    gate = asyncio.Semaphore(DEMO_CONCURRENCY)

    async def gated(i: int, seed: int) -> Episode:
        async with gate:
            return await one(i, seed, random.Random(f"{config.seed}:{i}"))

    return list(await asyncio.gather(*[gated(i, seed) for i, seed in enumerate(seeds)]))


def generate_demos(config: DemoConfig, *, agent: AgentConfig | None = None,
                   on_episode: Callable[[int, int], Any] | None = None) -> list[Episode]:
    """Synchronous wrapper of agenerate_demos (not for use inside a running event loop)."""
    return asyncio.run(agenerate_demos(config, agent=agent, on_episode=on_episode))


def demo_stats(episodes: list[Episode]) -> dict[str, float]:
    """Mean reward, mean turns, mean tokens and finish-reason shares of a set of episodes."""
    n = len(episodes)
    out: dict[str, float] = {"episodes": float(n), "reward": sum(e.reward for e in episodes) / n,
                             "turns": sum(e.num_turns for e in episodes) / n,
                             "tokens": sum(len(e.tokens) for e in episodes) / n}
    for e in episodes:
        key = f"finish_{e.finish_reason}"
        out[key] = out.get(key, 0.0) + 1.0 / n
    return out
