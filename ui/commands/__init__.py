"""The `mixfleet` subcommands, one module per area; each module exposes `register(app)`."""
