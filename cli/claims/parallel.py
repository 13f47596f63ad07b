"""Parallelism claims: scaling, the pipeline bubble, where TP and PP belong, and the strategy table, from the
schedule (job/schedule.py, replayed symbolically or by the simulator) and the simulator's link model
(simulator/engine/links.py on clusters built as `minigpt simulate` builds them). Torch-free."""

from __future__ import annotations

from cli.claims.claim import CAVEAT, HOLDS, WRONG, Claim, Finding, percent, ratio_text
from cli.claims.sim import GIB, SimCase
from job.data_parallel import collectives, schedule_config
from job.layout import Layout
from job.schedule import (Costs, ScheduleConfig, SendActivation, SendGrad, build_schedule, closed_form_bubble,
                          simulate_order)
from job.train_config import TrainConfig
from minigpt.presets import preset
from precision.policy import FORMAT_BYTES
from simulator.costs.compute import chunk_times
from simulator.engine.links import LinkCosts
from simulator.search.sweep import DEFAULT_THRESHOLD, ClusterSpec, Job, scaling_sweep

SWEEP_MODEL, SWEEP_BATCH, SWEEP_COUNTS, SWEEP_GPU = "gpt2-124m", 64, (1, 2, 4, 8, 16, 32, 64), "a100-80gb"
BUBBLE_PP, BUBBLE_M = 4, 8
BUBBLE_KINDS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
GPT3_PIPELINE = SimCase("gpt3-175b", tp=8, pp=16, dp=8, zero=1, global_batch=1536)
BUBBLE_TOLERANCE = 0.10  # a simulated bubble within 10% of the formula is the formula
STRATEGY_MODEL, STRATEGY_GPUS = "llama3-8b", 8
STRATEGIES = {"DDP": dict(dp=8), "TP": dict(tp=8), "PP": dict(pp=8), "ZeRO-3": dict(dp=8, zero=3)}
ARTICLE_COMM = {"DDP": 1, "PP": 2, "TP": 3, "ZeRO-3": 3}  # small, medium, large, large
ARTICLE_MEMORY = {"DDP": 3, "TP": 2, "PP": 2, "ZeRO-3": 1}  # memory efficiency low, high, high, highest (1 = best)


def sweep_command() -> str:
    return (f"minigpt simulate --model {SWEEP_MODEL} --sweep --gpus {','.join(map(str, SWEEP_COUNTS))} --global-batch "
            f"{SWEEP_BATCH} --tp 1 --pp 1 --gpu {SWEEP_GPU}")


def check_more_gpus() -> Finding:
    job = Job(preset(SWEEP_MODEL), "bf16", SWEEP_BATCH, 1, 0)
    sweep = scaling_sweep(job, list(SWEEP_COUNTS), ClusterSpec.of(SWEEP_GPU), "strong", DEFAULT_THRESHOLD, 1, 1)
    points = [{"gpus": p.gpus, "samples_per_s": p.samples_per_s, "efficiency": p.efficiency, "marginal": p.marginal,
               "dp_comm_share": p.result.breakdown["dp_comm"] / p.result.step_time_s} for p in sweep.points]
    stop = sweep.stop
    numbers = {"points": points, "stops_paying_at": stop.gpus if stop else None, "threshold": sweep.threshold}
    at = {p["gpus"]: p for p in points}
    last = points[-1]
    if stop is None:
        return Finding(f"still pays up to {last['gpus']} GPUs", WRONG, sweep.verdict(), numbers, sweep.verdict())
    before = [p for p in points if p["gpus"] < stop.gpus][-1]
    ours = (f"stops paying at {stop.gpus} GPUs ({before['gpus']} -> {stop.gpus}: an added GPU brings "
            f"{percent(stop.marginal)} of a GPU's worth); exposed dp comm {percent(before['dp_comm_share'])} -> "
            f"{percent(at[stop.gpus]['dp_comm_share'])}; efficiency at {last['gpus']}: {percent(last['efficiency'])}")
    server, verdict = ClusterSpec.of(SWEEP_GPU).gpus_per_node, sweep.verdict()
    why = (f"strong scaling of pure data parallelism: past one server ({server} GPUs) the gradient all-reduce crosses "
           f"the network while the work per GPU shrinks, and from {stop.gpus} GPUs on communication decides")
    discussion = (
        f"{SWEEP_MODEL}, a global batch of {SWEEP_BATCH} sequences, DDP on {', '.join(map(str, SWEEP_COUNTS))} A100s: "
        f"throughput " + ", ".join(f"{p['samples_per_s']:.0f}" for p in points) + " samples/s, efficiency "
        + ", ".join(percent(p["efficiency"]) for p in points) + ". The exposed gradient all-reduce takes "
        + ", ".join(percent(p["dp_comm_share"]) for p in points)
        + f" of the step. {verdict[0].upper()}{verdict[1:]}. More GPUs still add throughput after that point, but each "
        f"one less than half of what a GPU already there brings (simulator/search/sweep.py's threshold, "
        f"{percent(sweep.threshold)})."
    )
    return Finding(ours, HOLDS, why, numbers, discussion)


def replayed_bubbles() -> dict[str, dict[str, float]]:
    out = {}
    for kind, chunks in BUBBLE_KINDS:
        timeline = simulate_order(build_schedule(ScheduleConfig(BUBBLE_PP, BUBBLE_M, kind, chunks)))
        out[kind] = {"chunks": chunks, "replayed": timeline.bubble_fraction(),
                     "formula": closed_form_bubble(BUBBLE_PP, BUBBLE_M, kind, chunks)}
    return out


def tenths(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def check_bubble() -> Finding:
    bubbles = replayed_bubbles()
    result = GPT3_PIPELINE.result
    simulated = result.breakdown["pipeline_bubble"] / result.step_time_s
    formula = closed_form_bubble(result.layout.pp, result.micro_batches, result.schedule)
    numbers = {"pp": BUBBLE_PP, "micro_batches": BUBBLE_M, "replays": bubbles, "gpt3_simulated": simulated,
               "gpt3_formula": formula, "gpt3_micro_batches": result.micro_batches}
    exact = all(abs(b["replayed"] - b["formula"]) < 1e-9 for b in bubbles.values())
    close = abs(simulated - formula) <= BUBBLE_TOLERANCE * formula
    verdict = (HOLDS if close else CAVEAT) if exact else WRONG
    ours = (f"replayed = formula, p={BUBBLE_PP} m={BUBBLE_M}: " + ", ".join(
        f"{k}{' v' + str(b['chunks']) if b['chunks'] > 1 else ''} {b['replayed']:.3f}" for k, b in bubbles.items())
        + f"; GPT-3 p{result.layout.pp} m{result.micro_batches} simulated {tenths(simulated)} vs {tenths(formula)}")
    costs = Costs()
    why = (f"with unit costs (F {costs.forward}, B {costs.backward}) every schedule's replay is its closed form; "
           f"with real costs the slowest rank of GPT-3's pipeline idles {tenths(simulated)} of the step, not the "
           f"formula's {tenths(formula)}")
    discussion = (
        f"The article names pipeline parallelism but not its bubble. The textbook's (p-1)/(m+p-1) is exactly what "
        f"job/schedule.py's GPipe and 1F1B lists give when replayed with a backward twice a forward: "
        f"{bubbles['1f1b']['replayed']:.4f} for p = {BUBBLE_PP}, m = {BUBBLE_M}. Interleaving "
        f"{bubbles['interleaved']['chunks']} chunks per rank divides the fill by the chunks, (p-1)/(vm+p-1) = "
        f"{bubbles['interleaved']['replayed']:.4f}, and ZB-H1's split backward fills it with weight gradients, "
        f"(p-1)/(3m+p-1) = {bubbles['zb-h1']['replayed']:.4f} (F = B = W). On the simulated GPT-3 pipeline "
        f"({result.layout.pp} stages, {result.micro_batches} micro-batches per replica) the slowest rank's bubble is "
        f"{tenths(simulated)} against the formula's {tenths(formula)}: stages are not equal (the ends carry the "
        f"embedding, the head and the loss) and a backward is not exactly two forwards."
    )
    return Finding(ours, verdict, why, numbers, discussion)


def check_tp_in_node() -> Finding:
    case = GPT3_PIPELINE
    spec = ClusterSpec.of(case.gpu)
    model, layout, hardware, server = case.config, case.layout, spec.hardware, spec.gpus_per_node
    layers = -(-model.n_layers // layout.pp)
    chunk = chunk_times(model, layers, case.micro_batch, layout, hardware.gpu, case.precision)
    tp_calls = chunk.tp_collectives_forward + chunk.tp_collectives_backward
    in_server = LinkCosts(spec.build(server), Layout(tp=server), hardware.gpu)
    across = LinkCosts(spec.build(server * server), Layout(tp=server, dp=server), hardware.gpu)  # rings over 8 servers
    tp_in = sum(c.calls * in_server.tp_collective(c.kind, c.bytes) for c in tp_calls)
    tp_across = sum(c.calls * across.dp_collective(0, c.kind, c.bytes) for c in tp_calls)
    activation = case.micro_batch * model.seq_len * model.d_model * FORMAT_BYTES[case.precision]
    pp_across = LinkCosts(spec.build(2 * server), Layout(tp=server, pp=2), hardware.gpu).p2p(0, 1, activation)
    pp_in = LinkCosts(spec.build(server), Layout(pp=server), hardware.gpu).p2p(0, 1, activation)
    compute = chunk.forward_s + chunk.backward_s
    placed = tp_in + 2 * pp_across  # TP on NVLink, PP's activation and its gradient over the network
    swapped = tp_across + 2 * pp_in  # TP rings across servers, PP inside one
    numbers = {"layers_per_stage": layers, "compute_s": compute, "tp_collectives": sum(c.calls for c in tp_calls),
               "tp_in_server_s": tp_in, "tp_across_servers_s": tp_across, "pp_across_servers_s": pp_across,
               "pp_in_server_s": pp_in, "tp_in_pp_across_s": placed, "pp_in_tp_across_s": swapped}
    ours = (f"per micro-batch of a GPT-3 stage ({compute * 1e3:.0f} ms compute): TP in a server {tp_in * 1e3:.1f} ms, "
            f"across servers {tp_across * 1e3:.1f} ms; PP send across servers {pp_across * 1e3:.2f} ms")
    verdict = HOLDS if swapped > 2 * placed else CAVEAT if swapped > placed else WRONG
    why = (f"TP all-reduces every layer's activations ({numbers['tp_collectives']} per micro-batch): "
           f"{ratio_text(tp_across / tp_in)} slower over the network; PP sends one activation per micro-batch, so "
           f"TP inside, PP across costs {placed * 1e3:.1f} ms against {swapped * 1e3:.1f} ms the other way")
    discussion = (
        f"GPT-3 as {layout.tp} x {layout.pp} x {layout.dp} on A100 servers of {server}: a stage of {layers} blocks "
        f"computes one micro-batch in {compute * 1e3:.1f} ms and its tensor-parallel group all-reduces "
        f"{numbers['tp_collectives']} times. Priced on the simulator's links, those all-reduces take "
        f"{tp_in * 1e3:.1f} ms on NVLink and {tp_across * 1e3:.1f} ms as rings over {server} servers "
        f"({hardware.node.nics_per_node} NICs a server); the stage-to-stage activation takes {pp_across * 1e3:.2f} "
        f"ms across servers and {pp_in * 1e3:.2f} ms inside one. TP inside, PP across: {placed * 1e3:.1f} ms of "
        f"communication per micro-batch; the swap: {swapped * 1e3:.1f} ms. The simulator refuses a tp group that "
        f"spans servers, so the swapped placement is priced here, not simulated as a step."
    )
    return Finding(ours, verdict, why, numbers, discussion)


def strategy_volume(name: str, layout: dict) -> float:
    """Communication volume per GPU per step, bytes (2S an all-reduce, S otherwise), of one strategy."""
    case = SimCase(STRATEGY_MODEL, global_batch=STRATEGY_GPUS, **layout)
    model, lay, m = case.config, case.layout, case.result.micro_batches
    if name == "TP":
        chunk = chunk_times(model, model.n_layers, case.micro_batch, lay, ClusterSpec.of(case.gpu).hardware.gpu,
                            case.precision, first=True, last=True)
        calls = chunk.tp_collectives_forward + chunk.tp_collectives_backward
        return m * sum(c.calls * c.bytes * (2 if c.kind == "all_reduce" else 1) for c in calls)
    config = schedule_config(model, lay, m, case.schedule, TrainConfig.bucket_mb, case.precision)
    actions = build_schedule(config).actions[lay.pp // 2]  # a middle pipeline stage sends both ways
    if name == "PP":
        activation = case.micro_batch * model.seq_len * model.d_model * FORMAT_BYTES[case.precision]
        return activation * sum(isinstance(a, (SendActivation, SendGrad)) for a in actions)
    return sum(2 * size if kind == "all_reduce" else size
               for action in actions for kind, size, _ in collectives(action, config.plan))


def _ranks(values: dict[str, float]) -> dict[str, int]:
    ordered = sorted(set(values.values()))
    return {name: ordered.index(v) + 1 for name, v in values.items()}


def _inversions(article: dict[str, int], ours: dict[str, float]) -> list[tuple[str, str]]:
    """Pairs (a, b) the article orders a < b whose measured values order the other way."""
    return [(a, b) for a in article for b in article if article[a] < article[b] and ours[a] > ours[b]]


def check_strategies() -> Finding:
    volume = {name: strategy_volume(name, layout) for name, layout in STRATEGIES.items()}
    memory = {name: SimCase(STRATEGY_MODEL, global_batch=STRATEGY_GPUS, **layout).result.memory.total
              for name, layout in STRATEGIES.items()}
    comm_wrong, memory_wrong = _inversions(ARTICLE_COMM, volume), _inversions(ARTICLE_MEMORY, memory)
    numbers = {"volume_gb": {k: v / 1e9 for k, v in volume.items()},
               "memory_gib": {k: v / GIB for k, v in memory.items()},
               "comm_inversions": comm_wrong, "memory_inversions": memory_wrong, "article_comm_rank": ARTICLE_COMM,
               "article_memory_rank": ARTICLE_MEMORY}
    by_volume = sorted(volume, key=volume.get)
    by_memory = sorted(memory, key=memory.get)
    ours = ("traffic per GPU: " + " < ".join(f"{k} {volume[k] / 1e9:.1f} GB" for k in by_volume) + "; memory per GPU: "
            + " < ".join(f"{k} {memory[k] / GIB:.0f} GiB" for k in by_memory))
    wrong = ([f"{b} moves less than {a}" for a, b in comm_wrong]
             + [f"{b} needs less memory than {a}" for a, b in memory_wrong])
    verdict = WRONG if wrong else HOLDS
    why = ("; ".join(wrong) + f" (at {STRATEGY_GPUS} sequences of {preset(STRATEGY_MODEL).seq_len} tokens)") if wrong \
        else "the orders hold at this batch"
    discussion = (
        f"{STRATEGY_MODEL} on {STRATEGY_GPUS} A100s, a global batch of {STRATEGY_GPUS} sequences, each strategy alone. "
        "Volume per GPU per step, counted from the schedule (DDP, ZeRO-3: its collectives; PP: a middle stage's sends) "
        "and from the op model's tensor-parallel collectives (TP): " + ", ".join(
            f"{k} {volume[k] / 1e9:.2f} GB" for k in STRATEGIES) + ". Memory per GPU (simulate_step): " + ", ".join(
            f"{k} {memory[k] / GIB:.1f} GiB" for k in STRATEGIES) + ". DDP's gradient all-reduce moves the whole model "
        "twice a step whatever the batch, PP only activations at stage borders; TP moves every layer's activations. "
        "ZeRO-3 shards the model states but not the activations, which a long sequence makes the larger part."
    )
    return Finding(ours, verdict, why, numbers, discussion)


CLAIMS = [
    Claim("more-gpus", "More GPUs stop speeding training up once communication outweighs what they add",
          'misconception 2, "GPU越多训练越快"', "at some point (no number)", sweep_command(), check_more_gpus,
          needs_torch=False),
    Claim("bubble", "The pipeline bubble: (p-1)/(m+p-1), and what interleaving and zero-bubble do to it",
          "2.2, PP row (the article gives no formula)", "(none)",
          f"minigpt schedule --pp {BUBBLE_PP} --micro-batches {BUBBLE_M} --schedule 1f1b; minigpt schedule --pp "
          f"{BUBBLE_PP} --micro-batches {BUBBLE_M} --schedule interleaved --virtual-chunks 2; minigpt schedule --pp "
          f"{BUBBLE_PP} --micro-batches {BUBBLE_M} --schedule zb-h1", check_bubble, needs_torch=False),
    Claim("tp-in-node", "TP inside a server (NVLink), PP across servers",
          '2.2, "大模型训练通常组合使用：FSDP + TP + PP" (placement: common practice, not the article\'s)', "(none)",
          f"{GPT3_PIPELINE.command()}; minigpt claims --only tp-in-node", check_tp_in_node, needs_torch=False),
    Claim("strategies", "Strategy table: traffic DDP small, PP medium, TP and ZeRO-3 large; memory efficiency DDP low, "
          "TP and PP high, ZeRO-3 highest", '2.2, table "不同并行策略对比"', "small / medium / large / large",
          "; ".join(SimCase(STRATEGY_MODEL, global_batch=STRATEGY_GPUS, **layout).command()
                    for layout in STRATEGIES.values()),
          check_strategies, needs_torch=False),
]
