"""Bounded inputs: a plan, a spec or a flag that asks for more than costmodel/limits.py allows is refused when it
is read, with the limit in the message, instead of exhausting the machine (issue 13 item 6). Workload
distributions are bounded too (issue 24, the second probe: `turns = uniform 2..1e8` loaded and the dry run grew to
19.8 GB)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mixfleet.costmodel import limits
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.dist import Dist
from mixfleet.costmodel.specs.workload import load_workload, workload_from_dict
from mixfleet.costmodel.steptime.report import capacity_report, catalog_report
from mixfleet.policies.plan import load_plan, plan_from_dict
from mixfleet.ui.cli import app
from typer.testing import CliRunner

runner = CliRunner()


def _with_batcher(**settings: object) -> dict:
    raw = load_plan("tiny-cpu").to_dict()
    raw["policies"]["batcher"].update(settings)
    return raw


def test_a_billion_samples_per_prompt_is_refused_at_load_naming_the_limit() -> None:
    # main: the plan loaded and the dry run died allocating 7-30 GiB (MemoryError)
    with pytest.raises(SpecError, match=r"'samples_per_prompt' = 1000000000 .*1\.\.1024"):
        plan_from_dict(_with_batcher(samples_per_prompt=10**9))
    with pytest.raises(SpecError, match=r"prompts_per_update x samples_per_prompt.*1,048,576"):
        plan_from_dict(_with_batcher(prompts_per_update=65536, samples_per_prompt=1024))
    with pytest.raises(SpecError, match=r"inflight_prompts x samples_per_prompt.*4,194,304"):
        plan_from_dict(_with_batcher(inflight_prompts=1_000_000, samples_per_prompt=8))
    with pytest.raises(SpecError, match="max_staleness"):
        plan_from_dict(_with_batcher(max_staleness=True))


def test_plan_counts_have_upper_bounds() -> None:
    raw = load_plan("tiny-cpu").to_dict()
    big = {**raw, "groups": [{**raw["groups"][0], "replicas": limits.MAX_REPLICAS_PER_GROUP + 1}]}
    with pytest.raises(SpecError, match=f"'replicas'.*0..{limits.MAX_REPLICAS_PER_GROUP}"):
        plan_from_dict(big)
    with pytest.raises(SpecError, match="'gpus'"):
        plan_from_dict({**raw, "trainer": {**raw["trainer"], "gpus": limits.MAX_GPUS + 1}})
    with pytest.raises(SpecError, match="'max_new_tokens'"):
        plan_from_dict({**raw, "embedded": {**raw["embedded"], "max_new_tokens": 10**9}})


def test_a_workload_file_is_bounded_too() -> None:
    raw = load_workload("tiny-cpu").to_dict()
    with pytest.raises(SpecError, match="samples_per_prompt"):
        workload_from_dict({**raw, "samples_per_prompt": 10**9})
    with pytest.raises(SpecError, match="max_context"):
        workload_from_dict({**raw, "max_context": 10**12})


def test_capacity_contexts_beyond_the_models_max_context_are_refused() -> None:
    # main: `capacity --contexts 100000000000` printed a table of dashes
    with pytest.raises(SpecError, match=r"'contexts' = 100000000000 .*1\.\.262144 \(qwen3.6-35b-a3b's max context\)"):
        capacity_report("qwen3.6-35b-a3b", "H100", "fp8", contexts=(10**11,))
    with pytest.raises(SpecError, match="'batches'"):
        capacity_report("tiny", "H100", "fp8", batches=(10**7,))
    with pytest.raises(SpecError, match="'mean_context'"):
        catalog_report("tiny", mean_context=10**9)
    res = CliRunner().invoke(app, ["capacity", "-a", "H100", "-q", "fp8", "--contexts", "100000000000"])
    assert res.exit_code != 0 and "max context" in res.output and "—" not in res.output


def test_kv_budget_zero_is_refused_with_its_range() -> None:
    for cmd in (["capacity", "-a", "H100", "-q", "fp8"], ["catalog"]):
        res = runner.invoke(app, [*cmd, "--kv-budget", "0"])
        assert res.exit_code == 2 and "--kv-budget" in res.output and "greater than or equal to 1" in res.output, \
            res.output


# ---- workload distributions are bounded (BAD 5) --------------------------------------------------------------
def _tiny(**dists: object) -> dict:
    return {**load_workload("tiny-cpu").to_dict(), **dists}


def test_the_probes_turns_uniform_2_to_1e8_is_refused_naming_the_limit() -> None:
    """main: loaded; `simulate -n 1` then grew to 19.8 GB in 120 s (a MemoryError under a ulimit)."""
    with pytest.raises(SpecError, match=r"turns.*'high' = 100000000\.0 is invalid; allowed: at most 4,096 "
                                        r"\(MAX_TURNS"):
        workload_from_dict(_tiny(turns={"kind": "uniform", "low": 2, "high": 1e8, "integer": True}))


@pytest.mark.parametrize("field, dist, bad, allowed", [
    ("turns", {"kind": "uniform", "low": -5, "high": 3, "integer": True}, "'low' = -5.0", "at least 0"),
    ("turns", -2, "'value' = -2.0", "at least 0"),
    ("tool_latency_s", {"kind": "uniform", "low": -1.0, "high": 0.5}, "'low' = -1.0", "at least 0"),
    ("tool_latency_s", {"kind": "lognormal", "median": 1, "sigma": 1, "min": -3}, "'min' = -3.0", "at least 0"),
    ("tool_latency_s", 10**7, "'value' = 10000000.0", "at most 86,400 (MAX_TOOL_LATENCY_S"),
    ("reply_tokens", {"kind": "empirical", "values": [10, 2e6]}, "'values' = 2000000.0",
     "at most 1,048,576 (MAX_NEW_TOKENS"),
    ("tool_output_tokens", {"kind": "uniform", "low": 1, "high": 1e12}, "'high' = 1000000000000.0",
     "at most 16,777,216 (MAX_CONTEXT_TOKENS"),
    ("prompt_tokens", {"kind": "lognormal", "median": 40, "sigma": 0.5, "max": 1e9}, "'max' = 1000000000.0",
     "at most 16,777,216 (MAX_CONTEXT_TOKENS"),
    ("prompt_tokens", {"kind": "lognormal", "median": 1e9, "sigma": 0.5}, "'median' = 1000000000.0",
     "at most 16,777,216 (MAX_CONTEXT_TOKENS"),
    ("turns", {"kind": "lognormal", "median": 3, "sigma": 40}, "'sigma' = 40.0", "at most 10 (MAX_LOGNORMAL_SIGMA"),
])
def test_every_distribution_is_bounded(field: str, dist: object, bad: str, allowed: str) -> None:
    """main: all accepted (negative turns and tool latency included; sigma 40 overflowed the planner's mean)."""
    with pytest.raises(SpecError, match=field) as e:
        workload_from_dict(_tiny(**{field: dist}))
    assert f"{bad} is invalid; allowed: {allowed}" in str(e.value), str(e.value)


def test_an_unclipped_lognormal_is_clipped_at_its_fields_limit() -> None:
    """A lognormal without `max` (allowed, the tests' workloads have them) stops at the field's limit, so its
    samples and its mean stay bounded."""
    import numpy as np

    w = workload_from_dict(_tiny(reply_tokens={"kind": "lognormal", "median": 40, "sigma": 3.0, "min": 1}))
    assert w.reply_tokens.max == limits.MAX_NEW_TOKENS
    x = w.reply_tokens.sample(np.random.default_rng(0), 200_000)
    assert x.max() <= limits.MAX_NEW_TOKENS and w.reply_tokens.mean < limits.MAX_NEW_TOKENS


def test_a_huge_integer_uniform_mean_takes_no_memory() -> None:
    """Dist.mean of an integer uniform built an array of every integer in [low, high] (1e8 of them: 800 MB, the
    probe's growth); it is closed-form now, and agrees with the array on small ranges."""
    import numpy as np

    big = Dist.uniform(2, 1e15, integer=True)
    assert big.mean == pytest.approx((2 + 1e15) / 2)
    rng = np.random.default_rng(1)
    for _ in range(300):
        lo, hi = sorted(rng.uniform(-20, 40, size=2))
        cmin, cmax = sorted(rng.uniform(-30, 50, size=2))
        kw = {k: v for k, v in (("min", cmin), ("max", cmax)) if rng.random() < 0.7}
        if np.ceil(lo) > np.floor(hi):
            continue
        d = Dist.uniform(lo, hi, integer=True, **kw)
        ints = np.arange(np.ceil(lo), np.floor(hi) + 1)
        want = np.clip(ints, kw.get("min", -np.inf), kw.get("max", np.inf)).mean()
        assert d.mean == pytest.approx(want, rel=1e-12, abs=1e-12), (lo, hi, kw)


def test_the_plan_command_refuses_the_probes_workload(tmp_path: Path) -> None:
    """`mixfleet plan --workload FILE` (the Plan page's box takes the same `workload_from_dict`): one line, exit 2.
    Run as its own process under a 3 GiB address-space limit, as the probe did: on main it ended in a MemoryError
    traceback (exit 1) there, and without a limit it grew to 19.8 GB."""
    import resource
    import subprocess

    import tomli_w

    path = tmp_path / "huge-turns.toml"
    path.write_text(tomli_w.dumps(_tiny(turns={"kind": "uniform", "low": 2, "high": 1e8, "integer": True})))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    r = subprocess.run([sys.executable, "-c", "from mixfleet.ui.cli import app; app(prog_name='mixfleet')", "plan",
                        "--workload", str(path), "--model", "tiny"], capture_output=True, text=True, timeout=300,
                       preexec_fn=limit)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-2000:]
    assert "at most 4,096 (MAX_TURNS" in out and "Traceback" not in out and "MemoryError" not in out
