"""The switched fabric of a built cluster, as it would be cabled, and its routes by arithmetic. Torch-free.

A `Fabric` is the plan of a folded-Clos (fat-tree) network of switches with the NIC
preset's `switch_radix` R ports, and it routes without a graph, so a 100,000-GPU cluster
costs a few numbers instead of a million networkx edges (cluster_built.BuiltCluster draws
the graph from it only when asked).

Leaves. A non-blocking leaf uses half its ports (h = R // 2) down to NICs and half up. With
`oversubscription` o > 1 (asked for by the user) a leaf uses d = floor(R o / (o + 1)) ports
down and R - d up: fewer leaves and tiers, d:up times less bandwidth out of a leaf.
Which NIC sits on which leaf (NIC k of node n, K NICs per node):
  fat-tree   NICs fill leaves in rank order (n K + k).
  rail       rail-optimised: NIC k of every node on rail k's leaves; leaves ordered by
             (block of d nodes, rail), so a pod holds whole blocks of nodes, every rail.
  rail-only  Wang et al. 2023 ("How to Build Low-cost Networks for Large Language Models
             (without Sacrificing Performance)"): one separate tree per rail and nothing
             joining the rails; traffic between different rails first crosses NVLink in
             the source server to the GPU on the destination's rail (cluster_built.py).

Tiers above the leaves, "as many switches as needed", the cables between two switches merged
into one edge of their summed bandwidth (flows on it share it as if spread evenly over its
cables, as adaptive routing would):
  one leaf: no more tiers.
  top tier: each of its switches has R ports down; the children below it (leaves, or the
            groups of a mid tier) each send U cables up (U: what a child needs to be
            non-blocking, the leaf's NICs over the oversubscription); g top switches per
            plane, g = ceil(children x U / R) rounded up to a divisor of U, every child
            cabled to every top switch of its plane with U / g cables. Possible while
            children <= R.
  mid tier: when there are more than R children, groups of h children share U mid
            switches ("planes": child cable j goes to the group's mid switch j), each with
            as many cables up as children below it. The groups become the top's children.
So a fabric takes 2 tiers up to R^2/2 NICs (non-blocking), 3 up to R^3/4, and so on.

Routes are up-down and choose their way up by the destination, like InfiniBand's D-mod-k
tables: leaving a leaf on cable (destination slot mod U), leaving a mid switch on cable
(the destination's position in the next group mod U), so one shift of traffic (a ring's step,
a pipeline send) is contention-free in a non-blocking tree; two at once (a ring's wrap-around
hop, sends both ways) may meet on a cable, as on real static routing tables. The lowest common tier t of two NICs
costs 2t - 1 switch traversals (1 on one leaf, 3 through a spine).

Edges are numbers (fast to count at 100,000 GPUs); `decode` turns one into its two ends, tuple
nodes ("gpu", rank), ("nvs", node), ("nic", node * K + k), ("sw", tree, tier, index).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from minigpt.errors import ConfigError

FABRIC_KINDS = ("fat-tree", "rail", "rail-only")
LINK_CLASSES = ("nvlink", "nic", "cable", "top")  # an edge number's last two bits: GPU-NVSwitch, GPU-NIC and
# NIC-leaf (the NIC's bandwidth), switch-to-switch of one cable, into or out of a top switch (several cables)

Node = tuple


def _smallest_divisor_at_least(value: int, least: int) -> int:
    return next(d for d in range(max(1, least), value + 1) if value % d == 0)


def leaf_ports(radix: int, oversubscription: float) -> tuple[int, int]:
    """(ports down to NICs, ports up) of a leaf."""
    if isinstance(oversubscription, bool) or not isinstance(oversubscription, (int, float)) or not oversubscription >= 1:
        raise ConfigError(f"oversubscription must be a number >= 1 (1: non-blocking, 2: 2:1), got {oversubscription!r}")
    down = radix // 2 if oversubscription == 1 else min(radix - 1, int(radix * oversubscription / (oversubscription + 1)))
    return down, radix - down


@dataclass(frozen=True)
class Fabric:
    """A built cluster's servers and switches (see the module docstring)."""

    kind: str
    nodes: int
    gpus_per_node: int
    nics_per_node: int
    radix: int
    oversubscription: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in FABRIC_KINDS:
            raise ConfigError(f"unknown cluster kind {self.kind!r}: choose one of {', '.join(FABRIC_KINDS)}")
        k, g = self.nics_per_node, self.gpus_per_node
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= g:
            raise ConfigError(f"nics_per_node must be a whole number from 1 to gpus_per_node ({g}), got {k!r}")
        if self.radix < 2:
            raise ConfigError(f"a switch needs at least 2 ports, got radix {self.radix}")
        leaf_ports(self.radix, self.oversubscription)

    # ------------------------------------------------------------ plan

    @cached_property
    def leaf_down(self) -> int:
        return leaf_ports(self.radix, self.oversubscription)[0]

    @cached_property
    def trees(self) -> int:
        return self.nics_per_node if self.kind == "rail-only" else 1

    @cached_property
    def leaves(self) -> int:
        """Leaves per tree."""
        blocks = -(-self.nodes // self.leaf_down)
        if self.kind == "fat-tree":
            return -(-self.nodes * self.nics_per_node // self.leaf_down)
        return blocks * (self.nics_per_node if self.kind == "rail" else 1)

    @cached_property
    def nics_on_busiest_leaf(self) -> int:
        per_tree = self.nodes * self.nics_per_node if self.kind == "fat-tree" else self.nodes
        return min(self.leaf_down, per_tree)

    @cached_property
    def _shape(self) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(U per tier below the top, children count per tier below the top, top switches per plane)."""
        if self.leaves == 1:
            return (), (), 0
        up = self.radix - self.leaf_down
        uplinks = [min(up, -(-self.nics_on_busiest_leaf * up // self.leaf_down))]
        groups = [self.leaves]
        half = self.radix // 2
        while groups[-1] > self.radix:
            children = groups[-1]
            groups.append(-(-children // half))
            uplinks.append(min(half, children))
        per_plane = _smallest_divisor_at_least(uplinks[-1], -(-groups[-1] * uplinks[-1] // self.radix))
        return tuple(uplinks), tuple(groups), per_plane

    @property
    def tiers(self) -> int:
        """Switch tiers: 1 (leaves only), 2 (leaf-spine), 3, ..."""
        return len(self._shape[0]) + 1

    @property
    def uplinks(self) -> tuple[int, ...]:
        return self._shape[0]

    def _planes(self, tier: int) -> int:
        """Switches per group at a mid tier, planes of the top tier's switches (tier >= 2)."""
        return math.prod(self.uplinks[: tier - 1]) if tier < self.tiers else math.prod(self.uplinks[: tier - 2])

    def switches_per_tree(self, tier: int) -> int:
        uplinks, groups, per_plane = self._shape
        if tier == 1:
            return self.leaves
        if tier < self.tiers:
            return groups[tier - 1] * self._planes(tier)
        return self._planes(tier) * per_plane

    @cached_property
    def switch_counts(self) -> tuple[int, ...]:
        """Switches per tier (leaves first), all trees together."""
        return tuple(self.trees * self.switches_per_tree(t) for t in range(1, self.tiers + 1))

    @property
    def top_cables(self) -> int:
        """Cables between a top switch and each switch below it in its plane."""
        uplinks, _, per_plane = self._shape
        return uplinks[-1] // per_plane if uplinks else 1

    @property
    def leaf_oversubscription(self) -> float:
        """NICs per uplink on the busiest leaf (1: non-blocking; 0 tiers above: 1)."""
        return self.nics_on_busiest_leaf / self.uplinks[0] if self.uplinks else 1.0

    def describe(self) -> str:
        kind = {"fat-tree": "fat-tree", "rail": "rail-optimised fat-tree", "rail-only": "rail-only"}[self.kind]
        names = [("leaf", "leaves"), ("spine", "spines"), ("core switch", "core switches")]
        names += [(f"tier-{t} switch", f"tier-{t} switches") for t in range(4, self.tiers + 1)]
        counts = ", ".join(f"{n} {name[n != 1]}" for n, name in zip(self.switch_counts, names))
        trees = f" in {self.trees} separate rails" if self.trees > 1 else ""
        ratio = self.leaf_oversubscription
        blocking = "non-blocking" if ratio <= 1 else f"oversubscribed {ratio:.3g}:1 at the leaves"
        return (f"{kind}, {self.nics_per_node} NICs per node, {self.tiers}-tier of {self.radix}-port switches{trees} "
                f"({counts}), {blocking}")

    # ------------------------------------------------------------ places

    def nic_of(self, local: int) -> int:
        """The NIC (0..K-1) a GPU in position `local` of its server uses."""
        return local * self.nics_per_node // self.gpus_per_node

    def nic_place(self, nic: int) -> tuple[int, int, int]:
        """(tree, leaf, slot) of NIC `nic` (node * K + k)."""
        node, k = divmod(nic, self.nics_per_node)
        d = self.leaf_down
        if self.kind == "fat-tree":
            return 0, nic // d, nic % d
        if self.kind == "rail":
            return 0, node // d * self.nics_per_node + k, node % d
        return k, node // d, node % d

    # ------------------------------------------------------------ routes, as edge numbers

    @cached_property
    def _numbering(self) -> tuple[int, int, int, int]:
        """(first NIC edge number, first switch edge number, switch ids per tier and tree, switch ids in all)."""
        per_tier = max(self.switches_per_tree(t) for t in range(1, self.tiers + 1))
        nic_base = 16 * self.nodes * self.gpus_per_node
        return nic_base, nic_base + 8 * self.nodes * self.nics_per_node, per_tier, self.tiers * self.trees * per_tier

    def switch_id(self, tier: int, tree: int, index: int) -> int:
        return ((tier - 1) * self.trees + tree) * self._numbering[2] + index

    def route(self, a: int, b: int, edges: list[int]) -> tuple[int, int, int]:
        """Append the numbered edges from rank a to rank b to `edges`; return the route's latency units."""
        units, numbers = self.routes([(a, b)])[0]
        edges += numbers
        return units

    @cached_property
    def _route_constants(self) -> tuple:
        """What `routes` needs per tier, looked up once (it runs for every flow of a big cluster)."""
        uplinks, _, per_plane = self._shape
        half, tiers, per_tier = self.radix // 2, self.tiers, self._numbering[2]
        span = [0] + [half ** (t - 1) for t in range(1, tiers + 1)]  # leaves under a group of tier t
        planes = [0, 1] + [self._planes(t) for t in range(2, tiers + 1)]
        first_id = [0] + [(t - 1) * self.trees * per_tier for t in range(1, tiers + 1)]
        cables = [0] + [uplinks[t - 1] for t in range(1, tiers)]  # U of tier t
        share = uplinks[-1] // per_plane if uplinks else 1
        nic_of = [self.nic_of(local) for local in range(self.gpus_per_node)]
        return tiers, half, span, planes, first_id, cables, per_plane, share, per_tier, nic_of

    def routes(self, flows) -> list[tuple[tuple[int, int, int], list[int]]]:
        """For each flow (rank a, rank b): its latency units (NVLink steps, NIC-to-NIC messages, switch
        traversals) and its numbered edges. An edge number's last two bits are its class (LINK_CLASSES);
        `decode` names its ends. One loop for all flows: this is the fast path's hot spot."""
        per_node, k, kind, d = self.gpus_per_node, self.nics_per_node, self.kind, self.leaf_down
        nic_base, switch_base, _, ids = self._numbering
        tiers, half, span, planes, first_id, cables, per_plane, share, per_tier, nic_of = self._route_constants
        out = []
        for a, b in flows:
            node_a, local_a = divmod(a, per_node)
            node_b, local_b = divmod(b, per_node)
            if node_a == node_b:
                out.append(((1, 0, 0), [(a * 4) << 2, (b * 4 + 1) << 2]) if a != b else ((0, 0, 0), []))
                continue
            nic_a, nic_b, steps, edges = nic_of[local_a], nic_of[local_b], 0, []
            if kind == "rail-only" and nic_a != nic_b:  # NVLink to the GPU on b's rail first
                via = node_a * per_node + local_b
                edges += ((a * 4) << 2, (via * 4 + 1) << 2)
                a, nic_a, steps = via, nic_b, 1
            tree, slot_b = (nic_a if kind == "rail-only" else 0), node_b % d
            if kind == "fat-tree":
                leaf_a, (leaf_b, slot_b) = (node_a * k + nic_a) // d, divmod(node_b * k + nic_b, d)
            else:
                leaf_a, leaf_b = node_a // d, node_b // d
                if kind == "rail":
                    leaf_a, leaf_b = leaf_a * k + nic_a, leaf_b * k + nic_b
            nic_a, nic_b = node_a * k + nic_a, node_b * k + nic_b
            edges += (((a * 4 + 2) << 2) | 1, nic_base + (nic_a << 3) + 1)
            top = 1
            if leaf_a != leaf_b:
                top = 2
                while top < tiers and leaf_a // span[top] != leaf_b // span[top]:
                    top += 1
                offset = tree * per_tier
                here, plane, path_planes = first_id[1] + offset + leaf_a, 0, [0, 0]
                for tier in range(2, top + 1):  # up, the cable picked by the destination (D-mod-k)
                    cable = (slot_b if tier == 2 else leaf_b // span[tier - 2] % half) % cables[tier - 1]
                    if tier < tiers:
                        plane = plane * cables[tier - 1] + cable
                        above, link = first_id[tier] + offset + leaf_a // span[tier] * planes[tier] + plane, 2
                    else:
                        above, link = first_id[tier] + offset + plane * per_plane + cable // share, 3
                    edges.append(switch_base + ((here * ids + above) << 2) + link)
                    here = above
                    path_planes.append(plane)
                for tier in range(top - 1, 0, -1):  # down, the way forced
                    below = first_id[tier] + offset + (leaf_b if tier == 1 else
                                                       leaf_b // span[tier] * planes[tier] + path_planes[tier])
                    edges.append(switch_base + ((here * ids + below) << 2) + (3 if tier + 1 == tiers else 2))
                    here = below
            edges += (nic_base + (nic_b << 3) + 5, ((b * 4 + 3) << 2) | 1)
            out.append(((steps, 1, 2 * top - 1), edges))
        return out

    def decode(self, edge: int) -> tuple[Node, Node]:
        """The two ends of a numbered edge, as tuple nodes."""
        nic_base, switch_base, per_tier, ids = self._numbering
        if edge < nic_base:
            rank, which = divmod(edge >> 2, 4)
            node = rank // self.gpus_per_node
            other = ("nvs", node) if which < 2 else ("nic", node * self.nics_per_node + self.nic_of(rank % self.gpus_per_node))
            return (("gpu", rank), other) if which % 2 == 0 else (other, ("gpu", rank))
        if edge < switch_base:
            nic, down = divmod((edge - nic_base) >> 2, 2)
            tree, leaf, _ = self.nic_place(nic)
            ends = (("nic", nic), ("sw", tree, 1, leaf))
            return ends[::-1] if down else ends
        ends = []
        for switch in divmod((edge - switch_base) >> 2, ids):
            level, index = divmod(switch, per_tier)
            tier, tree = divmod(level, self.trees)
            ends.append(("sw", tree, tier + 1, index))
        return ends[0], ends[1]

    # ------------------------------------------------------------ the cables, for drawing the graph

    def switch_links(self):
        """Every switch-to-switch link once, upwards: (tree, tier, index below, index above, cables)."""
        uplinks, groups, per_plane = self._shape
        half = self.radix // 2
        for tree in range(self.trees):
            for tier in range(1, self.tiers):
                planes_below = self._planes(tier) if tier > 1 else 1
                for index in range(self.switches_per_tree(tier)):
                    group, plane = divmod(index, planes_below)
                    if tier + 1 < self.tiers:
                        base = group // half * self._planes(tier + 1) + plane * uplinks[tier - 1]
                        for cable in range(uplinks[tier - 1]):
                            yield tree, tier, index, base + cable, 1
                    else:
                        for member in range(per_plane):
                            yield tree, tier, index, plane * per_plane + member, uplinks[tier - 1] // per_plane

    def switch_link_count(self) -> int:
        """How many switch-to-switch links (one direction) switch_links yields, by arithmetic."""
        if self.tiers == 1:
            return 0
        total = 0
        for tier in range(1, self.tiers):
            fan = self.uplinks[tier - 1] if tier + 1 < self.tiers else self._shape[2]
            total += self.switches_per_tree(tier) * fan
        return total * self.trees
