"""mixfleet.costmodel: numbers. Accelerator / precision / model / workload specs, the step-time and
memory model, prices, mismatch priors, calibration, and the run-log record types.

Pure Python + numpy; imports nothing else of mixfleet.
"""
