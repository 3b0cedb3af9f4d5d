"""Synthetic demonstrations: the scripted demonstrators through the real agent loop.

Covers: noise-free demonstrators solve every problem (binary search within the cap, calculator then
answer); the noise knobs lower the reward the way the module says; demonstrations are reproducible
from their config; their format is the agent loop's (tool calls parse, loss mask on replies only).
"""

from __future__ import annotations

from mixfleet.runner.rollout.agent import CALL_ID, ENDCALL_ID, parse_tool_call
from mixfleet.runner.rollout.demos import DemoConfig, demo_stats, generate_demos


def test_noise_free_demonstrators_solve_everything() -> None:
    for task, opts in (("guess", (("n_max", 50), ("max_turns", 6))), ("guess", (("n_max", 1000), ("max_turns", 10))),
                       ("calc", ())):
        eps = generate_demos(DemoConfig(task=task, task_options=opts, num_episodes=150, noise=0.0, no_call_rate=0.0))
        assert all(e.finish_reason == "done" and e.reward == 1.0 for e in eps), task
        assert all(t.call is not None for e in eps for t in e.turns)
    calc = generate_demos(DemoConfig(task="calc", num_episodes=20, noise=0.0, no_call_rate=0.0))
    assert [t.call.name for t in calc[0].turns] == ["calc", "answer"]


def test_noise_lowers_the_reward() -> None:
    guess = [demo_stats(generate_demos(DemoConfig(num_episodes=300, noise=n, no_call_rate=0.0,
                                                  task_options=(("max_turns", 6),))))["reward"]
             for n in (0.0, 0.5, 1.0)]
    assert guess[0] == 1.0 and guess[0] > guess[1] > guess[2] > 0.2
    calc = demo_stats(generate_demos(DemoConfig(task="calc", num_episodes=300, noise=1.0, mental_accuracy=0.0,
                                                 no_call_rate=0.0)))
    assert calc["reward"] == 0.0 and calc["turns"] == 1.0


def test_remarks_without_a_call_are_followed_by_a_call() -> None:
    eps = generate_demos(DemoConfig(num_episodes=200, no_call_rate=0.5, seed=2))
    assert all(e.finish_reason != "no_tool_call_3x" for e in eps)
    for e in eps:
        calls = [t.call is not None for t in e.turns]
        assert not any(a is False and b is False for a, b in zip(calls, calls[1:], strict=False))
    assert any(t.call is None for e in eps for t in e.turns)


def test_demonstrations_are_reproducible_and_well_formed() -> None:
    a = generate_demos(DemoConfig(num_episodes=30, seed=5))
    b = generate_demos(DemoConfig(num_episodes=30, seed=5))
    c = generate_demos(DemoConfig(num_episodes=30, seed=6))
    assert [e.tokens for e in a] == [e.tokens for e in b] and [e.tokens for e in a] != [e.tokens for e in c]
    for e in a:
        for t in e.turns:
            reply = e.tokens[t.reply_start:t.reply_end]
            assert e.loss_mask[t.reply_start:t.reply_end] == [1] * len(reply)
            if t.call is not None:
                assert reply[0] == CALL_ID and reply[-1] == ENDCALL_ID and parse_tool_call(reply) == t.call
        assert sum(e.loss_mask) == sum(t.reply_end - t.reply_start for t in e.turns)
