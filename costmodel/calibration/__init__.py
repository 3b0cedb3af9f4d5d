"""Calibration: fit the cost model's free parameters to run logs, so the twin predicts what really happens.

The twin's numbers come from a roofline with prior efficiency factors (roofline.py) and mismatch priors
(mismatch.py). A run log (runlog.py; real or simulated) holds what happened: per trajectory its group,
replica, turns, tokens and [start, end]; per update the train and sync seconds; per group and update the
measured KL and extreme-ratio share with the staleness. `calibrate(runlogs)` fits, by bounded least
squares (scipy.optimize.least_squares), per group (accelerator, precision, KV dtype, kernel):

- decode_scale (x): multiplier on the prior roofline's decode-step time and prefill compute (1 = prior);
- prefill_overhead_s (s): fixed seconds per prefill call (a turn's admission), before emulation slowdown;
- weight_sync_s (s): trainer-blocking seconds to push a version to the group (per-group push events plus
  the export time shared by all groups: update.weight_sync_s - slowest push);
- kl_k3 and its growth per version of staleness, extreme-ratio share and its growth (kl = kl0 (1 + g s));

and shared: turn_latency_s (seconds between a reply and the next request: tools, HTTP, agent), the
trainer's scale on its roofline compute time and its fixed overhead per update, and update_overhead_s
(seconds between an update's end and the next start that no missing batch explains: checkpointing,
logging). It also measures the workload (turns, prompt / reply / tool-output tokens) as empirical
distributions, so a fidelity check simulates the workload that really ran.

The duration model of a trajectory i on replica r (processor sharing with serial prefill, as the twin):

    dur_i = decode_scale * (tokens_i / <(n_kv/n) / step(n_kv(t), L(t))>_i + prefill_compute_i)
            + prefill_overhead_s * slowdown * prefill_calls_i + tool_i

where tool_i is the trajectory's logged tool seconds (`tool_s`), else turn_latency_s * (turns_i - 1) with
turn_latency_s fitted; step is the prior decode step at the replica's concurrency n(t) (trajectories of r
active at t), of which n_kv = min(n, KV capacity / L) decode at once (the rest wait for KV), and their mean
context L(t) (a trajectory's: (prompt + generated) / 2); <.>_i is the time average over [start_i, end_i];
prefill_compute_i and prefill_calls_i are the prior prefill seconds and the prefill calls of every
trajectory of r spread evenly over its own life, integrated over i's life. It is linear in the parameters;
residuals are absolute (sessions.DURATION_RESIDUALS). Uncertainties: covariance = s^2 (J^T J)^-1 with
s^2 = sum(r^2) / (m - p); a parameter whose data do not vary enough to identify it is fixed at its prior and
marked `fitted = false`.

Pure numpy / scipy / pandas (no simpy, no torch): costmodel imports nothing of ours outside costmodel.

The modules, one per fit:

- `record`: The calibration record: fitted values (`Fitted`), per group (`GroupCalibration`) and for a run's fleet
- `logs`: What a fit reads from run logs: the logs checked (one model, one trainer, enough updates and trajectories
- `lsq`: Bounded linear least squares with standard errors, and the spread test that says whether data identify a
- `sessions`: The duration fit: a time scale per group (decode + prefill) and the shared turn latency, from each
- `trainer`: The trainer fit: its scale on the prior compute time, its fixed overhead per update, and the gap
- `weight_sync`: The weight-sync fit: per group, its mean push plus the export shared by all groups.
- `mismatch_fit`: The mismatch fit: a group's KL and extreme-ratio share at staleness 0 and their growth per version
- `workload_fit`: The measured workload: empirical turns, first-prompt and reply tokens; tool tokens by regression.
- `fit`: `calibrate`: the fits composed into a `Calibration`.
"""
