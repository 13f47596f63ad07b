"""`minigpt calibrate`: this machine measured for the simulator (measure: the ranks' plan and the profile; device,
host, kernels, links: what they time; noise: how quiet the machine was). The top room of parallel/: it imports
the launcher, the tensor-parallel model pieces and the shared pieces."""
