"""Parallel training on torch.distributed: mesh, launch, tensor, pipeline, ZeRO, the training loop.

Kept light: `import job.schedule` must not import torch.
"""
