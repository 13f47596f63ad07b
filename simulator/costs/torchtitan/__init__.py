"""How torchtitan's own code runs a block, where it differs from a fused stack: its selective op checkpointing
(selective_op.py), its element-wise code in eager PyTorch (eager.py) and torch's context parallelism's merges
(context.py). Torch-free."""
