"""Tensor parallelism: Megatron-style layers and their collectives (layers), applied to the plain model from
outside (parallelize). Imports the shared pieces (comm) only."""
