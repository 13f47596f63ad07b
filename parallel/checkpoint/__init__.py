"""Sharded checkpoints that load into any layout (sharded, on torch.distributed.checkpoint: dcp), their files and
the layout they were written in. Imports nothing else of parallel/."""
