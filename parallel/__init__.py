"""Parallel training on torch.distributed, by concern: one subpackage per parallelism and per job piece.

At the top, the shared pieces every room below may import (and that import none of them): mesh (the process
groups), comm (collectives over them), clock (the trace), device, memory, gpu_files, backward and recompute.
Kept light: `import job.schedule` must not import torch.
"""
