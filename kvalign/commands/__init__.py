"""One module per ``kvalign`` subcommand; each exposes ``register(subparsers)``."""
