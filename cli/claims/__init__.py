"""The seed article's checkable claims, each run here against ours (claim: the record; one module per topic;
registry: all of them in order; report: the table; sim: one simulated step)."""
