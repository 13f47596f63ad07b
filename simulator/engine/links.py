"""What each distinct transfer of a training step costs on a cluster, timed once. Torch-free.

The engine replays tens of thousands of sends and collectives per step; moving every
byte of every one through the fluid model would take minutes at 3,000 GPUs. So each
*distinct* transfer is timed once and the replay uses those durations as SimPy timeouts.

Placement: global rank ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank sits on the cluster's
rank-th GPU (parallel/mesh.py's order: tp innermost, then cp, dp, pp).

What runs at once (a "transfer"):
  tp collective   one tensor-parallel group (stage 0, replica 0): every tp group lives inside
                  one server on its own GPU<->NVSwitch links.
  p2p             stage a -> stage b, every tp rank (each sends its full copy, as
                  parallel/pipeline/executor.py does) of every replica at once: replicas run in step, and
                  their flows meet on shared uplinks (two opposite shifts, an oversubscribed leaf).
  dp collective   a ring over the dp x cp ranks of one stage (replica-major: a replica's cp ranks
                  one after another), the tp rings of that stage at once: while tp x cp fits in a
                  server, a replica's cp ranks share its NVLink and the ring crosses the network
                  between replicas; beyond, every hop crosses it.
  cp pass         one step of a context-parallel ring: every cp rank of one stage sends to the next
                  (cp_rank + 1 mod cp), every tp rank of every replica at once; on the server's
                  NVLink while tp x cp fits in a server, across the network beyond (the step lasts
                  as long as its slowest hop). cp collective: a ring collective over the cp group.
  all-to-all      expert parallelism's: every rank of each expert group (ep consecutive ranks of those
                  routing distinct tokens: job/exchange/experts.py's expert_places) sends its part to each
                  other member, every group of the stage at once; the experts' gradient collectives run
                  over the ranks holding the same experts.
  pp collective   rings over the stages (the optimizer's norm), every replica's at once.
  amax all-reduce fp8 delayed scaling's, over a stage's tp x cp ranks (every replica's group at once) or its
                  tp x cp x dp ranks (one group).
  embedding sync  the first and last stage's GPUs (tied head), every replica's at once.
A ring collective (collectives.ring_*) is 2(n-1) (all-reduce) or n-1 synchronous steps in
which every member sends S/n to the next; on an idle cluster the steps are alike, so one
step is timed and multiplied. Link bandwidths are scaled by what NCCL reaches on them
(collectives.LinkFractions: the GPU's nvlink_fraction, the NIC's busbw_fraction).
Every collective call goes through `LinkCosts.collective`: simulator/network/nccl.py takes this ring's
time and latency, the group's shape (ranks, servers) and the published figures of the GPU's node and NIC,
and picks the algorithm and protocol NCCL would (ring, tree, NVLS, NVLS+tree, in-network reduction), or
the one `select` forces (--nccl-algo); each distinct call is decided once and listed by `collective_calls`.
Without a GPU (the datasheet) and on a measured CPU host every collective stays the ring.

Three ways to time a transfer, one answer where they overlap:
  fast   (a built cluster, simulator/network/cluster_built.py): every flow of the transfer routed by
         arithmetic (simulator/network/fabric.py, numbered edges); each flow runs at its bottleneck
         share, min over its edges of the edge's bandwidth over the flows on it (the first round
         of max-min filling; a flow's fluid rate is never below it, and the flows at the smallest
         share keep it to the end), plus its latency; the transfer lasts as long as its slowest
         flow. Equal to the fluid model when the slowest flows run at their share (no shared
         link, or flows alike on it: the rings and shifts of a step on the built fabrics).
         Memoised per transfer as its few distinct (latency, share) pairs, so a new byte count
         costs nothing. No graph: 100,000 GPUs cost a few hundred thousand routed flows.
  exact  (`exact=True`, any cluster, for checking): the fluid model of simulator/network/collectives.py on
         every flow of the transfer at once. tests/test_sim_fast_path.py holds fast = exact.
  graph  (a cluster read from a file): the fluid model on the graph's routes, each distinct hop
         once and replica 0 for p2p, pp and the embedding (every replica when the file says the
         fabric is oversubscribed): two hops cost the same when their GPUs have the same position
         in their servers (`local`), the same links out, and the same pattern of shared servers;
         the fabric between servers is taken as alike for every server pair and distinct hops as
         not sharing links (a crossing between leaves adds ~0.3 us that the key ignores).
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from contextlib import contextmanager
from itertools import chain
from typing import Callable, Iterator

from job.exchange.experts import expert_places
from minigpt.errors import ConfigError
from simulator.network.cluster_built import BuiltCluster
from simulator.network.collectives import LinkFractions, Network
from simulator.network.nccl import Call, NcclModel, check_algorithm
from simulator.costs.hardware import GPUSpec
from job.layout import Layout
from simulator.network.topology import Cluster

_CACHES: "weakref.WeakKeyDictionary[Cluster, dict]" = weakref.WeakKeyDictionary()
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1}

Profile = tuple[tuple[float, float], ...]  # distinct (latency s, rate bytes/s) of a transfer's flows
Flows = list[tuple[int, int]] | Callable[[], list[tuple[int, int]]]  # (src, dst) pairs, or a function listing them


def check_placement(cluster: Cluster, layout: Layout) -> None:
    """The layout must use every GPU of the cluster, and each tp group must sit inside one server."""
    gpus = cluster.n_gpus
    if layout.world_size != gpus:
        raise ConfigError(
            f"tp {layout.tp}{f' x cp {layout.cp}' if layout.cp > 1 else ''} x pp {layout.pp} x dp {layout.dp} = "
            f"{layout.world_size} GPUs, but the cluster has {gpus}: "
            "change the layout or the cluster (--nodes, --gpus-per-node) so that they match"
        )
    if isinstance(cluster, BuiltCluster):  # servers of G consecutive ranks: a group's ends tell
        per_node = cluster.fabric.gpus_per_node
        first = next((f for f in range(0, gpus, layout.tp) if f // per_node != (f + layout.tp - 1) // per_node), None)
        if first is not None:
            _spans_servers(layout, first, sorted({r // per_node for r in range(first, first + layout.tp)}), per_node)
        return
    for first in range(0, gpus, layout.tp):
        servers = {cluster.node_of(rank) for rank in range(first, first + layout.tp)}
        if len(servers) > 1:
            per_node = sum(1 for rank in range(gpus) if cluster.node_of(rank) == cluster.node_of(first))
            _spans_servers(layout, first, sorted(servers), per_node)


def _spans_servers(layout: Layout, first: int, servers: list[int], per_node: int) -> None:
    raise ConfigError(
        f"tp={layout.tp} spans servers (ranks {first}..{first + layout.tp - 1} are on servers {servers}; "
        f"a server holds {per_node} GPUs): tensor parallelism must stay inside one server, use a tp that divides "
        f"{per_node}"
    )


@contextmanager
def no_garbage_collection() -> Iterator[None]:
    """Pause the cyclic garbage collector: a big replay or fast costing allocates ~10^5 lists and tuples
    that it would scan again and again (a third of the time at 3,000 GPUs); nothing here makes cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def sharding_groups(name: str, data: list[list[int]], n: int) -> list[list[int]]:
    """Each list of a stage's data ranks (one per tp rank) cut into shard groups of n consecutive ranks
    ("dp_shard") or replica groups, the ranks n apart ("dp_replicas"), as parallel/mesh.py builds them."""
    if name == "dp_shard":
        return [ranks[g : g + n] for ranks in data for g in range(0, len(ranks), n)]
    return [ranks[j::n] for ranks in data for j in range(n)]


def flow_profile(cluster: BuiltCluster, flows: list[tuple[int, int]], fractions: LinkFractions) -> Profile:
    """The (latency, bottleneck share) of every flow started together, the dominated pairs left out."""
    nvlink, nic, cable, top = cluster.capacities
    net = fractions.network
    capacity = (nvlink * fractions.nvlink, nic * net, cable * net, top * net)
    with no_garbage_collection():
        routes = cluster.fabric.routes(flows)
        flows_on = Counter(chain.from_iterable(edges for _, edges in routes)).__getitem__
        alone: dict[tuple, float] = {}  # a route that shares no edge: its rate depends on its link classes only
        shares = set()
        for units, edges in routes:
            if not edges:
                continue
            if max(map(flows_on, edges)) == 1:
                if units not in alone:
                    alone[units] = min(capacity[e & 3] for e in edges)
                shares.add((units, alone[units]))
            else:
                shares.add((units, min(capacity[e & 3] / flows_on(e) for e in edges)))
    pairs = {(cluster.latency_of(units), rate) for units, rate in shares}
    # keep a pair unless another is at least as slow to start and at most as fast
    return tuple(sorted(p for p in pairs if not any(q != p and q[0] >= p[0] and q[1] <= p[1] for q in pairs)))


def _listed(flows: Flows) -> list[tuple[int, int]]:
    return flows() if callable(flows) else flows


def profile_seconds(profile: Profile, nbytes: float) -> float:
    return max((latency + nbytes / rate for latency, rate in profile), default=0.0)


class LinkCosts:
    """Seconds per distinct transfer of one layout on one cluster (cached per cluster across calls).

    gpu: the GPUSpec whose `reached.nvlink_fraction` discounts NVLink, with the cluster's `busbw_fraction`
    discounting the network (None: the datasheet, nothing discounted). exact: see the module docstring."""

    def __init__(self, cluster: Cluster, layout: Layout, gpu: GPUSpec | None = None, exact: bool = False) -> None:
        check_placement(cluster, layout)
        self.cluster, self.layout, self.exact = cluster, layout, exact
        self.fractions = LinkFractions() if gpu is None else LinkFractions(gpu.reached.nvlink_fraction, cluster.busbw_fraction)
        self.mode = "exact" if exact else "fast" if isinstance(cluster, BuiltCluster) else "graph"
        per_cluster = _CACHES.setdefault(cluster, {})
        self.cache: dict = per_cluster.setdefault((self.fractions, self.mode), {})
        self.signatures: dict[str, tuple] = per_cluster.setdefault("signatures", {})
        self.memo: dict[tuple, tuple] = {}
        ratio = cluster.attributes.get("oversubscription", 1.0)
        oversubscribed = isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio > 1
        # replicas timed together in p2p, pp and the embedding sync: all but on the graph path of a non-blocking fabric
        self.replicas = layout.dp if self.mode != "graph" or oversubscribed else 1
        self.gpu = gpu
        self.nccl: NcclModel | None = None  # how NCCL runs each collective (None without a GPU: the ring alone)
        self.calls: dict[tuple, dict] = {}  # each distinct collective call: its algorithm, protocol and seconds
        self.shapes: dict[tuple, tuple] = {}  # per group timing key: (servers, most ranks on one, ring hop latency)
        self.select("auto")

    def select(self, algorithm: str) -> None:
        """Let NCCL choose each collective's algorithm ("auto") or force one, as NCCL_ALGO does. The published
        figures belong to the presets' hardware: a built cluster has them, a cluster file when it names its
        fabric (a NIC preset, as a saved built cluster does; its bool `in_network_reduction` overrides the
        NIC's); a file naming no fabric keeps its own links' ring for every collective."""
        algorithm = check_algorithm(algorithm)
        attributes = self.cluster.attributes
        nic = self.cluster.nic.name if isinstance(self.cluster, BuiltCluster) else attributes.get("fabric")
        if self.gpu is not None and isinstance(nic, str):
            sharp = attributes.get("in_network_reduction")
            self.nccl = NcclModel.for_hardware(self.gpu.node, nic, algorithm, sharp if isinstance(sharp, bool) else None)
            self.calls = {}

    def rank(self, stage: int, replica: int, tp_rank: int, cp_rank: int = 0) -> int:
        layout = self.layout
        return ((stage * layout.dp + replica) * layout.cp + cp_rank) * layout.tp + tp_rank

    def gpu(self, stage: int, replica: int, tp_rank: int, cp_rank: int = 0) -> str:
        return self.cluster.gpu_id(self.rank(stage, replica, tp_rank, cp_rank))

    # ------------------------------------------------------------ who takes part

    def rank_groups(self, name: str, *where: int) -> list[list[int]]:
        """The rank groups of one kind of transfer (pairs sender, receiver for p2p)."""
        layout, rank, replicas = self.layout, self.rank, range(self.replicas)
        tps, cps = range(layout.tp), range(layout.cp)
        if name == "p2p":
            return [[rank(where[0], d, t, c), rank(where[1], d, t, c)] for d in replicas for c in cps for t in tps]
        if name == "tp":
            return [[rank(0, 0, t) for t in tps]]
        if name == "pp":
            return [[rank(p, d, t, c) for p in range(layout.pp)] for d in replicas for c in cps for t in tps]
        if name == "cp":
            return [[rank(where[0], d, t, c) for c in cps] for d in replicas for t in tps]
        if name == "amax_tp":  # current scaling's, over each tp group (a sequence-parallel input's shards)
            return [[rank(where[0], d, t, c) for t in tps] for d in replicas for c in cps]
        if name == "amax_tp_cp":  # fp8 amax reductions over tp x cp: each replica's group at once
            return [[rank(where[0], d, t, c) for c in cps for t in tps] for d in replicas]
        if name == "amax_data":  # over the stage's tp x cp x dp ranks: one group
            return [[rank(where[0], d, t, c) for d in range(layout.dp) for c in cps for t in tps]]
        if name in ("ep", "dp_experts"):  # job/exchange/experts.py's expert_places
            groups, replicas = expert_places(layout.dp, layout.cp, layout.tp, layout.sequence_parallel, layout.ep)
            if name == "ep":  # on the graph path the groups that start in the first replica (every group alike)
                return [[rank(where[0], d, t, c) for d, c, t in g] for g in groups if g[0][0] < self.replicas]
            return [[rank(where[0], d, t, c) for d, c, t in g] for g in replicas]
        data = [[rank(where[0], d, t, c) for d in range(layout.dp) for c in cps] for t in tps]  # "dp": dp x cp
        return data if name == "dp" else sharding_groups(name, data, where[1])

    def groups(self, name: str, *where: int) -> tuple[list[list], tuple]:
        """(the groups of one kind of transfer, the key of their timing): GPU ids on the graph path, else ranks."""
        key = (name, *where)
        if key not in self.memo:
            groups = self.rank_groups(name, *where)
            if self.mode == "graph":
                named = [[self.cluster.gpu_id(r) for r in group] for group in groups]
                pattern = self.pattern(named)
                self.memo[key] = (self.cache.setdefault(("representative", pattern), named), pattern)
            else:
                layout = self.layout
                self.memo[key] = (groups, (layout.tp, layout.pp, layout.dp, layout.cp, self.replicas, *key))
        return self.memo[key]

    # ------------------------------------------------------------ the graph path's keys

    def signature(self, gpu: str) -> tuple:
        """A GPU's place in its server and the links out of it."""
        if gpu not in self.signatures:
            graph = self.cluster.graph
            links = sorted((graph.nodes[v]["type"], d["bandwidth"], d["latency"]) for _, v, d in graph.out_edges(gpu, data=True))
            self.signatures[gpu] = (graph.nodes[gpu]["local"], tuple(links))
        return self.signatures[gpu]

    def pattern(self, groups: list[list[str]]) -> tuple:
        """The groups as GPU signatures and which of them share a server (numbered by first appearance)."""
        servers: dict[int, int] = {}
        return tuple(
            tuple((self.signature(gpu), servers.setdefault(self.cluster.node_of(gpu), len(servers))) for gpu in group)
            for group in groups
        )

    # ------------------------------------------------------------ timing

    def run(self, key: tuple, flows: Flows, nbytes: float) -> float:
        """Seconds until every flow (src, dst) of nbytes, started together on an idle cluster, has arrived (cached)."""
        if key not in self.cache:
            net = Network(self.cluster, fractions=self.fractions)
            done = [net.transfer(src, dst, nbytes) for src, dst in _listed(flows)]
            net.env.run(until=net.env.all_of(done))
            self.cache[key] = net.env.now
        return self.cache[key]

    def profile(self, key: tuple, flows: Flows) -> Profile:
        if key not in self.cache:
            self.cache[key] = flow_profile(self.cluster, _listed(flows), self.fractions)
        return self.cache[key]

    def flows(self, key: tuple, flows: Flows, nbytes: float) -> float:
        """Flows started together: their profile (fast) or the fluid model (graph, exact); `flows` a list of
        (src, dst), or a function that lists them, called only when `key` is not cached yet."""
        if self.mode == "fast":
            return profile_seconds(self.profile(("flows", key), flows), nbytes)
        return self.run(("flows", key, float(nbytes)), flows, nbytes)

    def collective(self, name: str, kind: str, groups: tuple[list[list], tuple], nbytes: float) -> float:
        """A collective of the full buffer `nbytes` on every group at once, run as NCCL would
        (simulator/network/nccl.py: the algorithm and protocol it picks, on this topology's ring); each
        distinct call decided once and kept in `calls` (`name`: the group, tp, dp, cp, pp or embedding)."""
        n = len(groups[0][0])
        if n == 1 or nbytes <= 0 or self.nccl is None:
            return self.ring(kind, groups, nbytes)
        key = (name, kind, groups[1], float(nbytes))
        if key not in self.calls:
            if groups[1] not in self.shapes:  # servers, most ranks on one, the slowest hop of a ring step
                servers = Counter(self.cluster.node_of(member) for member in groups[0][0])
                self.shapes[groups[1]] = (len(servers), max(servers.values()), self.ring_step(groups, 0.0))
            spread, most, hop = self.shapes[groups[1]]
            ring = self.ring(kind, groups, nbytes)
            call = Call(kind, n, spread, most, float(nbytes), ring, RING_STEPS[kind](n) * hop, self.gpu.nvlink_latency)
            choice = self.nccl.choose(call)
            self.calls[key] = {"group": name, "kind": kind, "ranks": n, "servers": call.servers, "bytes": float(nbytes),
                               "algorithm": choice.algorithm, "protocol": choice.protocol, "seconds": choice.seconds,
                               "ring_seconds": ring, **({"note": choice.note} if choice.note else {})}
        return self.calls[key]["seconds"]

    def collective_calls(self) -> list[dict]:
        """Every distinct collective call decided so far, by group, kind and size (one row per size of a group
        whatever its stage), JSON-ready."""
        order = {name: i for i, name in enumerate(("tp", "cp", "ep", "dp", "dp_shard", "dp_replicas", "dp_experts",
                                                   "amax_tp", "amax_tp_cp", "amax_data", "pp", "embedding"))}
        rows: dict[tuple, dict] = {}
        for call in self.calls.values():
            rows.setdefault((call["group"], call["kind"], call["bytes"]), call)
        return sorted(rows.values(), key=lambda c: (order.get(c["group"], len(order)), c["group"], c["kind"], c["bytes"]))

    def ring(self, kind: str, groups: tuple[list[list], tuple], nbytes: float) -> float:
        """A ring collective of the full buffer `nbytes` on every group at once: steps x one step.

        The graph path times each distinct hop once, the hop of every concurrent ring at once, and
        takes distinct hops not to share links (each GPU sends on its own links to the next server;
        the fabric between servers taken as non-blocking); fast and exact time all hops together."""
        n = len(groups[0][0])
        if n == 1 or nbytes <= 0:
            return 0.0
        return RING_STEPS[kind](n) * self.ring_step(groups, float(nbytes) / n)

    def ring_step(self, groups: tuple[list[list], tuple], chunk: float) -> float:
        """One step of a ring on every group at once: each member sends `chunk` bytes to the next."""
        representative, key = groups
        n = len(representative[0])
        if self.mode != "graph":
            def hops() -> list[tuple[int, int]]:  # listed only when this ring's profile is not cached yet
                return [(group[i], group[(i + 1) % n]) for group in representative for i in range(n)]

            return self.flows(("ring", key), hops, chunk)
        hops_key = ("hops", key)
        if hops_key not in self.cache:
            hops: dict[tuple, list[tuple[str, str]]] = {}
            for i in range(n):
                pairs = [[group[i], group[(i + 1) % n]] for group in representative]
                hops.setdefault(self.pattern(pairs), [(a, b) for a, b in pairs])
            self.cache[hops_key] = hops
        return max(self.run(("hop", hop, chunk), flows, chunk) for hop, flows in self.cache[hops_key].items())

    # ------------------------------------------------------------ transfers

    def p2p(self, src_stage: int, dst_stage: int, nbytes: float) -> float:
        """One activation (or its gradient) from stage src to stage dst, every tp rank at once."""
        if nbytes <= 0 or src_stage == dst_stage:
            return 0.0
        pairs, key = self.groups("p2p", src_stage, dst_stage)
        return self.flows(("p2p", key), [(a, b) for a, b in pairs], nbytes)

    def tp_collective(self, kind: str, nbytes: float) -> float:
        """One tensor-parallel collective of the full buffer `nbytes`, on one tp group alone."""
        return self.collective("tp", kind, self.groups("tp"), nbytes) if self.layout.tp > 1 else 0.0

    def dp_collective(self, stage: int, kind: str, nbytes: float) -> float:
        """One data-parallel collective of `nbytes` per rank on `stage` over its dp x cp ranks, the stage's
        tp rings at once."""
        return self.collective("dp", kind, self.groups("dp", stage), nbytes) if self.layout.data_ranks > 1 else 0.0

    def sharded_collective(self, stage: int, kind: str, nbytes: float, group: str = "shard") -> float:
        """Hybrid sharding (Layout.shard_group N): one ring collective of `nbytes` over part of `stage`'s dp x cp
        ranks, every such group of the stage and every tp rank's at once: group "shard", each N consecutive
        data ranks (the whole dp x cp without hybrid sharding: dp_collective); "replicas", the ranks at the same
        place in every shard group (N apart)."""
        n = self.layout.shard_ranks
        if n == self.layout.data_ranks:
            return self.dp_collective(stage, kind, nbytes) if group == "shard" else 0.0
        return self.collective(f"dp_{group}", kind, self.groups(f"dp_{group}", stage, n), nbytes)

    def amax_all_reduce(self, stage: int, group: str, nbytes: float) -> float:
        """One all-reduce of `nbytes` of fp8 amaxes over `stage`'s tp ranks (`group` "tp"), its tp x cp ranks ("tp_cp")
        or its tp x cp x dp ranks ("data"): Implementation.fp8_amax_group, and current scaling's per-GEMM reduction."""
        name = f"amax_{group}"
        groups = self.groups(name, stage)
        return self.collective(name, "all_reduce", groups, nbytes) if len(groups[0][0]) > 1 else 0.0

    def expert_collective(self, stage: int, kind: str, nbytes: float) -> float:
        """One collective of the routed experts' gradients or weights over the ranks of `stage` that hold the same
        experts (token_ranks / ep of them: expert_places' replica groups), all at once."""
        groups = self.groups("dp_experts", stage)
        return self.collective("dp_experts", kind, groups, nbytes) if self.layout.token_ranks > self.layout.ep else 0.0

    def ep_collective(self, stage: int, kind: str, nbytes: float) -> float:
        """One collective over the expert groups of `stage` (the gradient norm's experts' share), all at once."""
        return self.collective("ep", kind, self.groups("ep", stage), nbytes) if self.layout.ep > 1 else 0.0

    def all_to_all(self, stage: int, nbytes: float) -> float:
        """One all-to-all of the expert group on `stage`, each rank handing in `nbytes` (its own part included, as
        all_to_all_single takes it): every rank sends nbytes / ep to each other member at once, every group and
        tp rank of the stage together (on the graph path one group per tp rank), each flow at its bottleneck
        share of the links it crosses: NVLink inside a server, the NICs beyond (docs/efficiency.md, "Mixture of
        experts")."""
        ep = self.layout.ep
        if ep == 1 or nbytes <= 0:
            return 0.0
        groups, key = self.groups("ep", stage)

        def pairs() -> list[tuple[int, int]]:  # listed only when this group's profile is not cached yet
            return [(a, b) for group in groups for a in group for b in group if a != b]

        return self.flows(("all_to_all", key), pairs, float(nbytes) / ep)

    def ep_servers(self, stage: int) -> tuple[int, int]:
        """(servers an expert group of `stage` spans, the most of its members on one of them)."""
        return self._by_server(stage)[2:]

    def _by_server(self, stage: int) -> tuple[list, list, int, int]:
        """The expert groups of `stage` split by server, once: (the NIC pairs, each member to the member in its
        place on every other server of its group; the NVLink pairs, each member to every other member of its
        server; servers a group spans; the most members on one)."""
        key = ("ep_by_server", stage)
        if key not in self.memo:
            remote, local, spanned, most = [], [], 1, 1
            for group in self.groups("ep", stage)[0]:
                by_server: dict = {}
                for member in group:
                    by_server.setdefault(self.cluster.node_of(member), []).append(member)
                spanned, most = len(by_server), max(len(members) for members in by_server.values())
                for server, members in by_server.items():
                    for place, a in enumerate(members):
                        local += [(a, b) for b in members if b != a]
                        remote += [(a, others[place % len(others)]) for other, others in by_server.items()
                                   if other != server]
            self.memo[key] = (remote, local, spanned, most)
        return self.memo[key]

    def all_to_all_deduplicated(self, stage: int, nbytes: float, per_rank: float, per_server: float) -> float:
        """One dispatch or combine of a hierarchical dispatcher that sends each token once per destination (DeepEP's
        normal kernels: docs/efficiency.md, "Mixture of experts"), each rank handing in `nbytes`, one row of every
        token it routes: every other server of the group gets the `per_server` share of them once, over the NICs,
        at the member in the same place there; every member forwards over NVLink, to each other member of its
        server, the `per_rank` share of the tokens of every server of the group (its own included). The two run
        together (the NVLink forwarding of chunks as they land), so the slower sets the time."""
        if self.layout.ep == 1 or nbytes <= 0:
            return 0.0
        key = self.groups("ep", stage)[1]
        remote, local, spanned, _ = self._by_server(stage)
        over_nics = self.flows(("deduplicated_remote", key), remote, nbytes * per_server) if remote else 0.0
        over_nvlink = self.flows(("deduplicated_local", key), local, nbytes * per_rank * spanned) if local else 0.0
        return max(over_nics, over_nvlink)

    def cp_pass(self, stage: int, nbytes: float) -> float:
        """One step of the context-parallel ring on `stage`: every cp rank sends `nbytes` to the next, every tp
        rank of every replica at once (parallel/context/ring.py's start_pass)."""
        if self.layout.cp == 1 or nbytes <= 0:
            return 0.0
        return self.ring_step(self.groups("cp", stage), float(nbytes))

    def cp_collective(self, stage: int, kind: str, nbytes: float) -> float:
        """One collective of the full buffer `nbytes` over the cp group on `stage` (every tp rank's at once)."""
        return self.collective("cp", kind, self.groups("cp", stage), nbytes) if self.layout.cp > 1 else 0.0

    def pp_collective(self, kind: str, nbytes: float) -> float:
        """One collective of `nbytes` over the pipeline stages (every tp rank's at once)."""
        return self.collective("pp", kind, self.groups("pp"), nbytes) if self.layout.pp > 1 else 0.0

    def embedding_sync(self, nbytes: float) -> float:
        """The tied embedding's gradient all-reduced between the first and last stage (all tp ranks)."""
        last = self.layout.pp - 1
        return self.collective("embedding", "all_reduce", self.groups("p2p", 0, last), nbytes) if last > 0 else 0.0
