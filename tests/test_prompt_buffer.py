"""The prompt buffer (policies/prompt_buffer.py) both worlds keep their prompt-groups in: admission, siblings,
the update decision, drops, and one update shape for a plan in the twin and in the runner."""

from __future__ import annotations

from pathlib import Path

from mixfleet.policies.plan import plan_from_dict
from mixfleet.policies.prompt_buffer import PromptBuffer
from mixfleet.policies.registry import make


def _buffer(**settings: object) -> PromptBuffer[tuple[str, int | None]]:
    """Samples are (name, oldest version) pairs."""
    return PromptBuffer(make("batcher", "fifo", settings), lambda s: s[1])


def test_a_group_completes_once_all_its_siblings_are_in() -> None:
    buf = _buffer(prompts_per_update=2, samples_per_prompt=3, inflight_prompts=3)
    groups = buf.admit(trainer_version=0)
    assert [p.prompt_id for p in groups] == [0, 1, 2] and buf.started == 3 and set(buf.inflight) == {0, 1, 2}
    assert buf.admit(trainer_version=0) == []                        # in-flight limit reached
    p = groups[1]
    assert not buf.finish(p, ("a", 0), 1.0) and not buf.abort(p, 2.0)
    assert buf.finish(p, ("b", 0), 3.0)                              # the third sibling completes it
    assert p.completed_at_s == 3.0 and set(buf.complete) == {1} and set(buf.inflight) == {0, 2}
    assert [q.prompt_id for q in buf.admit(trainer_version=0)] == [3]


def test_the_batcher_is_asked_once_an_update_is_complete_and_takes_the_oldest() -> None:
    buf = _buffer(prompts_per_update=2, samples_per_prompt=1, inflight_prompts=8, max_staleness=1, stale="drop")
    g = buf.admit(trainer_version=0)
    buf.finish(g[3], ("d", 0), 1.0)
    assert buf.decide(1.0, trainer_version=2) == (None, [])          # one complete group: not asked yet
    buf.finish(g[0], ("a", 1), 2.0)
    batch, dropped = buf.decide(2.0, trainer_version=2)
    assert batch is None and [p.prompt_id for p in dropped] == [3]   # 2 - 0 > 1: stale; one usable group left
    assert set(buf.complete) == {0}
    buf.finish(g[2], ("c", 2), 3.0)
    buf.finish(g[1], ("b", None), 4.0)                               # no versioned token: the trainer's version
    assert [v.min_version for v in buf.view(4.0, trainer_version=2).groups] == [1, 2, 2]
    batch, dropped = buf.decide(4.0, trainer_version=2)
    assert [p.prompt_id for p in batch] == [0, 2] and dropped == [] and buf.taken == 2   # oldest completed first
    assert set(buf.complete) == {1}


def test_a_plan_without_batch_sizes_gets_the_workloads_in_both_worlds(tmp_path: Path) -> None:
    from mixfleet.costmodel.specs.workload import load_workload
    from mixfleet.runner.orchestration.orchestrator import Orchestrator, RunConfig

    plan = plan_from_dict({"name": "p", "model": "tiny", "workload": "tiny-cpu",
                           "trainer": {"accelerator": "CPU-2core"},
                           "groups": [{"name": "a", "accelerator": "CPU-2core", "precision": "bf16",
                                       "emulated": True}]})
    wl = load_workload("tiny-cpu")
    twin = plan.build_policies(wl)["batcher"].config                 # what twin/sim.py builds
    runner = Orchestrator(plan, RunConfig(out_dir=tmp_path, init_checkpoint="unused")).prompts.batcher.config
    assert (twin.prompts_per_update, twin.samples_per_prompt, twin.inflight_prompts) == (16, 8, 64)
    assert (runner.prompts_per_update, runner.samples_per_prompt, runner.inflight_prompts) == (16, 8, 64)


def test_a_resume_at_the_staleness_bound_admits_again() -> None:
    """Issue 13.1: prompts in flight when the run was killed are not in flight after `--resume`; under
    `stale = "wait"` the restored count used to fill the bound (v + max_staleness + 1) x ppu and nothing started."""
    settings = {"prompts_per_update": 2, "samples_per_prompt": 1, "inflight_prompts": 8, "max_staleness": 1,
                "stale": "wait"}
    buf = _buffer(**settings)
    g = buf.admit(trainer_version=0)
    assert len(g) == 4                                               # (0 + 1 + 1) x 2: at the bound
    for p in g[:2]:
        buf.finish(p, ("s", 0), 1.0)
    batch, _ = buf.decide(1.0, trainer_version=0)
    assert len(batch) == 2
    assert len(buf.admit(trainer_version=1)) == 2                    # version 1: the bound moves to 6
    state = buf.state()                                              # the checkpoint after update 1
    assert state == {"started_prompts": 6, "taken_prompts": 2}
    resumed = _buffer(**settings)
    resumed.restore(state)
    assert [p.prompt_id for p in resumed.admit(trainer_version=1)] == [6, 7, 8, 9]   # 2 trained + 4 <= 6
    old = _buffer(**settings)                                        # a checkpoint without taken_prompts
    old.restore({"version": 1, "started_prompts": 6})
    assert len(old.admit(trainer_version=1)) == 4


def test_a_finished_run_continued_to_more_updates_admits_again() -> None:
    settings = {"prompts_per_update": 1, "samples_per_prompt": 1, "inflight_prompts": 4, "max_staleness": 0,
                "stale": "wait"}
    buf = _buffer(**settings)
    for v in range(3):                                               # three updates, then the run stops
        (p,) = buf.admit(trainer_version=v)
        buf.finish(p, ("s", v), float(v))
        assert len(buf.decide(float(v), trainer_version=v)[0]) == 1
    assert len(buf.admit(trainer_version=3)) == 1                    # in flight when the run finished
    resumed = _buffer(**settings)
    resumed.restore({"version": 3, **buf.state()})
    assert [p.prompt_id for p in resumed.admit(trainer_version=3)] == [4]


def test_dropped_groups_do_not_hold_places_under_the_bound() -> None:
    buf = _buffer(prompts_per_update=1, samples_per_prompt=1, inflight_prompts=4, max_staleness=0, stale="wait",
                  partial="drop")
    (p,) = buf.admit(trainer_version=0)
    buf.abort(p, 1.0)                                                # its only sample failed
    assert buf.decide(1.0, trainer_version=0) == (None, [p]) and buf.lost == 1
    assert [q.prompt_id for q in buf.admit(trainer_version=0)] == [1]   # its place goes to the next prompt
