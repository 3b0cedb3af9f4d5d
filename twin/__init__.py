"""mixfleet.twin: the simulated world. A SimPy discrete-event model of samplers, router, autoscaler,
trainer and weight sync, plus the mix planner. Never imports torch or mixfleet.runner.
"""
