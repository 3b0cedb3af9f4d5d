"""`calibrate`: the fits composed into a `Calibration`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import UTC, datetime

from mixfleet.costmodel.calibration.logs import MIN_TRAJECTORIES_PER_GROUP, MIN_UPDATES, FrameLog, _read_logs
from mixfleet.costmodel.calibration.mismatch_fit import _fit_mismatch
from mixfleet.costmodel.calibration.record import Calibration, GroupCalibration
from mixfleet.costmodel.calibration.sessions import _fit_sessions
from mixfleet.costmodel.calibration.trainer import _fit_trainer, _fit_update_overhead
from mixfleet.costmodel.calibration.weight_sync import _fit_weight_sync
from mixfleet.costmodel.calibration.workload_fit import _measured_workload


def calibrate(runlogs: Iterable[str | os.PathLike[str] | FrameLog], *,
              min_trajectories: int = MIN_TRAJECTORIES_PER_GROUP, min_updates: int = MIN_UPDATES) -> Calibration:
    """Fit a Calibration to one or more run logs of the same model and trainer (see the module doc): folders, or
    `FrameLog`s held in memory (a window of a running run). The fits: sessions (`_fit_sessions`), trainer
    (`_fit_trainer`, `_fit_update_overhead`), weight sync (`_fit_weight_sync`), mismatch (`_fit_mismatch`).

    Raises CalibrationError naming everything that is missing when the logs hold too little data.
    """
    data = _read_logs(list(runlogs), min_trajectories, min_updates)
    runs, r0 = data.runs, data.runs[0]
    sess = _fit_sessions(data)
    t_scale, t_over, train_rms = _fit_trainer(runs)
    upd_over = _fit_update_overhead(runs)
    sync, pushes = _fit_weight_sync(runs, sess.priors)
    groups_out = []
    resid_by_group = {}
    for key, members in data.keyed.items():
        name = members[0][1].name
        kl0, klg, ex0, exg = _fit_mismatch(key, members)
        resid_by_group[name] = sess.group_rel_rms[key]
        groups_out.append(GroupCalibration(
            name=name, accelerator=key[0], precision=key[1], kv_dtype=key[2], kernel=key[3],
            decode_scale=sess.decode_scale[key], prefill_overhead_s=sess.prefill_overhead_s[key],
            weight_sync_s=sync[key], kl_k3=kl0, kl_growth_per_staleness=klg, extreme_share=ex0,
            extreme_growth_per_staleness=exg, trajectories=data.counts[key], residual_rel_rms=resid_by_group[name]))
    workload = _measured_workload(sess.trajectories, r0.workload, sess.turn_latency_s.value)
    return Calibration(
        groups=tuple(groups_out), trainer_accelerator=r0.trainer_accelerator, trainer_gpus=r0.trainer_gpus,
        trainer_scale=t_scale, trainer_overhead_s=t_over, update_overhead_s=upd_over,
        turn_latency_s=sess.turn_latency_s, model=r0.model.name, runs=tuple(data.paths), workload=workload,
        residuals={"duration_rel_rms": sess.rel_rms, "train_step_rms_s": train_rms,
                   **{f"duration_rel_rms[{k}]": v for k, v in resid_by_group.items()}},
        counts={"runs": len(runs), "updates": data.n_updates, "trajectories": int(sess.m), "weight_pushes": pushes},
        created_utc=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), skipped=tuple(data.skipped))


__all__ = ["calibrate"]
