"""Bounded inputs: a plan, a spec or a flag that asks for more than costmodel/limits.py allows is refused when it
is read, with the limit in the message, instead of exhausting the machine (issue 13 item 6)."""

from __future__ import annotations

import pytest
from mixfleet.costmodel import limits
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.workload import load_workload, workload_from_dict
from mixfleet.costmodel.steptime.report import capacity_report, catalog_report
from mixfleet.policies.plan import load_plan, plan_from_dict
from mixfleet.ui.cli import app
from typer.testing import CliRunner


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
