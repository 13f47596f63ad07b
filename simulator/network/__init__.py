"""The cluster as a networkx graph (fabric, topology, cluster, cluster_built) and the collectives' flows over
it with max-min fair sharing (collectives). Imports the cost model's hardware figures; never the engine."""
