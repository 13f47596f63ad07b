"""SimPy replaying one training step's schedule over the network and the cost model (simulate; costs,
data_parallel, dp_overlap, host, links, overlap, replay price its actions). Imports costs/, network/ and the
top's memory, provenance and limits; never the search."""
