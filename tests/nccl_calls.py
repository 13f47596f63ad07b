"""Helpers the collective tests share (tests/test_sim_nccl.py, tests/test_sim_gb200.py): a cluster's link costs with
an algorithm chosen, and the one call a collective records (its algorithm, seconds, bytes, ranks)."""

from __future__ import annotations

from simulator.costs.hardware import load_hardware
from simulator.engine.links import LinkCosts
from simulator.network.topology import build_cluster


def links(gpu: str, per_node: int, nodes: int, layout, algorithm: str = "auto", hardware=None) -> LinkCosts:
    hardware = hardware or load_hardware(gpu)
    costs = LinkCosts(build_cluster(hardware, per_node, nodes), layout, hardware.gpu)
    costs.select(algorithm)
    return costs


def tp_call(costs: LinkCosts, nbytes: float, kind: str = "all_reduce") -> dict:
    seconds = costs.tp_collective(kind, nbytes)
    call = next(c for c in costs.calls.values() if c["group"] == "tp" and c["kind"] == kind and c["bytes"] == nbytes)
    assert call["seconds"] == seconds
    return call
