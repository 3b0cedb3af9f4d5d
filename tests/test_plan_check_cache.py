"""The planner's twin checks on this machine's cores and cached by their inputs' digest (issue 43 item 4): the
default map gives the same verified figures, bit for bit, as the sequential reference; asked again, it reads every
check back from the cache and plans the same; a changed input (the seed) misses; MIXFLEET_NO_CACHE turns it off.
The tiny model on the tiny-cpu workload, 2 candidates x 2 seeds of 3 updates: seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.search import plan_mix, sequential_map
from mixfleet.twin.checks import cache_dir, cached_map, default_map, job_digest, local_map, twin_check

CFG = PlannerConfig(model="tiny", workload="tiny-cpu", accelerators=("H100", "A100-80GB"),
                    max_gpus={"H100": 4, "A100-80GB": 2}, trainer_accelerator="H100", trainer_gpus=1,
                    verify=2, verify_seeds=2, verify_updates=3)


def _same(a, b) -> None:  # noqa: ANN001
    assert [c.replicas for c in a.verified] == [c.replicas for c in b.verified]
    assert [c.verified for c in a.verified] == [c.verified for c in b.verified]      # bit-identical figures
    assert a.best == b.best and a.plan.to_dict() == b.plan.to_dict()


def test_default_map_matches_sequential_and_reads_the_cache_back(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIXFLEET_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MIXFLEET_NO_CACHE", raising=False)
    ref = plan_mix(CFG, check=twin_check, check_map=sequential_map)
    first = plan_mix(CFG, check=twin_check, check_map=default_map)
    _same(ref, first)
    assert first.checks["cached"] == 0 and first.checks["tasks"] == 4
    assert len(list((tmp_path / "twin-checks").glob("*.json"))) == 4
    again = plan_mix(CFG, check=twin_check, check_map=default_map)
    _same(ref, again)
    assert again.checks["cached"] == 4 and again.checks["mode"] == "cache"

    other = plan_mix(PlannerConfig(**{**{f: getattr(CFG, f) for f in ("model", "workload", "accelerators", "max_gpus",
                                                                       "trainer_accelerator", "trainer_gpus", "verify",
                                                                       "verify_seeds", "verify_updates")}, "seed": 5}),
                     check=twin_check, check_map=default_map)
    assert other.checks["cached"] == 0   # other seeds: other checks

    monkeypatch.setenv("MIXFLEET_NO_CACHE", "1")
    off = plan_mix(CFG, check=twin_check, check_map=default_map)
    _same(ref, off)
    assert off.checks["cached"] == 0


def test_local_map_runs_jobs_in_processes_in_order() -> None:
    from mixfleet.policies.plan import load_plan

    plan = load_plan("tiny-cpu").to_dict()
    jobs = [(plan, 2, 0), (plan, 2, 1), (plan, 2, 0)]
    got, info = local_map(twin_check, jobs, workers=2)
    want, _ = sequential_map(twin_check, jobs)
    same = [json.dumps(r, sort_keys=True) for r in got]    # NaN half-widths of a short run: compared as text
    assert same == [json.dumps(r, sort_keys=True) for r in want] and info["mode"] == "processes"
    assert info["workers"] == 2 and same[0] == same[2] != same[1]
    assert job_digest(twin_check, jobs[0]) == job_digest(twin_check, jobs[2]) != job_digest(twin_check, jobs[1])


def test_a_spec_file_named_by_path_is_part_of_the_key(tmp_path: Path) -> None:
    spec = tmp_path / "w.toml"
    spec.write_text("a = 1\n")
    k1 = job_digest(twin_check, ({"workload": str(spec)}, 2, 0))
    spec.write_text("a = 2\n")
    assert job_digest(twin_check, ({"workload": str(spec)}, 2, 0)) != k1


def test_an_unwritable_cache_only_costs_the_speed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MIXFLEET_CACHE_DIR", str(blocker))    # twin-checks/ cannot be made under a file
    monkeypatch.delenv("MIXFLEET_NO_CACHE", raising=False)
    calls = []

    def fn(x: int) -> dict[str, int]:
        calls.append(x)
        return {"x": x * 2}

    got, info = cached_map(lambda f, jobs: sequential_map(f, jobs))(fn, [(1,), (2,)])
    assert got == [{"x": 2}, {"x": 4}] and calls == [1, 2] and info["cached"] == 0


def test_one_cache_folder_moves_every_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`$MIXFLEET_CACHE` moves the base policies, the twin checks and the Ray records together; the older
    per-part variables still move their part alone."""
    from mixfleet.runner.orchestration.local_ray import records_dir
    from mixfleet.runner.orchestration.pretrain import default_cache_dir

    for name in ("MIXFLEET_CACHE_DIR", "MIXFLEET_STATE_DIR", "MIXFLEET_NO_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MIXFLEET_CACHE", str(tmp_path / "c"))
    assert (default_cache_dir(), cache_dir(), records_dir()) == (
        tmp_path / "c" / "base", tmp_path / "c" / "twin-checks", tmp_path / "c" / "ray")
    monkeypatch.setenv("MIXFLEET_CACHE_DIR", str(tmp_path / "t"))
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(tmp_path / "s"))
    assert (default_cache_dir(), cache_dir(), records_dir()) == (
        tmp_path / "c" / "base", tmp_path / "t" / "twin-checks", tmp_path / "s" / "ray")
    monkeypatch.delenv("MIXFLEET_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x" / "mixfleet" / "base"
