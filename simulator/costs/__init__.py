"""The cost model: what one GPU or CPU host computes for a job and how fast (ops, the layers' ops, op_types,
compute, efficiency, achieved, hardware profiles and presets, measured hosts). Imports only simulator's top
input checks (json_file, limits): never the engine, the network or the search."""
