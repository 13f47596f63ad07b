"""Flags shared by several commands (batch, cluster, model, precision) and the --config file. Import nothing of
cli/ but each other: commands import them."""
