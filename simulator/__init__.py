"""The SimPy simulator. Torch-free: never import torch anywhere under this package."""
