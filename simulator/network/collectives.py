"""Collectives as SimPy processes that move bytes over the links of a Cluster.

Network model (fluid, alpha-beta):
- a transfer first waits its route's latency (the sum of its edges' latencies, paid
  once), then streams its bytes as one flow over every directed edge of the route at
  once (no store-and-forward);
- flows sharing a directed edge share its bandwidth max-min fairly, computed by
  progressive filling whenever a flow starts or ends: the edge offering the smallest
  equal share fixes the rate of its flows, their rates are taken off the other edges,
  and so on. A lone flow runs at its route's bottleneck bandwidth.

Achieved bandwidth: NCCL never reaches the datasheet. `LinkFractions` scales every NVLink
edge (to or from an NVSwitch) by the GPU's `reached.nvlink_fraction` and every other edge
(NIC, switches) by the NIC's `busbw_fraction` (simulator/costs/rates/achieved.py): both are bus
bandwidths as nccl-tests defines them (a ring all-reduce of S bytes over n ranks moves
2(n-1)/n S per rank at the bus bandwidth), and a ring here moves exactly that over its
slowest link, so the large-message limit of a ring is the fraction times the link.
Fractions 1 (the default) leave the datasheet as it is.

Collectives (a group is a list of GPU ids or ranks; S = the full buffer in bytes, the
gathered size for all-gather and reduce-scatter):
- ring all-reduce: 2(n-1) steps, in each every rank sends S/n to the next rank in
  group order; a step ends when its slowest transfer does (steps are synchronous).
- ring all-gather, ring reduce-scatter: (n-1) such steps of S/n.
- tree all-reduce: one binary tree in group order (heap layout: parent of i is
  (i-1)//2), reduce to the root then broadcast back down; `chunks` > 1 pipelines it
  (a node forwards chunk c once its children have sent chunk c). Not the double tree.
- broadcast: binomial tree from the root, ceil(log2 n) rounds of S.
- p2p: one transfer of S.
- hierarchical all-reduce: reduce-scatter inside every server, ring all-reduce of
  S/m among the ranks with the same position on every server (m ranks per server,
  all these rings at once), all-gather inside every server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import simpy

from minigpt.errors import ConfigError
from simulator.network.cluster import Cluster, Edge

FINISH_TOLERANCE = 1e-9  # flows due within this relative time of the earliest finish end together


@dataclass(frozen=True)
class LinkFractions:
    """What collectives reach of the datasheet: on NVLink edges and on network edges (NICs, switches)."""

    nvlink: float = 1.0
    network: float = 1.0

    def __post_init__(self) -> None:
        for name in ("nvlink", "network"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"the {name} bandwidth fraction must be in (0, 1], got {value!r}")

    def of(self, kind: str) -> float:
        return self.nvlink if kind == "nvlink" else self.network


@dataclass(eq=False)
class Flow:
    """The bytes of one transfer in flight."""

    edges: list[Edge]
    remaining: float
    done: simpy.Event
    rate: float = 0.0
    finish_at: float = field(default=math.inf)


class Network:
    """A SimPy environment over a Cluster; `transfer` moves bytes with fair sharing."""

    def __init__(self, cluster: Cluster, env: simpy.Environment | None = None,
                 fractions: LinkFractions | None = None) -> None:
        self.cluster = cluster
        self.env = env if env is not None else simpy.Environment()
        self.fractions = fractions or LinkFractions()
        self._capacity: dict[Edge, float] = {}
        self.flows: list[Flow] = []
        self._updated_at = self.env.now
        self._rates_pending = False
        self._wakeup_token = 0
        self._paths: dict[tuple, tuple[list[Edge], float]] = {}

    def transfer(self, src: str | int, dst: str | int, nbytes: float) -> simpy.Event:
        """An event that fires when `nbytes` have gone from GPU src to GPU dst.

        The route's latency is waited first, then the bytes flow; a transfer to
        oneself or of zero bytes costs only the latency.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
            raise ConfigError(f"a transfer needs a non-negative byte count, got {nbytes!r}")
        key = (src, dst)
        if key not in self._paths:
            route = self.cluster.route(src, dst)
            self._paths[key] = (route, sum(self.cluster.latency(edge) for edge in route))
        route, latency = self._paths[key]
        done = self.env.event()
        if nbytes > 0 and route:
            flow = Flow(edges=route, remaining=float(nbytes), done=done)
            start: Callable = lambda _event=None: self._start(flow)
        else:
            start = lambda _event=None: done.succeed()
        if latency > 0:
            self.env.timeout(latency).callbacks.append(start)
        else:
            start()
        return done

    def capacity(self, edge: Edge) -> float:
        """The edge's bandwidth times the fraction collectives reach on its kind of link."""
        if edge not in self._capacity:
            self._capacity[edge] = self.cluster.bandwidth(edge) * self.fractions.of(self.cluster.link_kind(edge))
        return self._capacity[edge]

    def _start(self, flow: Flow) -> None:
        self._advance()
        self.flows.append(flow)
        self._request_rates()

    # ------------------------------------------------------------ the fluid model

    def _advance(self) -> None:
        """Take the bytes sent since the last update off every flow."""
        elapsed = self.env.now - self._updated_at
        if elapsed > 0:
            for flow in self.flows:
                flow.remaining = max(0.0, flow.remaining - flow.rate * elapsed)
        self._updated_at = self.env.now

    def _request_rates(self) -> None:
        """Recompute rates once, after every flow starting or ending at this instant is in."""
        if not self._rates_pending:
            self._rates_pending = True
            self._wakeup_token += 1  # the pending wake-up is stale from now on
            self.env.timeout(0).callbacks.append(self._update_rates)

    def _update_rates(self, _event: simpy.Event) -> None:
        self._rates_pending = False
        self._advance()
        set_max_min_rates(self.flows, self.capacity)
        now = self.env.now
        for flow in self.flows:
            flow.finish_at = now + flow.remaining / flow.rate
        if self.flows:
            first = min(flow.finish_at for flow in self.flows)
            # flows due within a tiny fraction of this interval end together (float noise)
            cutoff = first + FINISH_TOLERANCE * (first - now) + 4 * math.ulp(first)
            token = self._wakeup_token
            wakeup = self.env.timeout(first - now)
            wakeup.callbacks.append(lambda _event: self._finish_due(token, cutoff))

    def _finish_due(self, token: int, cutoff: float) -> None:
        """End the flows due now (the rates have not changed since the wake-up was set)."""
        if token != self._wakeup_token:
            return
        self._advance()
        due = [flow for flow in self.flows if flow.finish_at <= cutoff]
        self.flows = [flow for flow in self.flows if flow.finish_at > cutoff]
        for flow in due:
            flow.remaining = 0.0
            flow.done.succeed()
        self._request_rates()


def set_max_min_rates(flows: list[Flow], bandwidth: Callable[[Edge], float]) -> None:
    """Progressive filling: give every flow its max-min fair rate over its edges."""
    users: dict[Edge, list[Flow]] = {}
    for flow in flows:
        for edge in flow.edges:
            users.setdefault(edge, []).append(flow)
    capacity = {edge: bandwidth(edge) for edge in users}
    unfixed_count = {edge: len(on_edge) for edge, on_edge in users.items()}
    unfixed = set(flows)
    while unfixed:
        share = min(capacity[edge] / count for edge, count in unfixed_count.items() if count)
        limit = share * (1 + 1e-12)
        bottlenecks = [edge for edge, count in unfixed_count.items() if count and capacity[edge] / count <= limit]
        for edge in bottlenecks:
            for flow in users[edge]:
                if flow in unfixed:
                    unfixed.remove(flow)
                    flow.rate = share
                    for other in flow.edges:
                        capacity[other] -= share
                        unfixed_count[other] -= 1


# ---------------------------------------------------------------- collectives


def _members(net: Network, group: list[str | int], least: int = 1) -> list[str]:
    if isinstance(group, (str, int)) or not hasattr(group, "__iter__"):
        raise ConfigError(f"a group must be a list of GPU ids or ranks, got {group!r}")
    members = [net.cluster.gpu_id(gpu) for gpu in group]
    if len(members) < least:
        raise ConfigError(f"this collective needs at least {least} GPU(s) in its group, got {len(members)}")
    if len(set(members)) != len(members):
        raise ConfigError(f"a group lists a GPU twice: {members}: give every GPU once")
    return members


def _check_bytes(nbytes: float) -> float:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
        raise ConfigError(f"a collective needs a non-negative byte count, got {nbytes!r}")
    return float(nbytes)


def _ring_steps(net: Network, ring: list[str], chunk: float, steps: int):
    """`steps` synchronous steps; in each every rank sends `chunk` bytes to the next."""
    n = len(ring)
    for _ in range(steps if n > 1 else 0):
        yield net.env.all_of([net.transfer(ring[i], ring[(i + 1) % n], chunk) for i in range(n)])


def ring_all_reduce(net: Network, group: list, nbytes: float) -> simpy.Process:
    ring, size = _members(net, group), _check_bytes(nbytes)
    return net.env.process(_ring_steps(net, ring, size / len(ring), 2 * (len(ring) - 1)))


def ring_all_gather(net: Network, group: list, nbytes: float) -> simpy.Process:
    """nbytes is the gathered size; every rank starts with nbytes / n."""
    ring, size = _members(net, group), _check_bytes(nbytes)
    return net.env.process(_ring_steps(net, ring, size / len(ring), len(ring) - 1))


def ring_reduce_scatter(net: Network, group: list, nbytes: float) -> simpy.Process:
    """nbytes is the full input size; every rank ends with nbytes / n reduced."""
    ring, size = _members(net, group), _check_bytes(nbytes)
    return net.env.process(_ring_steps(net, ring, size / len(ring), len(ring) - 1))


def p2p(net: Network, group: list, nbytes: float) -> simpy.Process:
    """Send nbytes from group[0] to group[1]."""
    pair = _members(net, group, least=2)
    if len(pair) != 2:
        raise ConfigError(f"p2p takes a group of two GPUs (sender, receiver), got {len(pair)}")
    size = _check_bytes(nbytes)

    def run():
        yield net.transfer(pair[0], pair[1], size)

    return net.env.process(run())


def broadcast(net: Network, group: list, nbytes: float, root: int = 0) -> simpy.Process:
    """Binomial tree from group[root]: in round r the first 2^r holders each send to one more rank."""
    members, size = _members(net, group), _check_bytes(nbytes)
    if not 0 <= root < len(members):
        raise ConfigError(f"broadcast root {root} is not a position in a group of {len(members)}")
    order = members[root:] + members[:root]

    def run():
        holders = 1
        while holders < len(order):
            sends = [net.transfer(order[i], order[i + holders], size) for i in range(holders) if i + holders < len(order)]
            yield net.env.all_of(sends)
            holders *= 2

    return net.env.process(run())


def tree_all_reduce(net: Network, group: list, nbytes: float, chunks: int = 1) -> simpy.Process:
    """Binary tree in group order: reduce to group[0], then broadcast down; pipelined over chunks."""
    members, size = _members(net, group), _check_bytes(nbytes)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ConfigError(f"chunks must be a positive integer, got {chunks!r}")
    n, env, chunk = len(members), net.env, size / chunks
    children = [[c for c in (2 * i + 1, 2 * i + 2) if c < n] for i in range(n)]
    sent_up = [[env.event() for _ in range(chunks)] for _ in range(n)]  # partial sum reached the parent
    has_result = [[env.event() for _ in range(chunks)] for _ in range(n)]  # final values arrived

    def reduce_up(i: int):
        for c in range(chunks):
            yield env.all_of([sent_up[child][c] for child in children[i]])
            if i == 0:
                has_result[0][c].succeed()
            else:
                yield net.transfer(members[i], members[(i - 1) // 2], chunk)
            sent_up[i][c].succeed()

    def broadcast_down(i: int):
        for c in range(chunks):
            yield has_result[i][c]
            yield env.all_of([net.transfer(members[i], members[child], chunk) for child in children[i]])
            for child in children[i]:
                has_result[child][c].succeed()

    def run():
        steps = [env.process(reduce_up(i)) for i in range(n)] + [env.process(broadcast_down(i)) for i in range(n)]
        yield env.all_of(steps)

    return env.process(run())


def hierarchical_all_reduce(net: Network, group: list, nbytes: float) -> simpy.Process:
    """Reduce-scatter in each server, all-reduce across servers, all-gather in each server."""
    members, size = _members(net, group), _check_bytes(nbytes)
    per_node: dict[int, list[str]] = {}
    for gpu in members:
        per_node.setdefault(net.cluster.node_of(gpu), []).append(gpu)
    local_groups = list(per_node.values())
    width = len(local_groups[0])
    if any(len(local) != width for local in local_groups):
        counts = {node: len(local) for node, local in per_node.items()}
        raise ConfigError(f"hierarchical all-reduce needs the same number of ranks on every server, got {counts}: use a ring")
    cross_groups = [[local[j] for local in local_groups] for j in range(width)]
    env = net.env

    def run():
        yield env.all_of([ring_reduce_scatter(net, local, size) for local in local_groups])
        yield env.all_of([ring_all_reduce(net, cross, size / width) for cross in cross_groups])
        yield env.all_of([ring_all_gather(net, local, size) for local in local_groups])

    return env.process(run())


COLLECTIVES: dict[str, Callable[..., simpy.Process]] = {
    "all-reduce": ring_all_reduce,
    "tree-all-reduce": tree_all_reduce,
    "hierarchical-all-reduce": hierarchical_all_reduce,
    "all-gather": ring_all_gather,
    "reduce-scatter": ring_reduce_scatter,
    "broadcast": broadcast,
    "p2p": p2p,
}


def simulate_collective(cluster: Cluster, kind: str, group: list, nbytes: float,
                        fractions: LinkFractions | None = None, **options) -> float:
    """Seconds one collective takes alone on an idle cluster (at the datasheet unless `fractions` say otherwise)."""
    if kind not in COLLECTIVES:
        raise ConfigError(f"unknown collective {kind!r}: choose one of {', '.join(COLLECTIVES)}")
    net = Network(cluster, fractions=fractions)
    process = COLLECTIVES[kind](net, group, nbytes, **options)
    net.env.run(until=process)
    return net.env.now
