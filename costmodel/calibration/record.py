"""The calibration record: fitted values (`Fitted`), per group (`GroupCalibration`) and for a run's fleet
(`Calibration`: TOML save / load, the calibrated trainer step), the errors and warnings of a fit.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.catalog import Catalog
from mixfleet.costmodel.specs.model import ModelSpec
from mixfleet.costmodel.specs.workload import WorkloadSpec, workload_from_dict
from mixfleet.costmodel.steptime.roofline import Efficiency, ReplicaModel, trainer_step_s
from mixfleet.costmodel.tomlread import read_toml

SCHEMA = 1


class CalibrationWarning(UserWarning):
    """Part of a run log was left out of the fit (an unreadable part file, a segment it cannot use): the
    message says which and why; `Calibration.skipped` keeps the list."""


class CalibrationError(SpecError):
    """Too little data to fit: the message lists what is missing."""

    def __init__(self, missing: Sequence[str]) -> None:
        self.missing = list(missing)
        ValueError.__init__(self, "cannot calibrate from these run logs; missing: " + "; ".join(self.missing))
        self.where, self.field, self.value, self.allowed = "calibration", "run logs", len(self.missing), ""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True, kw_only=True)
class Fitted:
    """One fitted value: value +- stderr (1 sigma), the prior it replaces, and whether the data identified it."""
    value: float
    stderr: float = math.nan
    prior: float = math.nan
    unit: str = ""
    fitted: bool = True              # False: kept at the prior (the note says why)
    note: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.value, int | float) or isinstance(self.value, bool) or not math.isfinite(self.value):
            raise SpecError("calibration value", "value", self.value, "a finite number")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"value": float(self.value), "fitted": self.fitted}
        for k in ("stderr", "prior"):
            v = float(getattr(self, k))
            if math.isfinite(v):
                d[k] = v
        if self.unit:
            d["unit"] = self.unit
        if self.note:
            d["note"] = self.note
        return d

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> Fitted:
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            return cls(value=float(raw))
        if not isinstance(raw, dict) or "value" not in raw:
            raise SpecError(where, "<value>", raw, "a number or a table with value (stderr, prior, fitted, unit, note)")
        known = ("value", "stderr", "prior", "unit", "fitted", "note")
        for k in raw:
            if k not in known:
                raise SpecError(where, k, raw[k], "one of " + ", ".join(known))
        return cls(value=float(raw["value"]), stderr=float(raw.get("stderr", math.nan)),
                   prior=float(raw.get("prior", math.nan)), unit=str(raw.get("unit", "")),
                   fitted=bool(raw.get("fitted", True)), note=str(raw.get("note", "")))

    def fmt(self, spec: str = ".4g") -> str:
        err = f" +- {self.stderr:{spec}}" if math.isfinite(self.stderr) else ""
        return f"{self.value:{spec}}{err}{(' ' + self.unit) if self.unit else ''}"


GROUP_PARAMS = ("decode_scale", "prefill_overhead_s", "weight_sync_s", "kl_k3", "kl_growth_per_staleness",
                "extreme_share", "extreme_growth_per_staleness")


@dataclass(frozen=True, kw_only=True)
class GroupCalibration:
    """The fitted values of one sampler group (matched to a plan's group by name, else by its key)."""
    name: str
    accelerator: str
    precision: str
    kv_dtype: str
    kernel: str = ""
    decode_scale: Fitted
    prefill_overhead_s: Fitted
    weight_sync_s: Fitted
    kl_k3: Fitted
    kl_growth_per_staleness: Fitted
    extreme_share: Fitted
    extreme_growth_per_staleness: Fitted
    trajectories: int = 0
    residual_rel_rms: float = math.nan   # the duration fit's relative RMS residual for this group

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.accelerator, self.precision, self.kv_dtype, self.kernel)

    def apply(self, rm: ReplicaModel) -> ReplicaModel:
        """The prior replica model with these fitted values: decode step x decode_scale (efficiencies / scale,
        decode overhead x scale), prefill = scale x roofline + fitted overhead."""
        f = self.decode_scale.value
        return replace(rm, eff_bw=rm.eff_bw / f, eff_flops=rm.eff_flops / f,
                       decode_overhead_s=rm.decode_overhead_s * f, prefill_overhead_s=self.prefill_overhead_s.value)

    def efficiency(self, rm: ReplicaModel) -> Efficiency:
        """The same as an `Efficiency` override for `replica_model(...)` (validated: may refuse an extreme fit)."""
        c = self.apply(rm)
        return Efficiency(eff_bw=c.eff_bw, eff_flops=c.eff_flops, decode_overhead_s=c.decode_overhead_s,
                          prefill_overhead_s=c.prefill_overhead_s)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Fitted values from run logs. Save / load as TOML; the twin (`twin.calibrated`) and the planner use them."""
    groups: tuple[GroupCalibration, ...]
    trainer_accelerator: str
    trainer_gpus: int
    trainer_scale: Fitted            # multiplier on the prior trainer compute time (1 / MFU ratio)
    trainer_overhead_s: Fitted       # fixed seconds per trainer update
    update_overhead_s: Fitted        # seconds per update outside train + sync (checkpoint, logging)
    turn_latency_s: Fitted           # seconds between a reply and the session's next request
    model: str = ""
    runs: tuple[str, ...] = ()
    workload: dict[str, Any] | None = None   # the measured workload (workload_from_dict table)
    residuals: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    created_utc: str = ""
    source_path: str = ""
    skipped: tuple[str, ...] = ()            # what of the run logs was left out of the fit, and why

    def group(self, name: str = "", key: tuple[str, str, str, str] | None = None) -> GroupCalibration | None:
        """The calibration of a group: same name first, else same (accelerator, precision, kv_dtype, kernel)."""
        for g in self.groups:
            if name and g.name == name:
                return g
        if key is not None:
            for g in self.groups:
                if g.key == key:
                    return g
        return None

    def trainer_step_s(self, model: ModelSpec, catalog: Catalog, gpus: int, tokens: Any) -> Any:
        """Calibrated seconds of one update's train step (+ the per-update overhead outside train and sync)."""
        acc = catalog.accelerator(self.trainer_accelerator)
        base = np.asarray(trainer_step_s(model, acc, gpus, tokens, overhead_s=0.0), dtype=np.float64)
        base = base * self.trainer_gpus / gpus  # compute scales with GPUs; the fit was at trainer_gpus
        out = self.trainer_scale.value * base + self.trainer_overhead_s.value + self.update_overhead_s.value
        return float(out) if np.ndim(out) == 0 else out

    def workload_spec(self, base: WorkloadSpec | None = None) -> WorkloadSpec | None:
        """The measured workload (batch sizes and context limit from `base` when given)."""
        if self.workload is None:
            return None
        raw = dict(self.workload)
        if base is not None:
            raw.update(prompts_per_update=base.prompts_per_update, samples_per_prompt=base.samples_per_prompt,
                       max_context=base.max_context)
        return workload_from_dict(raw, where=f"{self.source_path or 'calibration'} [workload]")

    # ---- TOML ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA, "created_utc": self.created_utc, "model": self.model,
                               "runs": list(self.runs),
                               "trainer": {"accelerator": self.trainer_accelerator, "gpus": self.trainer_gpus,
                                           "scale": self.trainer_scale.to_dict(),
                                           "overhead_s": self.trainer_overhead_s.to_dict(),
                                           "update_overhead_s": self.update_overhead_s.to_dict()},
                               "turn_latency_s": self.turn_latency_s.to_dict(),
                               "residuals": {k: float(v) for k, v in self.residuals.items() if math.isfinite(v)},
                               "counts": {k: int(v) for k, v in self.counts.items()}}
        groups = []
        for g in self.groups:
            d: dict[str, Any] = {"name": g.name, "accelerator": g.accelerator, "precision": g.precision,
                                 "kv_dtype": g.kv_dtype, "kernel": g.kernel, "trajectories": g.trajectories}
            if math.isfinite(g.residual_rel_rms):
                d["residual_rel_rms"] = g.residual_rel_rms
            for p in GROUP_PARAMS:
                d[p] = getattr(g, p).to_dict()
            groups.append(d)
        out["groups"] = groups
        if self.workload is not None:
            out["workload"] = self.workload
        if self.skipped:
            out["skipped"] = list(self.skipped)
        return out

    def save(self, path: str | os.PathLike[str]) -> Path:
        import tomli_w

        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(tomli_w.dumps(self.to_dict()))
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "calibration") -> Calibration:
        if raw.get("schema") != SCHEMA:
            raise SpecError(where, "schema", raw.get("schema"), f"{SCHEMA} (a file written by `mixfleet calibrate`)")
        tr = raw.get("trainer")
        if not isinstance(tr, dict):
            raise SpecError(where, "trainer", tr, "a [trainer] table")
        for k in ("accelerator", "gpus", "scale", "overhead_s", "update_overhead_s"):
            if k not in tr:
                raise SpecError(f"{where} [trainer]", k, None, "a value (the field is required)")
        groups = []
        graw = raw.get("groups", [])
        if not isinstance(graw, list) or not graw:
            raise SpecError(where, "groups", graw, "a non-empty array of [[groups]] tables")
        for i, g in enumerate(graw):
            w = f"{where} [[groups]] #{i + 1}"
            if not isinstance(g, dict):
                raise SpecError(where, f"groups[{i}]", g, "a table")
            for k in ("name", "accelerator", "precision", "kv_dtype", *GROUP_PARAMS):
                if k not in g:
                    raise SpecError(w, k, None, "a value (the field is required)")
            groups.append(GroupCalibration(
                name=str(g["name"]), accelerator=str(g["accelerator"]), precision=str(g["precision"]),
                kv_dtype=str(g["kv_dtype"]), kernel=str(g.get("kernel", "")),
                trajectories=int(g.get("trajectories", 0)),
                residual_rel_rms=float(g.get("residual_rel_rms", math.nan)),
                **{p: Fitted.from_dict(g[p], f"{w} {p}") for p in GROUP_PARAMS}))
        wl = raw.get("workload")
        if wl is not None:
            workload_from_dict(wl, where=f"{where} [workload]")  # validate now
        if "turn_latency_s" not in raw:
            raise SpecError(where, "turn_latency_s", None, "a value (the field is required)")
        return cls(groups=tuple(groups), trainer_accelerator=str(tr["accelerator"]), trainer_gpus=int(tr["gpus"]),
                   trainer_scale=Fitted.from_dict(tr["scale"], f"{where} trainer.scale"),
                   trainer_overhead_s=Fitted.from_dict(tr["overhead_s"], f"{where} trainer.overhead_s"),
                   update_overhead_s=Fitted.from_dict(tr["update_overhead_s"], f"{where} trainer.update_overhead_s"),
                   turn_latency_s=Fitted.from_dict(raw["turn_latency_s"], f"{where} turn_latency_s"),
                   model=str(raw.get("model", "")), runs=tuple(str(r) for r in raw.get("runs", [])), workload=wl,
                   residuals={k: float(v) for k, v in raw.get("residuals", {}).items()},
                   counts={k: int(v) for k, v in raw.get("counts", {}).items()},
                   created_utc=str(raw.get("created_utc", "")), source_path=where,
                   skipped=tuple(str(x) for x in raw.get("skipped", [])))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        path = Path(path)
        if not path.is_file():
            raise SpecError("calibration", "path", str(path), "an existing TOML file written by `mixfleet calibrate`")
        return cls.from_dict(read_toml(path), where=str(path))

    def table(self) -> list[tuple[str, str, Fitted]]:
        """(scope, parameter, Fitted) rows for printing."""
        rows: list[tuple[str, str, Fitted]] = [
            ("trainer", "scale", self.trainer_scale), ("trainer", "overhead_s", self.trainer_overhead_s),
            ("trainer", "update_overhead_s", self.update_overhead_s),
            ("sessions", "turn_latency_s", self.turn_latency_s)]
        for g in self.groups:
            rows += [(g.name, p, getattr(g, p)) for p in GROUP_PARAMS]
        return rows


def calibration_dict(cal: Calibration) -> dict[str, Any]:
    """JSON-ready dict (for --json)."""
    d = cal.to_dict()
    d.pop("workload", None)
    return d


__all__ = ["Calibration", "CalibrationError", "Fitted", "GroupCalibration", "calibration_dict"]
