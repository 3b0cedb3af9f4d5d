"""The agent loop: runs one multi-turn tool-use episode, token in, token out, and records it for the trainer.

The loop owns the token sequence. Every token is appended exactly once and never re-tokenized: the
sampler's output ids go in as they came (with their log-probs and weight versions), and each tool
output is encoded once, as plain bytes, when it arrives. The trainer therefore sees exactly the
tokens the samplers produced, and `loss_mask` marks which ones were generated (1) and which came
from the prompt, the tools or the loop (0).

Chat format (ids of runner/checkpoint/tokenizer.py; TEXT is plain UTF-8 bytes, never special tokens):

    <|user|>TASK PROMPT<|eos|><|assistant|>                         first prompt (mask 0)
    REPLY ... <|call|>NAME ARGS<|endcall|>                           a reply with a tool call (mask 1)
    <|tool|>TOOL OUTPUT<|eos|>                                       the tool's answer (mask 0)
    <|assistant|>                                                    the next turn's prompt (mask 0)
    REPLY WITHOUT A CALL<|eos|>                                      a reply without a tool call (mask 1)
    <|user|>No tool call. Call a tool.<|eos|>                        the loop's nudge (mask 0)
    <|assistant|> ...

A reply ends at the first `<|endcall|>` (passed as a stop token) or `<|eos|>` (always a stop), or
when it runs out of `max_new_tokens`; the stop token belongs to the reply. A reply contains a tool
call when it ends with `<|endcall|>` and holds a `<|call|>` before it; the call is the text between
the last `<|call|>` and the `<|endcall|>`: its first word is the tool's name, the rest its arguments.
Anything before `<|call|>` is free text (thinking). Tool outputs and the nudge are encoded as
bytes only, so a tool can never inject a special token.

An episode ends (`Episode.finish_reason`):
- "done": the task is finished (guess found, calc answered); reward from the task;
- "max_turns": the turn cap (task's `max_turns` unless AgentConfig overrides it) is reached, or
  the context is exhausted (fewer than `min_reply_tokens` left for the next reply, or a tool output
  that does not fit): both are budget truncations, logged alike, `Episode.truncated_by_context` says which;
- "no_tool_call_3x": `max_replies_without_call` (3, the seed's rule) replies in a row without a
  tool call: the collapse sign the ablation study counts;
- "aborted": the sampler aborted a request (partial reply kept, mask 1);
- "error": the generate function or the task raised; `Episode.error` has the message; reward 0.
The reward is read from the task when the episode ends, whatever the reason (0 for "error").
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
from mixfleet.runner.checkpoint.tokenizer import BYTE_OFFSET, SPECIAL_TOKENS
from mixfleet.runner.rollout.tasks.base import Task, ToolCall
from mixfleet.runner.sampler.engine_api import EngineRequest, RequestResult, SamplerEngine, SamplingParams

USER_ID = SPECIAL_TOKENS.index("<|user|>")
ASSISTANT_ID = SPECIAL_TOKENS.index("<|assistant|>")
TOOL_ID = SPECIAL_TOKENS.index("<|tool|>")
CALL_ID = SPECIAL_TOKENS.index("<|call|>")
ENDCALL_ID = SPECIAL_TOKENS.index("<|endcall|>")
EOS_ID = SPECIAL_TOKENS.index("<|eos|>")

FINISH_DONE = "done"
FINISH_MAX_TURNS = "max_turns"
FINISH_NO_TOOL_CALL = "no_tool_call_3x"
FINISH_ABORTED = "aborted"
FINISH_ERROR = "error"
FINISH_REASONS = (FINISH_DONE, FINISH_MAX_TURNS, FINISH_NO_TOOL_CALL, FINISH_ABORTED, FINISH_ERROR)

DEFAULT_NUDGE = "No tool call. Call a tool."


class GenerateFn(Protocol):
    """What the loop calls for each reply: a sampler client, an engine adapter, or a scripted fake.

    Returns a RequestResult (or anything with its `output_ids`, `tokens`, `finish_reason` and
    `weight_version` attributes); an optional `group_id` attribute names the sampler group that served it.
    """

    def __call__(self, input_ids: list[int], sampling_params: SamplingParams,
                 session_id: str) -> Awaitable[RequestResult]: ...


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """How episodes are run; the sampling knobs other than max_new_tokens / stops go in `sampling`."""

    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=48))
    max_turns: int | None = None          # replies per episode; None: the task's own `max_turns`
    context_length: int = 1024            # tokens: prompt + every turn must fit (the model's context)
    min_reply_tokens: int = 8             # tokens: a turn starts only if at least this much room is left
    max_replies_without_call: int = 3     # replies in a row without a tool call that end the episode
    nudge: str = DEFAULT_NUDGE            # the user message after a reply without a tool call

    def __post_init__(self) -> None:
        if self.max_turns is not None and (not isinstance(self.max_turns, int) or self.max_turns < 1):
            raise ValueError(f"agent.max_turns: {self.max_turns!r} must be None or an integer >= 1")
        if not isinstance(self.context_length, int) or self.context_length < 16:
            raise ValueError(f"agent.context_length: {self.context_length!r} must be an integer >= 16")
        if not isinstance(self.min_reply_tokens, int) or not 1 <= self.min_reply_tokens < self.context_length:
            raise ValueError(f"agent.min_reply_tokens: {self.min_reply_tokens!r} must be an integer in "
                             f"[1, context_length)")
        if not isinstance(self.max_replies_without_call, int) or self.max_replies_without_call < 1:
            raise ValueError(f"agent.max_replies_without_call: {self.max_replies_without_call!r} must be an "
                             f"integer >= 1")
        if self.sampling.max_new_tokens < 1:
            raise ValueError(f"agent.sampling.max_new_tokens: {self.sampling.max_new_tokens} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One reply and what followed it; indices are positions in Episode.tokens ([start, end))."""

    reply_start: int
    reply_end: int
    call: ToolCall | None                  # None: the reply had no tool call
    observation: str | None                # tool output or nudge text (None if not appended)
    generate_finish: dict                  # the sampler's finish_reason for this reply
    group_id: str | None


@dataclass(kw_only=True)
class Episode:
    """One finished episode. Per-token lists all have len(tokens) entries; non-generated positions hold
    0.0 / None. `tokens[:prompt_len]` is the first prompt."""

    task: str
    seed: int
    session_id: str
    prompt_len: int
    tokens: list[int]
    loss_mask: list[int]                               # 1 on generated tokens, 0 on prompt / tool / loop tokens
    logprobs: list[float]                              # sampler log-prob of each generated token (full vocab, after T)
    weight_versions: list[str | None]                  # weight version that produced each generated token
    group_ids: list[str | None]                        # sampler group that generated each token
    top_logprobs: list[list[tuple[float, int]] | None]  # top-K (logprob, id) records when the sampler sent them
    mask_ids: list[list[int] | None]                   # kept set under top-p / top-k when sent
    mask_logprobs: list[list[float] | None]            # log-probs renormalized over the kept set
    turns: list[Turn]
    reward: float
    finish_reason: str                                 # one of FINISH_REASONS
    truncated_by_context: bool = False                 # max_turns came from the context budget, not the cap
    error: str | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    # MoE: the sampler's experts of each input position, int32 [len(tokens), layers, top_k], -1 where no
    # record (None when no sampler sent one); row t = the experts token t was routed to when first forwarded
    routed_experts: np.ndarray | None = None
    # seconds spent in the task's environment (reset, tool calls, the reward, close): for a sandboxed task its
    # sandbox start, commands and the submission's tests; wall seconds of this process, not generation
    tool_s: float = 0.0
    # per reply, in order (len == turns): seconds of its tool call in the task's environment (NaN: no call), and
    # tokens appended after it (its tool output or the nudge, wrappers included; 0: nothing appended)
    turn_tool_s: list[float] = field(default_factory=list)
    turn_output_tokens: list[int] = field(default_factory=list)
    # the task's own measurements of its environment when the episode ended (Task.metrics(); the repo task's
    # sandbox starts, pool waits and command seconds); {} for an in-process task
    env_metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def num_tool_calls(self) -> int:
        return sum(t.call is not None for t in self.turns)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def group_id(self) -> str | None:
        """The group that generated most tokens (ties: the first to serve)."""
        counts: dict[str, int] = {}
        for g, m in zip(self.group_ids, self.loss_mask, strict=True):
            if m and g is not None:
                counts[g] = counts.get(g, 0) + 1
        return max(counts, key=lambda g: counts[g]) if counts else None

    def weight_version_span(self) -> tuple[str | None, str | None]:
        """Weight versions of the first and the last generated token."""
        vs = [v for v, m in zip(self.weight_versions, self.loss_mask, strict=True) if m]
        return (vs[0], vs[-1]) if vs else (None, None)

    def tokens_by_version(self) -> dict[str, int]:
        """Generated tokens per weight version (the staleness record)."""
        out: dict[str, int] = {}
        for v, m in zip(self.weight_versions, self.loss_mask, strict=True):
            if m and v is not None:
                out[v] = out.get(v, 0) + 1
        return out

    def summary(self) -> dict[str, Any]:
        """The run log's trajectory fields (costmodel/records/runlog.py TrajectoryRecord names) this episode knows;
        the runner adds run_id, prompt_id, sample_index, replica and converts versions to ints."""
        first, last = self.weight_version_span()
        return {"group": self.group_id, "version_start": first, "version_end": last, "turns": self.num_turns,
                "prompt_tokens": len(self.tokens) - self.num_generated, "generated_tokens": self.num_generated,
                "start_s": self.start_s, "end_s": self.end_s, "reward": self.reward,
                "finish_reason": self.finish_reason, "tokens_by_version": self.tokens_by_version(),
                "task": self.task, "seed": self.seed, "session_id": self.session_id,
                "tool_calls": self.num_tool_calls, "error": self.error}


def plain_ids(text: str) -> list[int]:
    """UTF-8 bytes of `text` as token ids, never special tokens (what tool outputs are encoded as)."""
    return [b + BYTE_OFFSET for b in text.encode("utf-8")]


def decode_plain(ids: list[int]) -> str:
    """Inverse of plain_ids for byte ids; special ids are rendered as their `<|name|>` strings."""
    out: list[str] = []
    buf = bytearray()
    for i in ids:
        if i >= BYTE_OFFSET:
            buf.append(i - BYTE_OFFSET)
        else:
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            out.append(SPECIAL_TOKENS[i])
    out.append(buf.decode("utf-8", errors="replace"))
    return "".join(out)


def first_prompt_ids(task_text: str) -> list[int]:
    """`<|user|>TEXT<|eos|><|assistant|>`."""
    return [USER_ID, *plain_ids(task_text), EOS_ID, ASSISTANT_ID]


def tool_output_ids(output: str) -> list[int]:
    """`<|tool|>OUTPUT<|eos|>`."""
    return [TOOL_ID, *plain_ids(output), EOS_ID]


def nudge_ids(text: str) -> list[int]:
    """`<|user|>TEXT<|eos|>`."""
    return [USER_ID, *plain_ids(text), EOS_ID]


def parse_tool_call(reply_ids: list[int]) -> ToolCall | None:
    """The tool call of a reply, or None: see the module docstring for the rule."""
    if not reply_ids or reply_ids[-1] != ENDCALL_ID:
        return None
    body = reply_ids[:-1]
    try:
        start = len(body) - 1 - body[::-1].index(CALL_ID)
    except ValueError:
        return None
    text = decode_plain(body[start + 1:]).strip()
    parts = text.split(maxsplit=1)
    return ToolCall(name=parts[0] if parts else "", args=parts[1].strip() if len(parts) > 1 else "")


class _Recorder:
    """Accumulates the per-token arrays as tokens are appended (each exactly once)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.weight_versions: list[str | None] = []
        self.group_ids: list[str | None] = []
        self.top_logprobs: list[list[tuple[float, int]] | None] = []
        self.mask_ids: list[list[int] | None] = []
        self.mask_logprobs: list[list[float] | None] = []
        self.routed: np.ndarray | None = None       # [capacity, layers, top_k] int32, -1 = none
        self.routed_upto = 0                        # positions [0, routed_upto) have their first record

    def add_routing(self, rows: Any) -> None:
        """A response's routed experts: rows [n, layers, top_k] of the positions [P - n, P), P = len(tokens) - 1
        (SGLang's record ends before the last sampled token, which is never forwarded). The first record of a
        position wins: later turns re-send their prompt's positions (prefix reuse keeps the first routing)."""
        arr = np.asarray(rows.cpu() if hasattr(rows, "cpu") else rows, dtype=np.int32)
        end = len(self.tokens) - 1
        if arr.ndim != 3 or arr.shape[0] > max(end, 0):
            raise ValueError(f"routed experts of shape {arr.shape}; expected [n <= {max(end, 0)}, layers, top_k]")
        if self.routed is None or self.routed.shape[1:] != arr.shape[1:]:
            if self.routed is not None:
                raise ValueError(f"routed experts [.., {arr.shape[1]}, {arr.shape[2]}] differ from this episode's "
                                 f"[.., {self.routed.shape[1]}, {self.routed.shape[2]}]")
            self.routed = np.full((0, *arr.shape[1:]), -1, dtype=np.int32)
        if self.routed.shape[0] < end:
            grow = np.full((end - self.routed.shape[0], *arr.shape[1:]), -1, dtype=np.int32)
            self.routed = np.concatenate([self.routed, grow])
        start = end - arr.shape[0]
        lo = max(start, self.routed_upto)
        if lo < end:
            self.routed[lo:end] = arr[lo - start:]
            self.routed_upto = end

    def routed_experts(self) -> np.ndarray | None:
        if self.routed is None:
            return None
        out = np.full((len(self.tokens), *self.routed.shape[1:]), -1, dtype=np.int32)
        out[: self.routed.shape[0]] = self.routed
        return out

    def add_context(self, ids: list[int]) -> None:
        n = len(ids)
        self.tokens.extend(ids)
        self.loss_mask.extend([0] * n)
        self.logprobs.extend([0.0] * n)
        for lst in (self.weight_versions, self.group_ids, self.top_logprobs, self.mask_ids, self.mask_logprobs):
            lst.extend([None] * n)

    def add_generated(self, result: Any, group_id: str | None) -> list[int]:
        ids = [int(i) for i in result.output_ids]
        outs = list(result.tokens)
        if len(outs) != len(ids):
            raise ValueError(f"sampler returned {len(ids)} output ids but {len(outs)} per-token records "
                             f"(request log-probs: return_logprob=True)")
        for i, t in zip(ids, outs, strict=True):
            if int(t.token_id) != i:
                raise ValueError(f"sampler record token_id {t.token_id} differs from output id {i}")
            if not math.isfinite(float(t.logprob)):
                raise ValueError(f"sampler log-prob {t.logprob} of token {i} is not finite")
            self.tokens.append(i)
            self.loss_mask.append(1)
            self.logprobs.append(float(t.logprob))
            self.weight_versions.append(str(t.weight_version))
            self.group_ids.append(group_id)
            self.top_logprobs.append(list(t.top_logprobs) if t.top_logprobs else None)
            self.mask_ids.append(list(t.mask_ids) if t.mask_ids is not None else None)
            self.mask_logprobs.append(list(t.mask_logprobs) if t.mask_logprobs is not None else None)
        routed = getattr(result, "routed_experts", None)
        if routed is not None:
            self.add_routing(routed)
        return ids


class _Stopwatch:
    """Adds the wall seconds of each `with` block to `total_s` (also when the block raises)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._t0 = 0.0

    def __enter__(self) -> _Stopwatch:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.total_s += time.perf_counter() - self._t0


async def run_episode(task: Task, seed: int, generate: GenerateFn, *, config: AgentConfig | None = None,
                      session_id: str | None = None, group_id: str | None = None,
                      clock: Callable[[], float] = time.time) -> Episode:
    """Run one episode of a fresh `task` on problem `seed` with `generate`; never raises for a failed
    generate or tool call (finish reason "error" instead); cancellation propagates.

    `group_id` labels the tokens when the result carries no `group_id` of its own. Each reply's
    sampling params are `config.sampling` with max_new_tokens clipped to the context left, `<|endcall|>`
    added to the stop ids and, when `config.sampling.sampling_seed` is set, seed + turn index as its seed.
    """
    config = config or AgentConfig()
    session_id = session_id or f"{task.name}-{seed}-{uuid.uuid4().hex[:12]}"
    max_turns = config.max_turns if config.max_turns is not None else task.max_turns
    rec = _Recorder()
    turns: list[Turn] = []
    finish, error, by_context = FINISH_MAX_TURNS, None, False
    start = clock()
    prompt_len = 0
    in_tools = _Stopwatch()                   # seconds in the task's environment (Episode.tool_s)
    turn_tool_s: list[float] = []
    turn_output_tokens: list[int] = []
    try:
        with in_tools:
            prompt_text = await task.areset(seed)
        prompt = first_prompt_ids(prompt_text)
        if len(prompt) + config.min_reply_tokens > config.context_length:
            raise ValueError(f"the task prompt ({len(prompt)} tokens) leaves less than min_reply_tokens "
                             f"({config.min_reply_tokens}) of the {config.context_length}-token context")
        rec.add_context(prompt)
        prompt_len = len(prompt)
        stops = tuple(dict.fromkeys((*config.sampling.stop_token_ids, ENDCALL_ID)))
        without_call = 0
        for turn in range(max_turns):
            if turn > 0:
                if len(rec.tokens) + 1 + config.min_reply_tokens > config.context_length:
                    finish, by_context = FINISH_MAX_TURNS, True
                    break
                rec.add_context([ASSISTANT_ID])
            room = config.context_length - len(rec.tokens)
            seed_t = None if config.sampling.sampling_seed is None else config.sampling.sampling_seed + turn
            params = replace(config.sampling, max_new_tokens=min(config.sampling.max_new_tokens, room),
                             stop_token_ids=stops, sampling_seed=seed_t)
            result = await generate(list(rec.tokens), params, session_id)
            served_by = getattr(result, "group_id", None) or group_id
            reply_start = len(rec.tokens)
            reply = rec.add_generated(result, served_by)
            gen_finish = dict(result.finish_reason)
            if gen_finish.get("type") == "abort":
                turns.append(Turn(reply_start=reply_start, reply_end=len(rec.tokens), call=None, observation=None,
                                  generate_finish=gen_finish, group_id=served_by))
                turn_tool_s.append(math.nan)
                turn_output_tokens.append(0)
                finish = FINISH_ABORTED
                break
            call = parse_tool_call(reply)
            done = False
            call_s = math.nan
            if call is None:
                without_call += 1
                observation = config.nudge
                obs_ids = nudge_ids(observation)
            else:
                without_call = 0
                t_call = time.perf_counter()
                with in_tools:
                    step = await task.astep(call)
                call_s = time.perf_counter() - t_call
                observation = step.output
                obs_ids = tool_output_ids(observation)
                done = step.done or task.done
            last = done or (call is None and without_call >= config.max_replies_without_call) or turn == max_turns - 1
            fits = len(rec.tokens) + len(obs_ids) <= config.context_length
            # the final observation is kept when it fits; a non-final one that does not fit ends the episode
            if fits and (call is not None or not last):
                rec.add_context(obs_ids)
            else:
                observation = None
            turn_tool_s.append(call_s)
            turn_output_tokens.append(len(obs_ids) if observation is not None else 0)
            turns.append(Turn(reply_start=reply_start, reply_end=reply_start + len(reply), call=call,
                              observation=observation, generate_finish=gen_finish, group_id=served_by))
            if done:
                finish = FINISH_DONE
                break
            if call is None and without_call >= config.max_replies_without_call:
                finish = FINISH_NO_TOOL_CALL
                break
            if turn == max_turns - 1:
                break                                   # the turn cap: finish stays "max_turns"
            if not fits:
                finish, by_context = FINISH_MAX_TURNS, True
                break
        with in_tools:
            reward = float(task.reward())
    except Exception as e:  # noqa: BLE001 - any failure of the sampler or the tool ends this episode only
        finish, error, reward = FINISH_ERROR, f"{type(e).__name__}: {e}", 0.0
    finally:
        try:
            with in_tools:
                await task.aclose()
        except Exception as e:  # noqa: BLE001
            if error is None:
                finish, error, reward = FINISH_ERROR, f"close: {type(e).__name__}: {e}", 0.0
    return Episode(task=task.name, seed=seed, session_id=session_id, prompt_len=prompt_len, tokens=rec.tokens,
                   loss_mask=rec.loss_mask, logprobs=rec.logprobs, weight_versions=rec.weight_versions,
                   group_ids=rec.group_ids, top_logprobs=rec.top_logprobs, mask_ids=rec.mask_ids,
                   mask_logprobs=rec.mask_logprobs, turns=turns, reward=reward, finish_reason=finish,
                   truncated_by_context=by_context, error=error, start_s=start, end_s=clock(),
                   routed_experts=rec.routed_experts(), tool_s=in_tools.total_s, turn_tool_s=turn_tool_s,
                   turn_output_tokens=turn_output_tokens, env_metrics=_env_metrics(task))


def _env_metrics(task: Task) -> dict[str, Any]:
    """Task.metrics() of the finished episode; {} when the task has none or it fails (the episode stands)."""
    metrics = getattr(task, "metrics", None)
    try:
        return dict(metrics()) if callable(metrics) else {}
    except Exception:  # noqa: BLE001 - a measurement must not fail an episode
        return {}


def engine_generate(engine: SamplerEngine, *, return_logprob: bool = True, top_logprobs_num: int = 0,
                    return_sampling_mask: bool = False) -> GenerateFn:
    """A GenerateFn over an in-process SamplerEngine (runner/engine) whose step loop runs on another thread.

    Each call queues one EngineRequest (rid = session id + a counter) and awaits its RequestResult,
    delivered from the engine thread to the caller's event loop.
    """
    counter = itertools.count()

    async def generate(input_ids: list[int], sampling_params: SamplingParams, session_id: str) -> RequestResult:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[RequestResult] = loop.create_future()

        def deliver(result: RequestResult) -> None:
            if not fut.done():
                fut.set_result(result)

        req = EngineRequest(rid=f"{session_id}#{next(counter)}", input_ids=list(input_ids), params=sampling_params,
                            return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                            return_sampling_mask=return_sampling_mask, session_id=session_id)
        engine.add_request(req, on_finish=lambda r: loop.call_soon_threadsafe(deliver, r))
        return await fut

    return generate
