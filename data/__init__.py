"""mixfleet's data: accelerator catalog, precisions, model specs, workloads and plans (TOML).

Read them through `mixfleet.costmodel.paths.data_path()`; every number carries its source and date.
"""
