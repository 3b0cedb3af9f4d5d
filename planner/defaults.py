"""The mix planner's defaults: one set, for the planner's config (`planner.PlannerConfig`), `mixfleet plan`'s
options and the app's Plan page inputs (issue 26: the app and the CLI planned "the defaults" with different
settings and chose different mixes).

A light module (no numpy, scipy or SimPy) so that the CLI can build its options from it without importing the
planner. Change a default here and every front end follows; tests/test_planner_defaults.py holds the CLI and
the app to the same mix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class PlannerDefaults:
    """What `mixfleet plan` and the Plan page plan with when nothing is changed (PlannerConfig's fields)."""
    model: str = "qwen3.6-35b-a3b"             # the seed's model
    workload: str = "seed-agentic-coding"      # the seed's workload
    price_table: str = "modal"
    default_max_gpus: int = 64                 # GPUs per accelerator type unless capped
    kv_dtypes: tuple[str, ...] = ("fp8_e4m3",)
    trainer_accelerator: str = "B200"
    trainer_gpus: int = 8
    max_staleness: float | None = None         # versions (None: no limit)
    max_time_per_update_s: float | None = None
    max_usd_per_hour: float | None = None      # fleet + trainer
    objective: str = "cost_per_update"
    verify: int = 2                            # best candidates verified in the twin's steady state and re-ranked
    verify_updates: int = 0                    # updates per twin check (0: 10 + prompts in flight / per update)
    verify_seeds: int = 1                      # seeds per verified candidate
    seed: int = 0
    layouts: str = "smallest"                  # smallest TP that fits | cheapest layout per token
    backend: str = "roofline"                  # replica step times: roofline | auto | aiconfigurator
    emulated: bool = False
    on_loss: str = "resume"                    # work in flight on a lost replica: resume | restart
    spot: tuple[str, ...] = ()                 # on-demand only
    workers: int = 1                           # twin checks: 1 = one after another in this process; N > 1 = Ray

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        """One line for a page or a help text: every default as `mixfleet plan`'s flag would set it."""
        def show(v: object) -> str:
            if v is None:
                return "none"
            if isinstance(v, tuple):
                return ",".join(v) or "none"
            return str(v)

        return "; ".join(f"{k.replace('_', '-')} {show(v)}" for k, v in self.to_dict().items())


DEFAULTS = PlannerDefaults()
