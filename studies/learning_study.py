"""The learning study of issue 41 as data.

The study (`STUDY`): the seed's six loss variants (studies/ablation.py `VARIANTS`) on the treatment (mixed) fleet,
GRPO and SC + MIS + top-p also on a homogeneous bf16 fleet, on the dense model; on the MoE the four key arms and
SC + MIS + top-p with routing replayed. Every arm of a model starts from that model's one base (`pretrain_steps`;
each run records its base's weight digest), at the learning rate `STUDY_LR`, with the same periodic held-out
evaluation (`STUDY_EVAL`). benchmarks/learning.py runs it (`--study dense|moe [--list] [--resume]`): each arm is
a rung of its RUNGS table under its own key (prefix "s-" dense, "m-" MoE: no collision with the ladder's keys).

    treatment fleet  tiny-cpu (tiny-moe-cpu) with emulated kernel error on the fp8 / nvfp4 groups (TREATMENT_NOISE);
                     its k3 measured against one fp32 group (b-lr, learning_treatment.json); against the
                     bf16 fleet below it is measured by the study's first runs
    homogeneous      learning-homog-bf16 (-moe): tiny-cpu's bf16 group alone, three replicas
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mixfleet.studies.ablation import LABELS, variant

# The treatment (issue 41): tiny-cpu's fp8 / nvfp4 groups alone are barely further from the trainer than one fp32
# group two versions behind (the mixed / homogeneous k3 of c-grpo-lr / b-lr: 0.89-1.38x). The embedded engine's
# emulated kernel error on those two groups makes the mixed fleet's mismatch exceed the homogeneous one's, as
# the seed's did (~4.7x); its size is measured, not assumed (benchmarks/results/learning_treatment.json).
TREATMENT_NOISE = {"groups.cpu-fp8.weight_noise": 0.5, "groups.cpu-nvfp4.weight_noise": 0.9}

STUDY_LR = 1.5e-4                       # the learning setting (docs/learning.md: the rate the async fleets learn at)
STUDY_EVAL = {"every": 10, "problems": 64, "samples": 2}    # periodic held-out evaluation of every arm
KEY_VARIANTS = ("sc_mis_topp", "grpo")  # the four key arms: these two, each on the mixed and the homogeneous fleet
KEY_SEEDS, OTHER_SEEDS = (0, 1, 2, 3, 4), (0, 1, 2)
KEY_UPDATES, OTHER_UPDATES = 60, 40
FIRST_SEEDS = 3                         # the key arms' seeds 0-2 run first, then their seeds 3-4, then the rest
RUN_OVERHEAD_S = 15.0                   # per run beyond its log's wall: child + Ray start and the start gap (runs/treat
                                        # manifest: child wall - log wall 7-14 s; start gap 5 s)

MODELS = {"dense": ("tiny", 150), "moe": ("tiny-qwen3-moe", 300)}    # study -> (model, its base's pretrain steps)
PLANS = {("dense", "mixed"): "tiny-cpu", ("dense", "homogeneous"): "learning-homog-bf16",
         ("moe", "mixed"): "tiny-moe-cpu", ("moe", "homogeneous"): "learning-homog-bf16-moe",
         ("moe", "mixed-replay"): "tiny-moe-cpu-replay"}
# existing ladder rungs (benchmarks/results/learning.json) whose measured wall per update estimates an arm's: the same
# model and fleet size (the homogeneous bf16 x 3 has no measured rung yet: the mixed fleet's and one fp32 group's)
LIKE = {("dense", "mixed"): ("c-lr", "c-grpo-lr"),
        ("dense", "homogeneous"): ("c-lr", "c-grpo-lr", "b-lr", "b-c-lr"),
        ("moe", "mixed"): ("d-c300", "d-c300-grpo"),
        ("moe", "homogeneous"): ("d-c300", "d-c300-grpo", "d-b300", "d-b300-c"),
        ("moe", "mixed-replay"): ("d-c300-replay",)}


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One arm of the study: a loss variant on a fleet of a model, its seeds and horizon."""

    key: str                          # the rung key (benchmarks/learning.py RUNGS), e.g. "s-mix-grpo"
    study: str                        # "dense" | "moe"
    fleet: str                        # "mixed" | "homogeneous" | "mixed-replay" (the MoE's routing replayed)
    variant: str                      # studies/ablation.py VARIANTS key
    seeds: tuple[int, ...]
    updates: int
    key_arm: bool = False             # one of the four key arms (5 seeds, 60 updates on the dense model)

    @property
    def model(self) -> str:
        return MODELS[self.study][0]

    @property
    def pretrain_steps(self) -> int:
        return MODELS[self.study][1]

    @property
    def plan(self) -> str:
        return PLANS[(self.study, self.fleet)]

    @property
    def like(self) -> tuple[str, ...]:
        return LIKE[(self.study, self.fleet)]

    @property
    def label(self) -> str:
        fleet = {"mixed": "treatment (mixed) fleet", "homogeneous": "homogeneous bf16 fleet",
                 "mixed-replay": "treatment (mixed) fleet, routing replayed"}[self.fleet]
        return (f"study {self.study}: {LABELS[self.variant]}, {fleet}, lr {STUDY_LR:g}, "
                f"{self.updates} updates, {self.pretrain_steps}-step base")

    @property
    def overrides(self) -> dict[str, Any]:
        """The plan overrides: the variant's loss, and on the mixed fleets the treatment's kernel noise."""
        noise = TREATMENT_NOISE if self.fleet.startswith("mixed") else {}
        return {**variant(self.variant).overrides(), **noise}

    @property
    def settings(self) -> dict[str, Any]:
        return {"lr": STUDY_LR}


def _arm(study: str, fleet: str, v: str) -> Arm:
    key = v in KEY_VARIANTS and fleet != "mixed-replay"
    if study == "moe":      # the MoE: 3 seeds; replay is compared with the free-routing arm at its horizon
        seeds, updates = OTHER_SEEDS, KEY_UPDATES
    else:
        seeds, updates = (KEY_SEEDS, KEY_UPDATES) if key else (OTHER_SEEDS, OTHER_UPDATES)
    tag = {"mixed": "mix", "homogeneous": "hom", "mixed-replay": "mix"}[fleet]
    name = f"{'s' if study == 'dense' else 'm'}-{tag}-{v}" + ("-replay" if fleet == "mixed-replay" else "")
    return Arm(key=name, study=study, fleet=fleet, variant=v, seeds=seeds, updates=updates, key_arm=key)


STUDY: dict[str, tuple[Arm, ...]] = {
    "dense": tuple([_arm("dense", "mixed", "sc_mis_topp"), _arm("dense", "mixed", "grpo"),
                    _arm("dense", "homogeneous", "sc_mis_topp"), _arm("dense", "homogeneous", "grpo")]
                   + [_arm("dense", "mixed", v) for v in ("grpo_mis", "sc", "grpo_topp", "sc_mis")]),
    "moe": (_arm("moe", "mixed", "sc_mis_topp"), _arm("moe", "mixed", "grpo"),
            _arm("moe", "homogeneous", "sc_mis_topp"), _arm("moe", "homogeneous", "grpo"),
            _arm("moe", "mixed-replay", "sc_mis_topp")),
}
ARMS: dict[str, Arm] = {a.key: a for arms in STUDY.values() for a in arms}


def study_order(study: str) -> list[tuple[Arm, int]]:
    """The runs of a study, cheapest informative first: the key arms' seeds 0-2 (a paired contrast of every
    finding on 3 seeds), then their seeds 3-4 (the 5 pairs an equivalence at +-0.05 needs), then the other arms;
    within each part seed by seed, so that a partial study holds whole seeds (pairs) first."""
    if study not in STUDY:
        raise ValueError(f"study = {study!r}; allowed: {', '.join(STUDY)}")
    arms = STUDY[study]
    key, other = [a for a in arms if a.key_arm], [a for a in arms if not a.key_arm]
    seeds = sorted({s for a in arms for s in a.seeds})
    parts = ([(a, s) for s in seeds[:FIRST_SEEDS] for a in key], [(a, s) for s in seeds[FIRST_SEEDS:] for a in key],
             [(a, s) for s in seeds for a in other])
    return [(a, s) for part in parts for a, s in part if s in a.seeds]


def wall_per_update(ladder: Mapping[str, Any], rungs: Sequence[str]) -> float:
    """The median measured wall seconds per update of the finished runs of `rungs` in a ladder results file
    (benchmarks/results/learning.json); NaN if none."""
    per = [r["wall_s"] / r["updates"] for r in ladder.get("runs", [])
           if r["rung"] in rungs and r.get("status") == "finished" and r.get("updates") and r.get("wall_s")]
    return statistics.median(per) if per else math.nan


def estimate_s(arm: Arm, ladder: Mapping[str, Any]) -> float:
    """A run's estimated CPU wall seconds on this machine: measured wall per update of its like rungs x its updates
    + RUN_OVERHEAD_S."""
    return wall_per_update(ladder, arm.like) * arm.updates + RUN_OVERHEAD_S
