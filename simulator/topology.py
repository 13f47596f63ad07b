"""Cluster topologies: built from presets (a fabric sized from the switch radix) or read from a graph file.

- `build_cluster(gpu, gpus_per_node, nodes, fabric, kind, nics_per_node, oversubscription)`:
  servers of `gpus_per_node` GPUs on an NVSwitch with `nics_per_node` NICs each (default: the
  GPU's standard node's GPUs-per-NIC ratio, one NIC per GPU on DGX nodes), on a switched
  fabric of the NIC preset `fabric` ("hdr", "ndr"; default the node's) shaped as `kind`:
  "fat-tree", "rail" (rail-optimised) or "rail-only" (no spine: rails joined only through
  NVLink), with leaves oversubscribed `oversubscription`:1 when asked (default 1,
  non-blocking, with as many tiers as the radix needs). simulator/fabric.py says how the
  switches are counted and cabled, simulator/cluster_built.py how servers hang on them.
  The result is a BuiltCluster: it routes by arithmetic and draws its graph only when asked
  (saving it, or `cluster.graph`), so 100,000 GPUs cost little.
- `load_cluster(path)` / `save_cluster(cluster, path)`: node-link JSON or GraphML in the form
  simulator/cluster.py checks; a loaded file is a Cluster that routes on its graph.

`cluster.describe()` states the fabric (tiers, switches per tier, oversubscription).
"""

from __future__ import annotations

import json
from pathlib import Path

import networkx as nx

from minigpt.errors import ConfigError
from simulator.cluster import NODE_TYPES, Cluster, Edge
from simulator.cluster_built import BuiltCluster
from simulator.fabric import FABRIC_KINDS, Fabric
from simulator.hardware import GPUSpec, Hardware, NICSpec, load_hardware, load_nic

__all__ = ["NODE_TYPES", "CLUSTER_KINDS", "Edge", "Cluster", "BuiltCluster", "build_cluster", "save_cluster",
           "load_cluster", "default_nics_per_node"]

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
    """Read a topology written by save_cluster (or by hand in the same form) and check it."""
    path = Path(path)
    if path.suffix not in (".json", ".graphml"):
        raise ConfigError(f"cannot read a topology from {path.name!r}: use a .json (node-link) or .graphml file")
    if not path.is_file():
        raise ConfigError(f"topology file {str(path)!r} does not exist: give the path of a .json or .graphml file")
    if path.suffix == ".graphml":
        try:
            graph = nx.read_graphml(path)
        except Exception as error:  # the XML parser and networkx raise several kinds
            raise ConfigError(f"topology file {str(path)!r} is not valid GraphML ({error}): fix or re-save it") from None
        return Cluster(graph, origin=str(path))
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"topology file {str(path)!r} is not valid JSON (line {error.lineno}: {error.msg}): fix the file") from None
    if not isinstance(data, dict) or "nodes" not in data or not ({"edges", "links"} & data.keys()):
        raise ConfigError(f"topology file {str(path)!r} is not node-link JSON: it needs 'nodes' and 'edges' lists")
    edges_key = "edges" if "edges" in data else "links"
    try:
        try:
            graph = nx.node_link_graph(data, edges=edges_key)
        except TypeError:  # networkx < 3.4
            graph = nx.node_link_graph(data, link=edges_key)
    except (KeyError, TypeError, ValueError, nx.NetworkXError) as error:
        raise ConfigError(f"topology file {str(path)!r} is malformed node-link JSON ({error!r}): fix or re-save it") from None
    return Cluster(graph, origin=str(path))
