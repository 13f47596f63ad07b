"""A lower bound on a layout's simulated step time that needs no replay, for `minigpt plan`. Torch-free.

simulator/engine/simulate.py's replay runs each pipeline rank's actions one after another on the rank's own
clock: a compute action holds it for its price with nothing armed around it (compute plus exposed
tp, cp and a MoE's all-to-alls, at the job's expert load: simulator/engine/costs.py's `rank_costs`) or
more (simulator/engine/dp_overlap.py's `overlap` never ends before its segments' compute, which adds up
to that price); a send leaves, and so its receive ends, no earlier than the compute that made the data;
the optimizer step runs last. So, for every rank r, the step lasts at least

    compute_r = head_r + work_r + max(optimizer_r, tail_r + optimizer_0)

  work_r   its compute actions' prices, summed (m micro-batches x every chunk it holds, forward
           and backward);
  head_r   its first action is a forward of chunk c: that micro-batch went through chunks
           0 .. c-1 first, one after another (their forward prices);
  tail_r   its last action is a backward of chunk c: chunks c-1 .. 0 still run that micro-batch's
           backward after it, then rank 0 steps its optimizer (0 when c = 0);
  optimizer_r  AdamW over rank r's share at HBM speed (engine/costs.py's optimizer_seconds; under Muon with its
               busiest rank's Newton-Schulz GEMMs, engine/muon.py's iteration_seconds; the
           norm's tiny all-reduces left out, so the bound only gets lower).

and, since a rank's data-parallel collectives run one at a time on its one stream (in the replay
and in simulator/engine/dp_overlap.py, which starts each after the one before) and the rank ends only
when the last has landed,

    data_parallel_r = the rank's data-parallel actions' prices (engine/data_parallel.py's `seconds`), summed;

and, since the first gradient reduction cannot start before the computes listed before the one that issues it
have run (a reduction is issued when its bucket's gradients are in, during that compute or, under Overlap.dp
"after", once it ends), the optimizer step starts after the last reduction and the last compute, with the routed
experts' own reduction (issued with it) first, and the update gathers follow the optimizer where nothing hides
them (Overlap.param_gather "step"),

    reduction_r = max(compute before the first reduction + the reductions, work_r)
                  + the experts' reduction + optimizer_r (+ the update gathers).

and, since a compute that issues ZeRO-3 gathers (those listed right before it) issues them as it starts and
cannot end before they have landed one after another on the stream,

    gathered_r = compute_r with each compute priced at least its gathers' seconds, the head's chunks too
                 (each stage's first forward gathers its units before the next stage can start).

Every transfer between stages and the tied embedding's sync is left at zero, so max over ranks of
max(compute_r, data_parallel_r, reduction_r, gathered_r) is a lower bound on what simulate_step returns for the
same job (tests/test_plan.py checks it on every schedule, ZeRO stage and recompute mode searched). For
1F1B the compute term is the textbook (m + p - 1) x (forward + backward) of a stage; the
data-parallel term is what tells a ZeRO-3 job bound by its gathers from one that hides them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from minigpt.config import GPTConfig
from job.data_parallel import schedule_config
from job.layout import Layout
from job.schedule import (AllReduceGrads, Backward, Compute, DataParallel, Forward, GatherParams, OptimizerStep,
                          ReduceScatterGrads, ReduceTiedGrad, ScheduleConfig, armed_around, batches, compute_order)
from job.schedule_check import ends_alive, peak_alive
from job.train_config import TrainConfig
from precision.policy import policy as precision_policy
from simulator.engine.simulate import ddp_bucket_mb, step_schedule
from simulator.engine.costs import RankCosts, action_prices, optimizer_seconds, rank_costs
from simulator.engine.muon import iteration_seconds
from simulator.engine.links import LinkCosts
from simulator.costs.hardware import Hardware
from simulator.memory import MemoryEstimate
from simulator.costs.implementation import Implementation
from simulator.engine.overlap import Overlap, resolve_overlap, stack_default, stack_implementation
from simulator.network.topology import Cluster

BUCKET_MB = TrainConfig.bucket_mb  # the memory model's bucket buffers, as simulate_step sizes them by default


class ComputeLinks(LinkCosts):
    """The layout's links without the pipeline-wide collectives: the bound leaves the gradient norm's
    all-reduce over the stages out (it only makes the bound lower), and on a large cluster pricing it
    costs more than the rest of the bound."""

    def pp_collective(self, kind: str, nbytes: float) -> float:
        return 0.0


@dataclass(frozen=True)
class ScheduleShape:
    """What the memory check and the bound need of a schedule's compute order, per rank."""

    in_flight: tuple[int, ...]  # job/schedule.py's peak_in_flight: forwards alive at the peak
    first: tuple[tuple[type, int], ...]  # (action type, chunk) of the rank's first compute
    last: tuple[tuple[type, int], ...]  # and of its last
    ends: tuple[tuple[int, int], ...] = ()  # job/schedule.py's peak_ends_in_flight: of the first and last chunks


@lru_cache(maxsize=512)
def schedule_shape(pp: int, micro_batches: int, kind: str, virtual_chunks: int) -> ScheduleShape:
    """From the compute order alone (job/schedule.py's `compute_order`): the schedule's
    communication and data-parallel actions change neither, so a candidate's ZeRO stage and
    buckets do not matter and one order serves every candidate of the same pipeline."""
    config = ScheduleConfig(pp, micro_batches, kind, virtual_chunks)
    in_flight, first, last, ends = [], [], [], []
    for rank in range(pp):
        order = compute_order(config, rank)
        in_flight.append(peak_alive(order, lambda chunk: True))
        ends.append(ends_alive(order, pp * virtual_chunks))
        first.append((type(order[0]), order[0].chunk))
        last.append((type(order[-1]), order[-1].chunk))
    return ScheduleShape(tuple(in_flight), tuple(first), tuple(last), tuple(ends))


@lru_cache(maxsize=256)  # per candidate in plan's hot loops: one Implementation per distinct stack
def candidate_stack(overlap: Overlap | str, recompute: str, expert_load: float = 1.0,
                    dispatcher: str = "alltoall", changes: tuple[tuple[str, object], ...] = ()) -> Implementation:
    """How a candidate's blocks are computed, as simulate_step computes them under `overlap` (a preset or its name):
    flash attention, the stack's own choices (its sequence-parallel input and attention kernel too) with `changes`
    (Implementation fields the stack's flags change: cli/options/stack.py's stack_changes), a MoE's load and
    dispatcher. Megatron's recompute modules go with recompute none and selective; a block recomputed whole (full,
    op) reruns them anyway."""
    changes = {k: v for k, v in changes if k != "recompute_modules" or recompute in ("none", "selective")}
    return replace(stack_default(overlap, "flash", recompute), **changes, expert_load=expert_load,
                   dispatcher=dispatcher)


_REDUCTIONS = (AllReduceGrads, ReduceScatterGrads, ReduceTiedGrad)  # on the rank's data-parallel stream, in turn


@dataclass(frozen=True)
class RankSchedule:
    """What the bound's terms that read the schedule need of one rank, none of which depends on the micro-batch's
    size or the recompute: its computes (each (type, chunk), the seconds of the ZeRO-3 gathers it issues, and how
    many times), the first forward's gathers of each chunk it holds, and for reduction_r the computes listed before
    the one that issues the first gradient reduction and that one (None: the rank reduces nothing), the reductions
    before the optimizer step, the step's own (the routed experts', issued with it), and what follows it: the
    optimizer and the update gathers nothing hides (Overlap.param_gather "step")."""

    computes: tuple[tuple[tuple[type, int], float, int], ...] = ()
    first_gathers: tuple[tuple[int, float], ...] = ()
    before: tuple[tuple[tuple[type, int], int], ...] = ()
    issuer: tuple[type, int] | None = None
    reductions: float = 0.0
    at_step: float = 0.0
    after: float = 0.0

    @property
    def issues_gathers(self) -> bool:
        return any(gathers for _, gathers, _ in self.computes)

    def reduction_seconds(self, prices: dict[tuple[type, int], float], dp_after: bool) -> float:
        """reduction_r with the computes at `prices`; `dp_after`: the reductions start once their issuer ends."""
        stream = 0.0
        if self.issuer is not None:
            stream = (sum(count * prices.get(action, 0.0) for action, count in self.before) + self.reductions
                      + (prices.get(self.issuer, 0.0) if dp_after else 0.0))
        work = sum(count * prices.get(action, 0.0) for action, _, count in self.computes)
        return max(stream, work) + self.at_step + self.after


def rank_schedule(cost: RankCosts, actions, settings: Overlap) -> tuple[float, RankSchedule]:
    """(data_parallel_r, RankSchedule) of one rank: `actions` its schedule, `cost` its prices (rank_costs)."""
    priced = {id(a): cost.pricer.seconds(a) for a in actions if isinstance(a, DataParallel)}
    computes: dict[tuple[tuple[type, int], float], int] = {}
    first: dict[int, float] = {}
    before: dict[tuple[type, int], int] = {}
    issuer, reducing = None, False
    reductions = at_step = update_gathers = 0.0
    groups = batches(actions)
    armed, _ = armed_around(groups)
    for index, group in enumerate(groups):
        action, kind = group[0], type(group[0])
        if isinstance(action, Compute):
            key = (kind, action.chunk)
            gathered = sum(priced[id(a)] for a in armed.get(index, ()) if type(a) is GatherParams)
            computes[(key, gathered)] = computes.get((key, gathered), 0) + 1
            if kind is Forward:
                first.setdefault(action.chunk, gathered)
            if not reducing:
                if issuer is not None:
                    before[issuer] = before.get(issuer, 0) + 1
                issuer = key
        elif kind in _REDUCTIONS:
            reducing = True
            reductions += priced[id(action)]
        elif kind is OptimizerStep:
            at_step += priced[id(action)]
        elif kind is GatherParams and action.phase == "update" and settings.param_gather == "step":
            update_gathers += priced[id(action)]
    return sum(priced.values()), RankSchedule(
        tuple((key, gathered, count) for (key, gathered), count in computes.items()), tuple(first.items()),
        tuple(before.items()), issuer if reducing else None, reductions, at_step, cost.optimizer + update_gathers)


class StepBound:
    """Lower bounds for one model on one cluster; the prices of a pipeline are computed once and
    shared by every candidate that differs from it only in ZeRO stage or schedule kind."""

    def __init__(self, model: GPTConfig, cluster: Cluster, hardware: Hardware, precision: str,
                 expert_load: float = 1.0, dispatcher: str = "alltoall", overlap: str = "executor",
                 changes: tuple[tuple[str, object], ...] = ()) -> None:
        self.model, self.cluster, self.hardware, self.precision = model, cluster, hardware, precision
        self.expert_load = expert_load  # a MoE's routing imbalance, as simulate_step is given it
        self.dispatcher = dispatcher  # how its rows travel (Implementation.dispatcher)
        self.policy = precision_policy(precision)
        self.settings = resolve_overlap(overlap)  # a preset, as simulate_step is given it (default: our executor)
        self.changes = changes  # the Implementation fields the stack's flags change (candidate_stack)
        self.fused_optimizer = stack_implementation(self.settings)["fused_optimizer"]  # no stack flag changes it
        self.prices: dict[tuple, tuple[dict, dict, dict]] = {}  # _priced's, by pipeline and micro-batch
        self.units: dict = {}  # rank_costs' priced units, shared by every layout of this model, cluster and precision
        # per (layout, micro-batches, kind), each rank's data-parallel prices summed and its RankSchedule
        self.data_parallel: dict[tuple, list[tuple[float, RankSchedule]]] = {}

    def costs(self, layout: Layout, micro_batches: int, kind: str, micro_batch: int, recompute: str,
              memory: MemoryEstimate) -> list[RankCosts]:
        """rank_costs as simulate_step calls it (its optimizer without the norm's reduction over pp)."""
        gpu, stack, buckets = self.hardware.gpu, self.stack(recompute), self.buckets(layout, recompute)
        config = schedule_config(self.model, layout, micro_batches, kind, buckets, self.precision)
        return rank_costs(self.model, layout, config, ComputeLinks(self.cluster, layout, gpu), gpu, self.precision,
                          micro_batch, recompute, gpu.matmul_efficiency, memory, buckets, None, stack,
                          self.settings, unit_memo=self.units)

    def buckets(self, layout: Layout, recompute: str) -> float:
        """MiB of the data-parallel reductions: the stack's buckets, as simulate_step cuts them (ddp_bucket_mb)."""
        return ddp_bucket_mb(self.stack(recompute), layout, self.policy)

    def stack(self, recompute: str) -> Implementation:
        """How every candidate with this recompute computes (candidate_stack of the bound's stack and flags)."""
        return candidate_stack(self.settings, recompute, self.expert_load, self.dispatcher, self.changes)

    def chunk_prices(self, layout: Layout, micro_batches: int, kind: str, micro_batch: int, recompute: str,
                     memory: MemoryEstimate) -> tuple[dict[int, float], dict[int, float]]:
        """(forward, backward) seconds per global chunk, as rank_costs prices them with nothing armed (action_prices:
        the same prices without the data-parallel pricer, which only data_parallel_seconds reads)."""
        forward, backward, _ = self._priced(layout, micro_batch, recompute)
        return forward, backward

    def action_totals(self, layout: Layout, micro_batch: int, recompute: str) -> dict[tuple[type, int], float]:
        """Every compute's price with nothing armed, by (type, chunk), as chunk_prices prices it."""
        return self._priced(layout, micro_batch, recompute)[2]

    def _priced(self, layout: Layout, micro_batch: int, recompute: str) -> tuple[dict, dict, dict]:
        """(forward, backward, every compute's price by (type, chunk)), computed once per pipeline and micro-batch."""
        key = (layout.tp, layout.sequence_parallel, layout.pp, layout.dp, layout.virtual_chunks, micro_batch, recompute,
               layout.cp, layout.cp_kind, layout.ep)
        if key not in self.prices:
            forward, backward, totals = {}, {}, {}
            gpu = self.hardware.gpu
            for actions in action_prices(self.model, layout, ComputeLinks(self.cluster, layout, gpu), gpu,
                                         self.precision, micro_batch, gpu.matmul_efficiency, self.stack(recompute),
                                         self.settings, self.units):
                for (action, chunk), cost in actions.items():
                    totals[(action, chunk)] = cost.total
                    if action is Forward:
                        forward[chunk] = cost.total
                    elif action is Backward:
                        backward[chunk] = cost.total
            self.prices[key] = forward, backward, totals
        return self.prices[key]

    def compute_seconds(self, layout: Layout, micro_batches: int, kind: str, micro_batch: int, recompute: str,
                        memory: MemoryEstimate) -> float:
        """max over ranks of compute_r (the module docstring); `memory`: the job's predict_memory."""
        forward, backward = self.chunk_prices(layout, micro_batches, kind, micro_batch, recompute, memory)
        chunks = layout.pp * layout.virtual_chunks
        work = [micro_batches * sum(forward[c] + backward[c] for c in range(rank, chunks, layout.pp))
                for rank in range(layout.pp)]
        return self._pipeline(layout, micro_batches, kind, memory, forward, backward, work)

    def gathered_seconds(self, layout: Layout, micro_batches: int, kind: str, micro_batch: int, recompute: str,
                         memory: MemoryEstimate) -> float:
        """max over ranks of gathered_r: compute_r with every compute at least as long as the gathers it issues
        (0 where none issues any)."""
        ranks = self._data_parallel(layout, micro_batches, kind, micro_batch, recompute, memory)
        if not any(rank.issues_gathers for _, rank in ranks):
            return 0.0
        forward, backward = self.chunk_prices(layout, micro_batches, kind, micro_batch, recompute, memory)
        prices, first = self.action_totals(layout, micro_batch, recompute), {}
        for _, rank in ranks:
            first.update(rank.first_gathers)
        work = [sum(count * max(prices.get(action, 0.0), gathers) for action, gathers, count in rank.computes)
                for _, rank in ranks]
        heads = {chunk: max(seconds, first.get(chunk, 0.0)) for chunk, seconds in forward.items()}
        return self._pipeline(layout, micro_batches, kind, memory, heads, backward, work)

    def _pipeline(self, layout: Layout, micro_batches: int, kind: str, memory: MemoryEstimate,
                  forward: dict[int, float], backward: dict[int, float], work: list[float]) -> float:
        """max over ranks r of head_r + work[r] + the end (the module docstring's compute_r), the head from
        `forward`'s chunk prices, the end from `backward`'s."""
        shape = schedule_shape(layout.pp, micro_batches, kind, layout.virtual_chunks)
        optimizer = [optimizer_seconds(stage, self.policy, self.hardware.gpu, self.fused_optimizer)
                     for stage in memory.per_stage]
        if dict(self.changes).get("optimizer") == "muon":  # and its busiest rank's iteration, all-to-alls aside
            gpu = self.hardware.gpu
            optimizer = [seconds + iteration_seconds(self.model, layout, rank, gpu, gpu.matmul_efficiency, self.policy)
                         for rank, seconds in enumerate(optimizer)]
        best = 0.0
        for rank in range(layout.pp):
            first_kind, first_chunk = shape.first[rank]
            head = sum(forward[c] for c in range(first_chunk)) if first_kind is Forward else 0.0
            last_kind, last_chunk = shape.last[rank]
            end = optimizer[rank]
            if last_kind is Backward and last_chunk > 0:
                end = max(end, sum(backward[c] for c in range(last_chunk)) + optimizer[0])
            best = max(best, head + work[rank] + end)
        return best

    def data_parallel_seconds(self, layout: Layout, micro_batches: int, kind: str, micro_batch: int, recompute: str,
                              memory: MemoryEstimate) -> float:
        """max over ranks of data_parallel_r: the schedule simulate_step replays, priced as it prices it."""
        ranks = self._data_parallel(layout, micro_batches, kind, micro_batch, recompute, memory)
        return max((total for total, _ in ranks), default=0.0)

    def reduction_seconds(self, layout: Layout, micro_batches: int, kind: str, micro_batch: int, recompute: str,
                          memory: MemoryEstimate) -> float:
        """max over ranks of reduction_r, its computes at this candidate's chunk prices."""
        ranks = self._data_parallel(layout, micro_batches, kind, micro_batch, recompute, memory)
        if not ranks:
            return 0.0
        prices, after = self.action_totals(layout, micro_batch, recompute), self.settings.dp == "after"
        return max(rank.reduction_seconds(prices, after) for _, rank in ranks)

    def _data_parallel(self, layout: Layout, micro_batches: int, kind: str, micro_batch: int, recompute: str,
                       memory: MemoryEstimate) -> list[tuple[float, RankSchedule]]:
        """Per rank, its data-parallel prices summed and its RankSchedule (none with one data rank). The
        data-parallel actions and their collectives' prices follow from the layout, the schedule (its kind and
        micro-batches) and the stack, not from the micro-batch's size, the recompute or the memory: priced once for
        every candidate that shares the first three."""
        if layout.data_ranks == 1:
            return []
        key = (layout, micro_batches, kind)
        if key not in self.data_parallel:
            schedule = step_schedule(self.model, layout, micro_batches, kind, self.buckets(layout, recompute),
                                     self.precision)
            costs = self.costs(layout, micro_batches, kind, micro_batch, recompute, memory)
            self.data_parallel[key] = [rank_schedule(cost, actions, self.settings)
                                       for cost, actions in zip(costs, schedule.actions)]
        return self.data_parallel[key]

    def communication_seconds(self, layout: Layout, micro_batches: int, kind: str, micro_batch: int, recompute: str,
                              memory: MemoryEstimate) -> float:
        """The bound's terms that read the schedule: max(data_parallel_r, reduction_r, gathered_r) over ranks."""
        job = (layout, micro_batches, kind, micro_batch, recompute, memory)
        return max(self.data_parallel_seconds(*job), self.reduction_seconds(*job), self.gathered_seconds(*job))

    def seconds(self, layout: Layout, micro_batches: int, kind: str, micro_batch: int, recompute: str,
                memory: MemoryEstimate) -> float:
        """The bound of the module docstring for this job."""
        job = (layout, micro_batches, kind, micro_batch, recompute, memory)
        return max(self.compute_seconds(*job), self.communication_seconds(*job))
