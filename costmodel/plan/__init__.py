"""mixfleet.costmodel.plan.

The plan's plain-data schema, checked field by field at load, with its TOML `base` chains, the one
"plan group -> replica cost model" (`planspec.group_replica_model`) and the one resolved group record
(`planspec.resolve_groups`).
"""
