"""Context parallelism: a sequence split over a group in the load-balanced causal way (chunks), exact causal
attention across it by a ring of key/value blocks (ring) or by gathering them whole (allgather), both built
from blockwise attention with log-sum-exp merging (blocks), and the plain model made context-parallel from
outside (apply: its attention cores swapped, positions at the tokens' true offsets). Imports the model and
nothing else of parallel/. Not yet wired into training: the mesh's cp dimension, the run's data split and
gradient reduction over cp x dp, and the schedule's actions come next (issue 27)."""
