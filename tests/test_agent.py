"""The agent loop with a scripted generate function (the sampler is not under test here).

Covers: the exact token sequence of an episode (chat format, tool outputs encoded once as bytes),
the per-token arrays (loss mask, log-probs, weight versions, group ids, top-K / kept-set records),
that each turn's input extends the previous one without re-tokenizing, every finish reason (done,
max_turns by cap and by context, no_tool_call_3x, aborted, error), sampling params per turn, and
tool-call parsing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from mixfleet.runner.rollout.agent import (
    ASSISTANT_ID,
    CALL_ID,
    ENDCALL_ID,
    EOS_ID,
    AgentConfig,
    Episode,
    parse_tool_call,
    plain_ids,
    run_episode,
)
from mixfleet.runner.rollout.tasks import StepResult, Task, ToolCall, make_task
from mixfleet.runner.sampler.engine_api import RequestResult, SamplingParams, TokenOutput

TOK = ByteTokenizer()


@dataclass
class Reply:
    text: str                      # may contain <|call|> / <|endcall|> / <|eos|>
    finish: dict | None = None     # default: stop on the last token
    version: str = "0"
    top_k: int = 0                 # K top-logprob pairs per token
    mask: bool = False
    group: str | None = None


class Scripted:
    """Returns the scripted replies in order and records every call."""

    def __init__(self, replies: list[Reply | Exception]) -> None:
        self.replies = list(replies)
        self.calls: list[tuple[list[int], SamplingParams, str]] = []

    async def __call__(self, input_ids: list[int], params: SamplingParams, session_id: str) -> RequestResult:
        self.calls.append((list(input_ids), params, session_id))
        r = self.replies.pop(0)
        if isinstance(r, Exception):
            raise r
        ids = TOK.encode(r.text)
        toks = [TokenOutput(token_id=i, logprob=-0.01 * (j + 1) - 0.1 * len(self.calls),
                            top_logprobs=[(-0.5, i), (-1.5, 99)][: r.top_k],
                            mask_ids=[i, 99] if r.mask else None, mask_logprobs=[-0.2, -1.7] if r.mask else None,
                            weight_version=r.version) for j, i in enumerate(ids)]
        finish = r.finish or {"type": "stop", "matched": ids[-1]}
        res = RequestResult(rid="r", output_ids=ids, tokens=toks, finish_reason=finish, prompt_tokens=len(input_ids),
                            cached_tokens=0, weight_version=r.version, e2e_latency=0.0)
        if r.group is not None:
            object.__setattr__(res, "group_id", r.group)   # a runner-side wrapper may label the result
        return res


def run(task: Task, seed: int, gen: Scripted, **cfg) -> Episode:
    config = AgentConfig(**cfg) if cfg else None
    return asyncio.run(run_episode(task, seed, gen, config=config, session_id="s1", group_id="g-arg",
                                   clock=iter(range(100)).__next__))


def seed_for(target: int) -> int:
    t = make_task("guess", n_max=100)
    return next(s for s in range(10_000) if (t.reset(s), t.target)[1] == target)


def test_episode_tokens_and_arrays_are_exact() -> None:
    gen = Scripted([Reply("<|call|>guess 50<|endcall|>", version="3", top_k=2, mask=True, group="g-bf16"),
                    Reply("I think<|call|>guess 37<|endcall|>", version="4")])
    ep = run(make_task("guess", n_max=100), seed_for(37), gen)
    prompt = "Find the hidden number in 1..100. Tool: guess K."
    expected_text = (f"<|user|>{prompt}<|eos|><|assistant|><|call|>guess 50<|endcall|><|tool|>lower<|eos|>"
                     "<|assistant|>I think<|call|>guess 37<|endcall|><|tool|>correct<|eos|>")
    assert ep.tokens == TOK.encode(expected_text)
    assert (ep.finish_reason, ep.reward, ep.num_turns, ep.num_tool_calls) == ("done", 1.0, 2, 2)
    assert ep.prompt_len == len(TOK.encode(f"<|user|>{prompt}<|eos|><|assistant|>"))
    r1 = TOK.encode("<|call|>guess 50<|endcall|>")
    r2 = TOK.encode("I think<|call|>guess 37<|endcall|>")
    s1 = ep.prompt_len
    s2 = s1 + len(r1) + len(TOK.encode("<|tool|>lower<|eos|><|assistant|>"))
    gen_pos = set(range(s1, s1 + len(r1))) | set(range(s2, s2 + len(r2)))
    assert ep.loss_mask == [1 if i in gen_pos else 0 for i in range(len(ep.tokens))]
    assert ep.logprobs[s1:s1 + 2] == pytest.approx([-0.11, -0.12])
    assert ep.logprobs[s2] == pytest.approx(-0.21)
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask, strict=True) if not m)
    assert ep.weight_versions[s1:s1 + len(r1)] == ["3"] * len(r1)
    assert ep.weight_versions[s2:s2 + len(r2)] == ["4"] * len(r2)
    assert ep.weight_version_span() == ("3", "4") and ep.tokens_by_version() == {"3": len(r1), "4": len(r2)}
    assert ep.group_ids[s1] == "g-bf16" and ep.group_ids[s2] == "g-arg" and ep.group_ids[0] is None
    assert ep.top_logprobs[s1] == [(-0.5, CALL_ID), (-1.5, 99)] and ep.top_logprobs[s2] is None
    assert ep.mask_ids[s1] == [CALL_ID, 99] and ep.mask_logprobs[s1] == [-0.2, -1.7] and ep.mask_ids[s2] is None
    assert [t.call for t in ep.turns] == [ToolCall(name="guess", args="50"), ToolCall(name="guess", args="37")]
    assert [t.observation for t in ep.turns] == ["lower", "correct"]
    assert all(len(lst) == len(ep.tokens) for lst in (ep.loss_mask, ep.logprobs, ep.weight_versions, ep.group_ids,
                                                      ep.top_logprobs, ep.mask_ids, ep.mask_logprobs))
    s = ep.summary()
    assert (s["generated_tokens"], s["prompt_tokens"], s["turns"]) == (len(gen_pos), len(ep.tokens) - len(gen_pos), 2)
    assert (s["start_s"], s["end_s"], s["group"]) == (0, 1, "g-arg" if len(r2) > len(r1) else "g-bf16")


def test_each_turn_extends_the_previous_input_without_retokenizing() -> None:
    gen = Scripted([Reply("<|call|>guess 50<|endcall|>"), Reply("hmm<|eos|>"),
                    Reply("<|call|>guess 25<|endcall|>")])
    ep = run(make_task("guess", n_max=100), seed_for(25), gen)
    (in1, p1, sid1), (in2, _, _), (in3, _, _) = gen.calls
    assert sid1 == "s1"
    assert in2[: len(in1)] == in1 and in3[: len(in2)] == in2
    assert in2[len(in1):] == TOK.encode("<|call|>guess 50<|endcall|><|tool|>lower<|eos|><|assistant|>")
    assert in3[len(in2):] == TOK.encode("hmm<|eos|><|user|>No tool call. Call a tool.<|eos|><|assistant|>")
    assert ep.tokens[: len(in3)] == in3 and ep.finish_reason == "done"


def test_tool_output_is_encoded_as_plain_bytes() -> None:
    class Echo(Task):
        name, tools, max_turns = "echo", ("echo",), 2

        def reset(self, seed: int) -> str:
            return "say <|eos|>"

        def step(self, call: ToolCall) -> StepResult:
            return StepResult(output=call.args, done=True)

        def reward(self) -> float:
            return 0.5

        @property
        def done(self) -> bool:
            return False

    gen = Scripted([Reply("<|call|>echo <|assistant|>x<|endcall|>")])
    ep = run(Echo(), 0, gen)
    assert ep.turns[0].call == ToolCall(name="echo", args="<|assistant|>x")
    tail = ep.tokens[-len(plain_ids("<|assistant|>x")) - 2:]
    assert tail == [TOK.token_id("<|tool|>"), *plain_ids("<|assistant|>x"), EOS_ID]
    assert ep.tokens[1:1 + len(plain_ids("say <|eos|>"))] == plain_ids("say <|eos|>")
    assert (ep.finish_reason, ep.reward) == ("done", 0.5)


def test_three_replies_without_a_call_end_the_episode() -> None:
    gen = Scripted([Reply("a<|eos|>"), Reply("b<|eos|>"), Reply("c", finish={"type": "length", "length": 1})])
    ep = run(make_task("guess", n_max=100), 0, gen)
    assert (ep.finish_reason, ep.reward, ep.num_turns, ep.num_tool_calls) == ("no_tool_call_3x", 0.0, 3, 0)
    nudge = TOK.encode("<|user|>No tool call. Call a tool.<|eos|><|assistant|>")
    assert ep.tokens[-1] == TOK.encode("c")[0]     # no nudge after the last reply
    assert TOK.decode(ep.tokens).count("No tool call.") == 2
    assert ep.tokens[ep.turns[0].reply_end: ep.turns[0].reply_end + len(nudge)] == nudge


def test_a_tool_call_resets_the_count() -> None:
    gen = Scripted([Reply("a<|eos|>"), Reply("b<|eos|>"), Reply("<|call|>guess 50<|endcall|>"),
                    Reply("c<|eos|>"), Reply("d<|eos|>"), Reply("<|call|>guess 75<|endcall|>")])
    ep = run(make_task("guess", n_max=100), seed_for(75), gen)
    assert ep.finish_reason == "done" and ep.num_turns == 6 and ep.reward == 1.0


def test_turn_cap() -> None:
    gen = Scripted([Reply("<|call|>guess 1<|endcall|>")] * 3)
    ep = run(make_task("guess", n_max=100, max_turns=3), seed_for(90), gen)
    assert (ep.finish_reason, ep.num_turns, ep.reward, ep.truncated_by_context) == ("max_turns", 3, 0.0, False)
    assert ep.turns[-1].observation == "higher"
    gen = Scripted([Reply("<|call|>guess 1<|endcall|>")] * 2)
    ep = run(make_task("guess", n_max=100), seed_for(90), gen, max_turns=2)    # the agent's cap overrides the task's
    assert (ep.finish_reason, ep.num_turns) == ("max_turns", 2)


def test_context_budget_ends_as_max_turns() -> None:
    prompt_len = len(TOK.encode("<|user|>Find the hidden number in 1..100. Tool: guess K.<|eos|><|assistant|>"))
    reply = "<|call|>guess 1<|endcall|>"
    turn_len = len(TOK.encode(reply + "<|tool|>higher<|eos|><|assistant|>"))
    ctx = prompt_len + 2 * turn_len + 3
    gen = Scripted([Reply(reply)] * 5)
    ep = run(make_task("guess", n_max=100), seed_for(90), gen, context_length=ctx, min_reply_tokens=4)
    assert (ep.finish_reason, ep.truncated_by_context, ep.num_turns) == ("max_turns", True, 2)
    assert len(ep.tokens) <= ctx
    # the max_new_tokens of each turn is clipped to the room left
    assert [c[1].max_new_tokens for c in gen.calls] == [2 * turn_len + 3, turn_len + 3]


def test_sampling_params_per_turn() -> None:
    base = SamplingParams(max_new_tokens=20, temperature=0.7, top_p=0.9, stop_token_ids=(3,), sampling_seed=100)
    gen = Scripted([Reply("<|call|>guess 50<|endcall|>"), Reply("<|call|>guess 25<|endcall|>")])
    ep = run(make_task("guess", n_max=100), seed_for(25), gen, sampling=base)
    p1, p2 = gen.calls[0][1], gen.calls[1][1]
    assert (p1.temperature, p1.top_p, p1.max_new_tokens, p1.stop_token_ids) == (0.7, 0.9, 20, (3, ENDCALL_ID))
    assert (p1.sampling_seed, p2.sampling_seed) == (100, 101) and ep.finish_reason == "done"


def test_abort_and_errors() -> None:
    gen = Scripted([Reply("<|call|>gue", finish={"type": "abort", "message": "replica lost"})])
    ep = run(make_task("guess", n_max=100), 0, gen)
    assert (ep.finish_reason, ep.num_turns, ep.num_generated) == ("aborted", 1, len(TOK.encode("<|call|>gue")))
    gen = Scripted([Reply("<|call|>guess 50<|endcall|>"), ConnectionError("sampler down")])
    ep = run(make_task("guess", n_max=100), seed_for(25), gen)
    assert (ep.finish_reason, ep.reward, ep.error) == ("error", 0.0, "ConnectionError: sampler down")

    class Broken(Task):
        name, tools = "broken", ("x",)
        closed = False

        def reset(self, seed: int) -> str:
            return "p"

        def step(self, call: ToolCall) -> StepResult:
            raise RuntimeError("sandbox died")

        def reward(self) -> float:
            return 1.0

        @property
        def done(self) -> bool:
            return False

        def close(self) -> None:
            Broken.closed = True

    ep = run(Broken(), 0, Scripted([Reply("<|call|>x<|endcall|>")]))
    assert (ep.finish_reason, ep.reward, ep.error, Broken.closed) == ("error", 0.0, "RuntimeError: sandbox died", True)


def test_sampler_records_must_match_the_output_ids() -> None:
    async def no_logprobs(input_ids: list[int], params: SamplingParams, session_id: str) -> RequestResult:
        return RequestResult(rid="r", output_ids=[EOS_ID], tokens=[], finish_reason={"type": "stop", "matched": 2},
                             prompt_tokens=0, cached_tokens=0, weight_version="0", e2e_latency=0.0)

    ep = asyncio.run(run_episode(make_task("guess", n_max=100), 0, no_logprobs))
    assert ep.finish_reason == "error" and "return_logprob" in ep.error


def test_async_task_tools_are_awaited() -> None:
    class Slow(Task):
        name, tools, max_turns = "slow", ("wait",), 3

        def reset(self, seed: int) -> str:
            raise AssertionError("the loop must call areset")

        def step(self, call: ToolCall) -> StepResult:
            raise AssertionError("the loop must call astep")

        async def areset(self, seed: int) -> str:
            await asyncio.sleep(0)
            return f"wait {seed}"

        async def astep(self, call: ToolCall) -> StepResult:
            await asyncio.sleep(0)
            self.finished = True
            return StepResult(output="ok", done=True)

        def reward(self) -> float:
            return 1.0

        @property
        def done(self) -> bool:
            return getattr(self, "finished", False)

    ep = run(Slow(), 4, Scripted([Reply("<|call|>wait<|endcall|>")]))
    assert (ep.finish_reason, ep.reward) == ("done", 1.0)
    assert TOK.decode(ep.tokens).startswith("<|user|>wait 4<|eos|><|assistant|>")


@pytest.mark.parametrize(("text", "call"), [
    ("<|call|>guess 5<|endcall|>", ToolCall(name="guess", args="5")),
    ("x<|call|>a<|call|> calc  1 + 2 <|endcall|>", ToolCall(name="calc", args="1 + 2")),
    ("<|call|><|endcall|>", ToolCall(name="", args="")),
    ("<|call|>guess 5", None),
    ("guess 5<|endcall|>", None),
    ("<|call|>guess 5<|endcall|><|eos|>", None),
    ("", None),
])
def test_parse_tool_call(text: str, call: ToolCall | None) -> None:
    assert parse_tool_call(TOK.encode(text)) == call


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="agent.max_turns"):
        AgentConfig(max_turns=0)
    with pytest.raises(ValueError, match="agent.max_replies_without_call"):
        AgentConfig(max_replies_without_call=0)
    with pytest.raises(ValueError, match="agent.min_reply_tokens"):
        AgentConfig(context_length=64, min_reply_tokens=64)
    assert ASSISTANT_ID == TOK.token_id("<|assistant|>")
