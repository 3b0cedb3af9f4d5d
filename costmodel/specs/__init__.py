"""mixfleet.costmodel.specs.

Specs read from data/: the accelerator and precision catalog with prices (`catalog`), the one format
registry (`formats`, from data/precisions.toml), model and workload specs (`model`, `workload`, with the
workload's distributions in `dist`) and the sampler-trainer mismatch priors (`mismatch`).
"""
