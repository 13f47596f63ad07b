"""The SimPy simulator. Torch-free: never import torch anywhere under this package.

By concern: costs/ (what one GPU computes and how fast: ops, hardware profiles, measured hosts), network/ (the
cluster's graph and its collectives), engine/ (SimPy replaying a schedule over both), search/ (sweeps and
plans over many simulations). At the top: memory (bytes per GPU, from the costs' op shapes), limits and
json_file (input checks), provenance and report (what a result rests on, and its rows).
"""
