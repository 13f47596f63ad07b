"""One training job on the ranks: building the parallel model (build), the loop (train) and the step, resume,
the run directory and its files, the loss plot, and sampling from a checkpoint. Imports the parallelisms, the
checkpoints, the launcher and the shared pieces; none of them imports it."""
