"""mixfleet.costmodel.plan.

The plan's plain-data schema, checked field by field at load, with its TOML `base` chains (`planspec`), and
its resolution (`resolve`, re-exported by `planspec`): the one "plan group -> replica cost model"
(`resolve.group_replica_model`) and the one resolved group record (`resolve.resolve_groups`).
"""
