"""Starting the ranks of a run: torch's elastic launcher or torchrun's ranks (elastic), a warm process that forks
them (rank_start), torchrun's environment (torchrun_env) and the heartbeat that ends a run whose launcher died
(watchdog). Imports nothing else of parallel/: it starts ranks, it does not know what they run."""
