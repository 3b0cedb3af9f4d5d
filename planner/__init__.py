"""mixfleet.planner: the analytic planner, below both worlds (costmodel <- policies <- planner <- twin | runner).

Which groups, how many replicas, how many prompts in flight, from the cost model's records alone:

- defaults.py: the one set of defaults `mixfleet plan` and the app's Plan page share (a light module);
- config.py: `PlannerConfig`, what to plan for, checked field by field;
- shape.py: the workload's episode draw and its shape (`workload_shape`) for the analytic model;
- fleet.py: the analytic fleet model: candidate group types and their rates, a mix's throughput, time per update,
  staleness and cost (`group_types`, `metrics`, `feasible`);
- search.py: candidate mixes (MILP sweeps, neighbours, single types), the screen, the Pareto set, what binds, and
  the verification of the best few by a twin check the caller hands in (`plan_mix(check=..., check_map=...)`);
- spot.py: what spot preemptions are expected to cost a mix;
- solver.py: the re-planner's solver (`solver_for`), which the twin and the runner's orchestrator both attach.

Imports only mixfleet.costmodel and mixfleet.policies (tests/test_layering.py): the twin's steady-state check is a
callable handed in (twin.checks.twin_check), never imported.
"""
