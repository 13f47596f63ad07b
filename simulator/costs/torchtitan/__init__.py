"""How torchtitan's own code runs a block, where it differs from a fused stack: its selective op checkpointing
(selective_op.py) and its element-wise code in eager PyTorch (eager.py). Torch-free."""
