"""Workloads and distributions: shipped files, exact means, seeded sampling, validation errors."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.paths import data_path
from mixfleet.costmodel.specs.dist import Dist, dist_from_dict
from mixfleet.costmodel.specs.workload import known_workloads, load_workload, workload_from_dict

SEED_TEXT = data_path("workloads", "seed-agentic-coding.toml").read_text()


def test_shipped_workloads_load() -> None:
    assert {"seed-agentic-coding", "tiny-cpu"} <= set(known_workloads())
    seed = load_workload("seed-agentic-coding")
    assert seed.trajectories_per_update == 128 * 8
    assert seed.max_context == 262144 and seed.turns.median == pytest.approx(57)
    tiny = load_workload("tiny-cpu")
    assert tiny.max_context == 1024 and tiny.turns.mean == 4.0
    draws = tiny.turns.sample(np.random.default_rng(0), 10_000)
    assert set(np.unique(draws)) == {2, 3, 4, 5, 6}
    assert seed.mean_final_context <= seed.max_context


def test_unknown_workload_lists_known() -> None:
    with pytest.raises(SpecError) as e:
        load_workload("nope")
    assert "'seed-agentic-coding'" in str(e.value) and "'tiny-cpu'" in str(e.value)


def test_clipped_means_by_hand() -> None:
    # uniform(2, 10) clipped to [3, 8]: (3 * 1 + (8^2 - 3^2) / 2 + 8 * 2) / 8
    assert Dist.uniform(2, 10, min=3, max=8).mean == pytest.approx((3 + 27.5 + 16) / 8)
    assert Dist.const(5, max=4).mean == 4
    assert Dist.uniform(1.5, 6, integer=True, max=5).mean == pytest.approx((2 + 3 + 4 + 5 + 5) / 5)
    with pytest.raises(SpecError):
        Dist.uniform(2.2, 2.8, integer=True)
    assert Dist.empirical([1, 2, 10], [1, 1, 2]).mean == pytest.approx((1 + 2 + 20) / 4)
    ln = Dist.lognormal(median=100, sigma=0.5)
    assert ln.mean == pytest.approx(100 * math.exp(0.125))
    by_mean = Dist.lognormal(mean=300, cv=1.5)
    assert by_mean.mean == pytest.approx(300)


@pytest.mark.parametrize("dist", [
    Dist.lognormal(median=57, sigma=0.6, min=3, max=400),
    Dist.lognormal(mean=350, cv=2.0, max=5000),
    Dist.uniform(10, 40, min=15),
    Dist.empirical([1, 5, 9], [0.2, 0.3, 0.5], max=8),
    Dist.uniform(1.5, 6, integer=True, max=5),
])
def test_sample_mean_matches_mean(dist: Dist) -> None:
    x = dist.sample(np.random.default_rng(1234), 400_000)
    se = x.std() / math.sqrt(len(x))
    assert abs(x.mean() - dist.mean) < 5 * se
    again = dist.sample(np.random.default_rng(1234), 10)
    assert np.array_equal(again, x[:10])


def test_dist_round_trip_and_validation() -> None:
    d = Dist.lognormal(median=350, sigma=0.9, min=8, max=16384, integer=True)
    assert dist_from_dict(d.to_dict()) == d
    assert dist_from_dict(3).mean == 3.0
    for raw, field in [({"kind": "normal"}, "kind"), ({"kind": "lognormal", "median": -1, "sigma": 1}, "median"),
                       ({"kind": "lognormal", "median": 5}, "lognormal"),
                       ({"kind": "uniform", "low": 5, "high": 1}, "high"),
                       ({"kind": "uniform", "low": 1, "high": 5, "scale": 2}, "scale"),
                       ({"kind": "empirical", "values": [1, 2], "weights": [1]}, "weights"),
                       ({"kind": "const", "value": 1, "min": 5, "max": 2}, "max"),
                       ("many", "<dist>")]:
        with pytest.raises(SpecError) as e:
            dist_from_dict(raw)
        assert e.value.field == field


@pytest.mark.parametrize("old,new,field", [
    ("prompts_per_update = 128", 'prompts_per_update = "128"', "prompts_per_update"),
    ("samples_per_prompt = 8", "samples_per_prompt = 0", "samples_per_prompt"),
    ("success_prob = 0.5 ", "success_prob = 1.5 ", "success_prob"),
    ("max_context = 262144", "max_contxt = 262144", "max_contxt"),
    ('turns = { kind = "lognormal", median = 57, sigma = 0.6', 'turns = { kind = "lognormal", median = 57, sigma = -1',
     "sigma"),
])
def test_bad_workload_file_names_the_field(tmp_path: Path, old: str, new: str, field: str) -> None:
    assert old in SEED_TEXT
    p = tmp_path / "w.toml"
    p.write_text(SEED_TEXT.replace(old, new, 1))
    with pytest.raises(SpecError) as e:
        load_workload(p)
    assert e.value.field == field


def test_round_trip_and_closed_forms() -> None:
    w = load_workload("tiny-cpu")
    assert workload_from_dict(w.to_dict()) == w
    # tiny: prompt mean 80, 4 turns, reply mean 25, tool mean 14
    assert w.mean_generated_tokens_per_episode == pytest.approx(4 * 25)
    assert w.mean_final_context == pytest.approx(80 + 4 * 25 + 3 * 14)
    assert w.mean_decode_context == pytest.approx(80 + 1.5 * (25 + 14) + 12.5)
    assert w.mean_prefill_tokens_per_episode == pytest.approx(80 + 3 * 14)
    ep = w.sample_episodes(np.random.default_rng(0), 100)
    assert ep["turns"].dtype == np.int64 and ep["turns"].min() >= 2 and ep["prompt_tokens"].max() <= 120
