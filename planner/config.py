"""What the planner plans for: `PlannerConfig` (the pool, its caps and prices, the constraints, the objective, the
twin checks' settings), checked field by field; its defaults are `planner.defaults.DEFAULTS`, the one set
`mixfleet plan` and the app's Plan page share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.limits import MAX_GPUS, check_count
from mixfleet.costmodel.plan.planspec import MAX_SANDBOX_START_S, MAX_SANDBOXES, ON_LOSS
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.costmodel.specs.formats import formats
from mixfleet.planner.defaults import DEFAULTS

OBJECTIVES = ("cost_per_update", "cost_per_effective_update")
DEFAULT_SANDBOX_START_S = 10.0   # est-2026-12, as data/plans/seed-mixed-sandbox.toml: a container with the repository
MAX_VERIFY_SEEDS = 64


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """What to plan for. Caps are GPUs per accelerator type; constraints are optional (None = no limit). The
    defaults are `planner.defaults.DEFAULTS`, the one set `mixfleet plan` and the app's Plan page share."""
    model: str = DEFAULTS.model
    workload: str = DEFAULTS.workload
    price_table: str = DEFAULTS.price_table
    accelerators: tuple[str, ...] = ()          # () = every GPU in the catalog
    max_gpus: dict[str, int] = field(default_factory=dict)  # per accelerator; default `default_max_gpus`
    default_max_gpus: int = DEFAULTS.default_max_gpus
    kv_dtypes: tuple[str, ...] = DEFAULTS.kv_dtypes
    trainer_accelerator: str = DEFAULTS.trainer_accelerator
    trainer_gpus: int = DEFAULTS.trainer_gpus
    max_staleness: float | None = DEFAULTS.max_staleness  # mean per-token staleness, versions
    max_time_per_update_s: float | None = DEFAULTS.max_time_per_update_s
    max_usd_per_hour: float | None = DEFAULTS.max_usd_per_hour  # fleet + trainer (+ sandboxes when planned)
    objective: str = DEFAULTS.objective
    verify: int = DEFAULTS.verify  # best candidates the twin verifies in steady state and re-ranks
    verify_updates: int = DEFAULTS.verify_updates  # updates per verification (0: 10 + 2 K / B, `verify_updates`)
    seed: int = DEFAULTS.seed
    prices: dict[str, float] = field(default_factory=dict)  # accelerator -> USD per GPU-hour, over the price table
    precisions: dict[str, tuple[str, ...]] = field(default_factory=dict)  # accelerator -> allowed weight precisions
    emulated: bool = DEFAULTS.emulated  # `precisions` may name formats an accelerator only emulates
    calibration: Any = None                     # a costmodel.calibration.record.Calibration: its fitted values replace
                                                # the priors for the groups and trainer it covers (None = priors)
    layouts: str = DEFAULTS.layouts             # "smallest": smallest TP that fits; "cheapest": every layout (TP
                                                # 1-8, attention DP + EP for MoE), the lowest $/token at the workload
    backend: str = DEFAULTS.backend  # replica step times: roofline | auto | aiconfigurator
    spot: tuple[str, ...] = DEFAULTS.spot       # accelerators whose spot capacity may be used (("all",): every one
                                                # with a spot price in the price table); () = on-demand only
    spot_preemptions_per_hour: float | None = None  # spot replicas' preemption rate (None: the catalog's)
    on_loss: str = DEFAULTS.on_loss  # work in flight on a lost replica: "resume" | "restart" (the plan's)
    verify_seeds: int = DEFAULTS.verify_seeds  # seeds per verified candidate (cfg.seed, cfg.seed + 1, ...)
    # sandboxes (issue 42): each episode holds one from its start (start latency) to its last turn, billed per
    # sandbox-hour; `sandbox_cap` the most live at once (a user's constraint, e.g. a provider's concurrency
    # limit; None: sized with the fleet, every episode in flight gets one). Setting any of them turns them on.
    sandboxes: bool = False
    sandbox_cap: int | None = None
    sandbox_start_s: float = DEFAULT_SANDBOX_START_S
    sandbox_usd_per_hour: float | None = None   # None: the catalog's [sandbox] price (data/accelerators.toml)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise SpecError("plan", "objective", self.objective, OBJECTIVES)
        if self.layouts not in ("smallest", "cheapest"):
            raise SpecError("plan", "layouts", self.layouts, ("smallest", "cheapest"))
        if self.backend not in ("roofline", "auto", "aiconfigurator"):
            raise SpecError("plan", "backend", self.backend, ("roofline", "auto", "aiconfigurator"))
        for f in ("max_staleness", "max_time_per_update_s", "max_usd_per_hour"):
            v = getattr(self, f)
            if v is not None and not v > 0:
                raise SpecError("plan", f, v, "a positive number (or none)")
        if self.verify < 0 or self.verify_updates < 0:
            raise SpecError("plan", "verify", self.verify, "verify >= 0 and verify_updates >= 0 (0: automatic)")
        check_count("plan", "verify_seeds", self.verify_seeds, 1, MAX_VERIFY_SEEDS)
        if self.on_loss not in ON_LOSS:
            raise SpecError("plan", "on_loss", self.on_loss, ON_LOSS)
        v = self.spot_preemptions_per_hour
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 3600):
            raise SpecError("plan", "spot_preemptions_per_hour", v, "a number in [0, 3600] per replica-hour (or none)")
        self._check_pool()
        self._check_spot()
        self._check_sandboxes()
        if self.prices or self.precisions:
            self._check_overrides()

    def _check_pool(self) -> None:
        """Accelerator names in any case ('b200' is 'B200') or refused with the known ones; GPU caps and the
        trainer's GPUs within 1..MAX_GPUS; KV dtypes from the format registry (data/precisions.toml)."""
        cat = load_catalog(self.price_table)

        def canon(f: str, name: Any) -> str:
            try:
                return cat.accelerator(name).name
            except SpecError:
                raise SpecError("plan", f, name, "a known accelerator: " + ", ".join(cat.accelerators)) from None

        hint = " (to leave an accelerator out, name the others with --accelerators)"
        caps = {}
        for a, n in dict(self.max_gpus).items():
            caps[canon("max_gpus", a)] = check_count("plan", f"max_gpus.{a}", n, 1, MAX_GPUS, hint)
        check_count("plan", "default_max_gpus", self.default_max_gpus, 1, MAX_GPUS, hint)
        check_count("plan", "trainer_gpus", self.trainer_gpus, 1, MAX_GPUS)
        object.__setattr__(self, "max_gpus", caps)
        object.__setattr__(self, "accelerators", tuple(canon("accelerators", a) for a in self.accelerators))
        object.__setattr__(self, "trainer_accelerator", canon("trainer_accelerator", self.trainer_accelerator))
        if not self.kv_dtypes:
            raise SpecError("plan", "kv_dtypes", list(self.kv_dtypes), "at least one of " +
                            ", ".join(formats().kv_dtypes))
        for kv in self.kv_dtypes:
            formats().check_kv_dtype("plan", kv, "kv_dtypes")

    def _check_sandboxes(self) -> None:
        """The cap within 1..MAX_SANDBOXES (or none), the start latency in [0, MAX_SANDBOX_START_S], the price a
        number >= 0 (or none: the catalog's, which must then exist); a cap or a price turns sandboxes on."""
        if self.sandbox_cap is not None:
            check_count("plan", "sandbox_cap", self.sandbox_cap, 1, MAX_SANDBOXES)
        v = self.sandbox_start_s
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= MAX_SANDBOX_START_S:
            raise SpecError("plan", "sandbox_start_s", v, f"seconds in [0, {MAX_SANDBOX_START_S:g}]")
        p = self.sandbox_usd_per_hour
        if p is not None and (isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p < 1e6):
            raise SpecError("plan", "sandbox_usd_per_hour", p, "USD per sandbox-hour, a number >= 0 (or none)")
        if self.sandbox_cap is not None or p is not None:
            object.__setattr__(self, "sandboxes", True)
        if self.sandboxes:
            self.sandbox_price()

    def sandbox_price(self) -> float:
        """USD per sandbox-hour: the config's, else the catalog's [sandbox] price."""
        if self.sandbox_usd_per_hour is not None:
            return float(self.sandbox_usd_per_hour)
        from mixfleet.costmodel.specs.catalog import sandbox_price

        cat = sandbox_price()
        if cat is None:
            raise SpecError("plan", "sandbox_usd_per_hour", None, "a price (the catalog has no [sandbox] price)")
        return cat.usd_per_hour

    def _check_spot(self) -> None:
        """`spot`: accelerators of the catalog with a spot price in this price table (names as the catalog spells
        them; "all" = every one that has one)."""
        if isinstance(self.spot, str):
            object.__setattr__(self, "spot", tuple(a.strip() for a in self.spot.split(",") if a.strip()))
        if not self.spot:
            return
        cat = load_catalog(self.price_table)
        if tuple(a.lower() for a in self.spot) == ("all",):
            names = tuple(cat.spot_accelerators())
            if not names:
                raise SpecError("plan", "spot", "all", f"a price table with spot prices (price table "
                                f"'{self.price_table}' has none; tables: {', '.join(cat.price_tables())})")
        else:
            have = cat.spot_accelerators()
            names = []
            for a in self.spot:
                try:
                    names.append(cat.spot(a).name)
                except SpecError:
                    raise SpecError("plan", "spot", a, f"an accelerator with a spot price in price table "
                                    f"'{self.price_table}': " + (", ".join(have) or "none") + " (or all)") from None
            names = tuple(dict.fromkeys(names))
        object.__setattr__(self, "spot", names)

    def _check_overrides(self) -> None:
        """Per-accelerator prices and precisions: known accelerators (keys become the catalog's names), prices
        > 0, precisions a non-empty subset of the natively supported ones (or emulable ones with `emulated`)."""
        cat = load_catalog(self.price_table)
        known = list(cat.accelerators)

        def canon(f: str, name: Any) -> str:
            try:
                return cat.accelerator(name).name
            except SpecError:
                raise SpecError("plan", f, name, "a known accelerator: " + ", ".join(known)) from None

        prices = {}
        for a, usd in dict(self.prices).items():
            a = canon("prices", a)
            if isinstance(usd, bool) or not isinstance(usd, int | float) or not 0 < usd < 1e9:
                raise SpecError("plan", f"prices.{a}", usd, "USD per GPU-hour, a number > 0")
            prices[a] = float(usd)
        precs: dict[str, tuple[str, ...]] = {}
        for a, ps in dict(self.precisions).items():
            a = canon("precisions", a)
            ok = ("native", "emulated") if self.emulated else ("native",)
            allowed = [p for p in cat.precisions if cat.support(a, p) in ok]
            hint = "" if self.emulated else " (emulated formats need emulated=True, --emulated)"
            ps = ps.split(",") if isinstance(ps, str) else ps
            if not isinstance(ps, list | tuple) or not all(isinstance(p, str) for p in ps):
                raise SpecError("plan", f"precisions.{a}", ps, "a list of precision names: " + ", ".join(allowed))
            ps = tuple(dict.fromkeys(p.strip().lower() for p in ps if p.strip()))
            if not ps:
                raise SpecError("plan", f"precisions.{a}", list(ps), "at least one of " + ", ".join(allowed))
            for p in ps:
                if p not in allowed:
                    raise SpecError("plan", f"precisions.{a}", p, ", ".join(allowed) + hint)
            precs[a] = ps
        object.__setattr__(self, "prices", prices)
        object.__setattr__(self, "precisions", precs)



def pool_catalog(cfg: PlannerConfig) -> Any:
    """The catalog at the config's price table, with its per-accelerator price overrides."""
    return load_catalog(cfg.price_table).with_prices(cfg.prices)
