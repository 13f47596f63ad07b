"""Cluster topologies: built from presets (a fabric sized from the switch radix) or read from a graph file.

- `build_cluster(gpu, gpus_per_node, nodes, fabric, kind, nics_per_node, oversubscription)`:
  servers of `gpus_per_node` GPUs on an NVSwitch with `nics_per_node` NICs each (default: the
  GPU's standard node's GPUs-per-NIC ratio, one NIC per GPU on DGX nodes), on a switched
  fabric of the NIC preset `fabric` ("hdr", "ndr"; default the node's) shaped as `kind`:
  "fat-tree", "rail" (rail-optimised) or "rail-only" (no spine: rails joined only through
  NVLink), with leaves oversubscribed `oversubscription`:1 when asked (default 1,
  non-blocking, with as many tiers as the radix needs). simulator/network/fabric.py says how the
  switches are counted and cabled, simulator/network/cluster_built.py how servers hang on them.
  The result is a BuiltCluster: it routes by arithmetic and draws its graph only when asked
  (saving it, or `cluster.graph`), so 100,000 GPUs cost little; simulator/limits.py's MAX_GPUS
  (131,072) is the most it builds.
- `load_cluster(path)` / `save_cluster(cluster, path)`: node-link JSON or GraphML in the form
  simulator/network/cluster.py checks; a loaded file is a Cluster that routes on its graph. Any bytes
  give a Cluster or a ConfigError naming the file (tests/test_fuzz_parsers.py), and a file
  holds at most simulator/limits.py's MAX_FILE_GPUS (16,384) GPUs.

`cluster.describe()` states the fabric (tiers, switches per tier, oversubscription).
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import networkx as nx

from minigpt.errors import ConfigError
from simulator.network.cluster import NODE_TYPES, Cluster, Edge
from simulator.network.cluster_built import BuiltCluster
from simulator.network.fabric import FABRIC_KINDS, Fabric
from simulator.costs.hardware import GPUSpec, Hardware, NICSpec, load_hardware, load_nic
from simulator.json_file import read_bytes, read_json_file
from simulator.limits import check_gpus

__all__ = ["NODE_TYPES", "CLUSTER_KINDS", "Edge", "Cluster", "BuiltCluster", "build_cluster", "save_cluster",
           "load_cluster", "default_nics_per_node", "whole_servers"]

CLUSTER_KINDS = FABRIC_KINDS


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def default_nics_per_node(gpu: GPUSpec | Hardware, gpus_per_node: int) -> int:
    """The standard node's GPUs per NIC, applied to `gpus_per_node` (one NIC per GPU for a bare GPUSpec)."""
    if not isinstance(gpu, Hardware):
        return gpus_per_node
    node = gpu.node
    gpus_per_nic = max(1, node.gpus_per_node // max(1, node.nics_per_node))
    return max(1, -(-gpus_per_node // gpus_per_nic))


def whole_servers(n_gpus: int, per_node: int, what: str, partial: bool = True) -> tuple[int, int]:
    """(GPUs a server, servers) for a job of `n_gpus` on servers of `per_node`: whole servers, or, with `partial`,
    one partly filled server below a server's worth; else one ConfigError naming `what` (the job's GPUs)."""
    if partial and n_gpus < per_node:
        return n_gpus, 1
    if n_gpus % per_node:
        other = ("or --gpus-per-node N to use N GPUs of each server (as jobs on part of each GB200 NVL72 rack do)"
                 if partial else f"or a --gpus-per-node that divides {n_gpus}")
        raise ConfigError(f"{what} do not fill whole servers of {per_node}: give a GPU count that is a multiple of "
                          f"{per_node}, {other}")
    return per_node, n_gpus // per_node


def build_cluster(
    gpu: str | GPUSpec | Hardware,
    gpus_per_node: int,
    nodes: int,
    fabric: str | NICSpec | None = None,
    kind: str = "fat-tree",
    nics_per_node: int | None = None,
    oversubscription: float = 1.0,
) -> BuiltCluster:
    """A cluster of `nodes` servers with `gpus_per_node` GPUs each (see the module docstring).

    gpu: a preset name, a GPUSpec or a Hardware; fabric: a NIC preset name or NICSpec
    (None: the NIC of the GPU's standard node, or "ndr" for a bare GPUSpec).
    """
    _positive("gpus_per_node", gpus_per_node)
    _positive("nodes", nodes)
    check_gpus(gpus_per_node * nodes, f"a cluster of {nodes:,} servers of {gpus_per_node:,} GPUs")
    if kind not in CLUSTER_KINDS:
        raise ConfigError(f"unknown cluster kind {kind!r}: choose one of {', '.join(CLUSTER_KINDS)}")
    if isinstance(gpu, str):
        gpu = load_hardware(gpu)
    default_nic = gpu.nic if isinstance(gpu, Hardware) else load_nic("ndr")
    nic = default_nic if fabric is None else (load_nic(fabric) if isinstance(fabric, str) else fabric)
    nics = default_nics_per_node(gpu, gpus_per_node) if nics_per_node is None else nics_per_node
    spec = gpu.gpu if isinstance(gpu, Hardware) else gpu
    plan = Fabric(kind, nodes, gpus_per_node, nics, nic.switch_radix, oversubscription)
    return BuiltCluster(plan, spec, nic)


# ---------------------------------------------------------------- files


def save_cluster(cluster: Cluster | nx.Graph, path: str | Path) -> Path:
    """Write a topology as node-link JSON (.json) or GraphML (.graphml)."""
    graph = cluster.graph if isinstance(cluster, Cluster) else cluster
    path = Path(path)
    if path.suffix == ".json":
        try:
            data = nx.node_link_data(graph, edges="edges")
        except TypeError:  # networkx < 3.4 names the keyword `link`
            data = nx.node_link_data(graph, link="edges")
        path.write_text(json.dumps(data, indent=1) + "\n")
    elif path.suffix == ".graphml":
        nx.write_graphml(graph, path)
    else:
        raise ConfigError(f"cannot save a topology as {path.name!r}: use a .json (node-link) or .graphml file name")
    return path


def load_cluster(path: str | Path) -> Cluster:
    """Read a topology written by save_cluster (or by hand in the same form) and check it.

    Whatever the file's bytes, the result is a Cluster or a ConfigError naming the file: JSON goes
    through simulator/json_file.py (size, UTF-8, depth) and node_link_graph below (JSON types), GraphML
    through networkx's reader, and both through the checks of Cluster (simulator/network/cluster.py)."""
    path = Path(path)
    if path.suffix not in (".json", ".graphml"):
        raise ConfigError(f"cannot read a topology from {path.name!r}: use a .json (node-link) or .graphml file")
    if path.suffix == ".graphml":
        data = read_bytes(path, "topology file")
        try:
            with warnings.catch_warnings():  # networkx warns of undeclared keys (read as strings): Cluster checks them
                warnings.simplefilter("ignore")
                graph = nx.read_graphml(io.BytesIO(data))
        except Exception as error:  # the XML parser and networkx raise several kinds
            message = " ".join(str(error).split())[:200]
            raise ConfigError(f"topology file {str(path)!r} is not valid GraphML ({message}): fix or re-save it") from None
        return Cluster(graph, origin=str(path))
    data = read_json_file(path, "topology file")
    return Cluster(node_link_graph(data, str(path)), origin=str(path))


def node_link_graph(data: object, origin: str) -> nx.Graph:
    """The graph of a decoded node-link document (networkx's form: "nodes" with an "id" each, "edges" or
    "links" with "source" and "target", optional "graph", "directed", "multigraph"), every part checked
    for its JSON type first; the attributes are Cluster's to check. A file that leaves "multigraph" out
    is a simple graph (networkx would take it for a multigraph, which Cluster refuses)."""
    edges_key = "edges" if isinstance(data, dict) and "edges" in data else "links"
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not isinstance(data.get(edges_key), list):
        raise ConfigError(f"topology file {origin!r} is not node-link JSON: it needs 'nodes' and 'edges' lists")
    where = f"topology file {origin!r}"
    for key in ("directed", "multigraph"):
        if not isinstance(data.get(key, False), bool):
            raise ConfigError(f"{where}: '{key}' must be true or false, got {data[key]!r}")
    if data.get("multigraph", False):
        raise ConfigError(f"{where}: parallel edges are not supported: merge them into one edge per direction "
                          "and set \"multigraph\": false")
    attributes = data.get("graph", {})
    if not isinstance(attributes, dict):
        raise ConfigError(f"{where}: 'graph' must be a JSON object of attributes, got {attributes!r}")
    graph = nx.DiGraph() if data.get("directed", False) else nx.Graph()
    graph.graph.update(attributes)
    for index, node in enumerate(data["nodes"]):
        name = _endpoint(node, "id", f"{where}: nodes[{index}]")
        if str(name) in graph:
            raise ConfigError(f"{where}: node id {str(name)!r} appears twice: give every node its own id")
        graph.add_node(str(name))
        graph.nodes[str(name)].update((k, v) for k, v in node.items() if k != "id")
    for index, edge in enumerate(data[edges_key]):
        at = f"{where}: {edges_key}[{index}]"
        ends = [str(_endpoint(edge, key, at)) for key in ("source", "target")]
        missing = [end for end in ends if end not in graph]
        if missing:
            raise ConfigError(f"{at} names node {missing[0]!r}, which is not in 'nodes'")
        graph.add_edge(*ends)  # given twice, the later attributes win (as networkx reads it)
        graph.edges[tuple(ends)].update((k, v) for k, v in edge.items() if k not in ("source", "target"))
    return graph


def _endpoint(entry: object, key: str, where: str) -> str | int:
    """entry[key] when entry is a JSON object and that is a string or an integer (a node id)."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a JSON object, got {entry!r}")
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"{where} needs a string or integer {key!r}, got {value!r}")
    return value
