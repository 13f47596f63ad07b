"""Context parallelism: a sequence split over a group in the load-balanced causal way (chunks), and exact
causal attention across it, by a ring of key/value blocks (ring) or by gathering them whole (allgather),
both built from blockwise attention with log-sum-exp merging (blocks). Imports nothing else of parallel/.
Not yet wired into training: the mesh's cp dimension, the model's attention hook and the schedule's actions
come next (issue 27)."""
