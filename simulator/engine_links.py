"""What each distinct transfer of a training step costs on a cluster, timed once. Torch-free.

The engine replays tens of thousands of sends and collectives per step; moving every
byte of every one through the fluid model would take minutes at 3,000 GPUs. So each
*distinct* transfer is timed once, with simulator/collectives.py's fluid model (max-min
link sharing, alpha-beta per message) on the very links of the cluster, and the replay
uses those durations as SimPy timeouts.

Placement: global rank (pp_rank * dp + dp_rank) * tp + tp_rank sits on the cluster's
rank-th GPU (parallel/mesh.py's order: tp innermost, then dp, then pp).

Symmetry (what is timed together):
  tp collective   one tensor-parallel group alone (stage 0, replica 0): every tp group
                  lives inside one server on its own GPU<->NVSwitch links.
  p2p             stage a -> stage b in replica 0, all tp ranks sending at once (each tp
                  rank sends its full copy, as parallel/pipeline.py does); the other
                  replicas are left out (their flows only meet these on the spines).
  dp collective   a ring over the replicas of one stage, the tp rings of that stage at
                  once (they may share NICs and uplinks).
  embedding sync  the first and last stage's GPUs of replica 0 (tied head), all tp ranks.

Distinct: two transfers cost the same when their GPUs have the same position inside
their servers (`local`), the same links out of the GPU, and the same pattern of shared
servers. Which servers they are is not part of the key: the fabric between servers is
assumed alike for every server pair (true of the built fat-tree and rail clusters, which
are non-blocking; a crossing between leaves adds two switch latencies, ~0.3 us, that the
key ignores). This keeps the number of routes computed small on large clusters.

Ring collectives are timed one step, and one distinct hop, at a time: see `LinkCosts.ring`.
"""

from __future__ import annotations

import weakref

from minigpt.errors import ConfigError
from simulator.collectives import Network
from simulator.layout import Layout
from simulator.topology import Cluster

_CACHES: "weakref.WeakKeyDictionary[Cluster, dict]" = weakref.WeakKeyDictionary()


def check_placement(cluster: Cluster, layout: Layout) -> None:
    """The layout must use every GPU of the cluster, and each tp group must sit inside one server."""
    gpus = len(cluster.gpus)
    if layout.world_size != gpus:
        raise ConfigError(
            f"tp {layout.tp} x pp {layout.pp} x dp {layout.dp} = {layout.world_size} GPUs, but the cluster has {gpus}: "
            "change the layout or the cluster (--nodes, --gpus-per-node) so that they match"
        )
    for first in range(0, gpus, layout.tp):
        servers = {cluster.node_of(rank) for rank in range(first, first + layout.tp)}
        if len(servers) > 1:
            per_node = sum(1 for gpu in cluster.gpus if cluster.node_of(gpu) == cluster.node_of(first))
            raise ConfigError(
                f"tp={layout.tp} spans servers (ranks {first}..{first + layout.tp - 1} are on servers {sorted(servers)}; "
                f"a server holds {per_node} GPUs): tensor parallelism must stay inside one server, use tp <= {per_node}"
            )


class LinkCosts:
    """Seconds per distinct transfer of one layout on one cluster (cached per cluster across calls)."""

    def __init__(self, cluster: Cluster, layout: Layout) -> None:
        check_placement(cluster, layout)
        self.cluster, self.layout = cluster, layout
        self.cache: dict = _CACHES.setdefault(cluster, {})
        self.signatures: dict[str, tuple] = self.cache.setdefault("signatures", {})
        self.memo: dict[tuple, tuple] = {}

    def gpu(self, stage: int, replica: int, tp_rank: int) -> str:
        layout = self.layout
        return self.cluster.gpus[(stage * layout.dp + replica) * layout.tp + tp_rank]

    # ------------------------------------------------------------ keys

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

    def groups(self, name: str, *where: int) -> tuple[list[list[str]], tuple]:
        """The GPU groups of one kind of transfer and their pattern (memoised per layout)."""
        key = (name, *where)
        if key not in self.memo:
            layout = self.layout
            if name == "p2p":
                groups = [[self.gpu(where[0], 0, t), self.gpu(where[1], 0, t)] for t in range(layout.tp)]
            elif name == "tp":
                groups = [[self.gpu(0, 0, t) for t in range(layout.tp)]]
            elif name == "pp":  # the stages of replica 0, the tp rings at once
                groups = [[self.gpu(p, 0, t) for p in range(layout.pp)] for t in range(layout.tp)]
            else:  # "dp": the rings over the replicas of stage where[0]
                groups = [[self.gpu(where[0], d, t) for d in range(layout.dp)] for t in range(layout.tp)]
            pattern = self.pattern(groups)
            self.memo[key] = (self.cache.setdefault(("representative", pattern), groups), pattern)
        return self.memo[key]

    def run(self, key: tuple, flows: list[tuple[str, str]], nbytes: float) -> float:
        """Seconds until every flow (src, dst) of nbytes, started together on an idle cluster, has arrived (cached)."""
        if key not in self.cache:
            net = Network(self.cluster)
            done = [net.transfer(src, dst, nbytes) for src, dst in flows]
            net.env.run(until=net.env.all_of(done))
            self.cache[key] = net.env.now
        return self.cache[key]

    def ring(self, kind: str, groups: tuple[list[list[str]], tuple], nbytes: float) -> float:
        """A ring collective of the full buffer `nbytes` on every group at once.

        collectives.ring_* run 2(n-1) (all-reduce) or n-1 synchronous steps in which every member
        sends nbytes/n to the next; on an idle cluster the steps are alike, so one step is timed
        and multiplied. A step is as slow as its slowest hop; hops alike (same pattern) cost the
        same, so each distinct hop is timed once with the fluid model, the hop of every
        concurrent ring at once (they leave the same servers). Distinct hops are taken not to
        share links (in a ring each GPU sends on its own links to the next server; the fabric
        between servers is taken as non-blocking, as in the built clusters)."""
        representative, pattern = groups
        n = len(representative[0])
        if n == 1 or nbytes <= 0:
            return 0.0
        steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}[kind]
        hops_key = ("hops", pattern)
        if hops_key not in self.cache:
            hops: dict[tuple, list[tuple[str, str]]] = {}
            for i in range(n):
                pairs = [[group[i], group[(i + 1) % n]] for group in representative]
                hops.setdefault(self.pattern(pairs), [(a, b) for a, b in pairs])
            self.cache[hops_key] = hops
        chunk = float(nbytes) / n
        return steps * max(self.run(("hop", hop, chunk), flows, chunk) for hop, flows in self.cache[hops_key].items())

    # ------------------------------------------------------------ transfers

    def p2p(self, src_stage: int, dst_stage: int, nbytes: float) -> float:
        """One activation (or its gradient) from stage src to stage dst, every tp rank at once."""
        if nbytes <= 0 or src_stage == dst_stage:
            return 0.0
        representative, pattern = self.groups("p2p", src_stage, dst_stage)
        return self.run(("p2p", pattern, float(nbytes)), [(a, b) for a, b in representative], nbytes)

    def tp_collective(self, kind: str, nbytes: float) -> float:
        """One tensor-parallel collective of the full buffer `nbytes` (ring), on one tp group alone."""
        return self.ring(kind, self.groups("tp"), nbytes) if self.layout.tp > 1 else 0.0

    def dp_collective(self, stage: int, kind: str, nbytes: float) -> float:
        """One data-parallel ring collective of `nbytes` per rank on `stage`, the stage's tp rings at once."""
        return self.ring(kind, self.groups("dp", stage), nbytes) if self.layout.dp > 1 else 0.0

    def pp_collective(self, kind: str, nbytes: float) -> float:
        """One ring collective of `nbytes` over the pipeline stages (replica 0, every tp rank's ring at once)."""
        return self.ring(kind, self.groups("pp"), nbytes) if self.layout.pp > 1 else 0.0

    def embedding_sync(self, nbytes: float) -> float:
        """The tied embedding's gradient all-reduced between the first and last stage (replica 0, all tp ranks)."""
        last = self.layout.pp - 1
        return self.ring("all_reduce", self.groups("p2p", 0, last), nbytes) if last > 0 else 0.0
