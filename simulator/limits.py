"""How large a job the simulator takes: stated limits, checked before anything is built. Torch-free.

The simulator's work, and its memory, grow with a few numbers:
- the GPUs: every distinct transfer of a step (a p2p between two stages, a dp ring per bucket
  size, the pp rings) routes one flow per GPU taking part (simulator/engine/links.py);
- the schedule's slots, pp x virtual chunks x micro-batches per replica: job/schedule.py builds
  and simulator/engine/replay.py replays a few actions for each;
- under ZeRO-3, the unit gathers, micro-batches per replica x (layers + 2): one priced action each;
- the layers otherwise (ops and units per block), far cheaper than the rest.
Beyond the limits below `minigpt simulate` (cli/commands/simulate.py, and simulator/network/topology.py's
build_cluster, simulator/search/sweep.py) refuses in one line, exit 2, before it builds a cluster or a
schedule. They sit well above every published training run: the largest ran on about 100,000
GPUs, the deepest model has 126 layers, the longest pipeline schedule (Megatron's 1T model,
pp 64 x 512 micro-batches) has 32,768 slots, a ZeRO-3/FSDP run with pipelining (Llama 3 405B,
126 layers, ~16 micro-batches) gathers ~2,000 units.

Measured on two CPU cores shared with other work (`/usr/bin/time`, gpt3-175b unless said):
131,072 GPUs as dp alone, tp 8 x dp 16,384 or tp 8 x pp 16 x dp 1,024: 4-15 s, 100-210 MB;
131,072 slots (tp 8 x pp 128 x dp 8, 1,024 layers, 1,024 micro-batches): 3.7 s / 190 MB with 1f1b,
3.4 s interleaved (pp 32 x 4 chunks), 7.3 s / 270 MB zb-h1, and 11 s / 320 MB on 131,072 GPUs;
ZeRO-3 at the gather limit: 1.4 s / 190 MB for tp 8 x dp 16,384 (131,072 GPUs, 1,000 micro-batches),
2.7 s / 190 MB for tp 8 x pp 128 x dp 128 (1,024 layers; each gather is priced once per size,
simulator/engine/data_parallel.py);
a topology file of 16,384 GPUs (27 MB of node-link JSON, 36 MB of GraphML): 12-15 s, 300-790 MB;
a sweep of gpt2-124m over 65,536 and 131,072 GPUs (every candidate layout at each): 51 s, 250 MB.
Before these limits `simulate --dp 1000000` (gpt3-175b) ran for minutes and `--layers 1000000`
passed 1.7 GB in a minute without a word.

The sequence length has no limit here: it enters shapes, bytes and FLOPs, never a loop or a list, so it
costs nothing (Python's integers do not overflow). Context parallelism's ranks count among the GPUs
(tp x cp x pp x dp); its exchange is priced once per stage and block kind, like the other transfers.
Measured: llama3-405b at 1,048,576 tokens, tp 8 x cp 128 x pp 16 x dp 8 = 131,072 GPUs: 7.2 s, 190 MB;
at 131,072 tokens with cp 16 (16,384 GPUs): 2 s.
"""

from __future__ import annotations

from minigpt.errors import ConfigError

MAX_GPUS = 131_072  # 2**17 GPUs in a simulated cluster (built from flags)
MAX_FILE_GPUS = 16_384  # GPUs in a topology file: its routes are searched on the graph, ~1 ms per GPU
MAX_FILE_BYTES = 256 * 2**20  # a topology or hardware file (a 16,384-GPU topology is 27-36 MB)
MAX_LAYERS = 1_024  # transformer blocks
MAX_SCHEDULE_SLOTS = 131_072  # pp x virtual chunks x micro-batches per replica
MAX_ZERO3_GATHERS = 131_072  # with ZeRO-3: micro-batches per replica x (layers + 2) units gathered
MAX_SWEEP_POINTS = 32  # GPU counts in one sweep
MAX_SWEEP_GPUS = 2 * MAX_GPUS  # GPUs summed over a sweep's points (a doubling sweep up to MAX_GPUS fits)

ADVICE = "simulator/limits.py states the limits and why"


def check_gpus(n_gpus: int, what: str = "the cluster") -> int:
    """`n_gpus` when it is within MAX_GPUS; ConfigError otherwise."""
    if n_gpus > MAX_GPUS:
        raise ConfigError(f"{what} has {n_gpus:,} GPUs, more than the {MAX_GPUS:,} the simulator takes "
                          f"({ADVICE}): simulate a smaller cluster")
    return n_gpus


def check_file_gpus(n_gpus: int, origin: str) -> None:
    if n_gpus > MAX_FILE_GPUS:
        raise ConfigError(f"{origin}: the topology file holds {n_gpus:,} GPUs, more than the {MAX_FILE_GPUS:,} a "
                          f"file may hold ({ADVICE}): build the cluster from flags (--nodes, --gpus-per-node, "
                          f"--topology-kind), which takes up to {MAX_GPUS:,}")


def check_layers(n_layers: int) -> None:
    if n_layers > MAX_LAYERS:
        raise ConfigError(f"the model has {n_layers:,} layers, more than the {MAX_LAYERS:,} the simulator takes "
                          f"({ADVICE}): give fewer --layers")


def schedule_slots(pp: int, virtual_chunks: int, micro_batches: int) -> int:
    return pp * virtual_chunks * micro_batches


def check_schedule(pp: int, virtual_chunks: int, micro_batches: int) -> None:
    slots = schedule_slots(pp, virtual_chunks, micro_batches)
    if slots > MAX_SCHEDULE_SLOTS:
        raise ConfigError(
            f"pp {pp} x virtual chunks {virtual_chunks} x {micro_batches:,} micro-batches per replica = {slots:,} "
            f"schedule slots, more than the {MAX_SCHEDULE_SLOTS:,} the simulator replays ({ADVICE}): "
            f"give a smaller --global-batch or a larger --micro-batch"
        )


def zero3_gathers(zero: int, dp: int, micro_batches: int, n_layers: int) -> int:
    """The units a replica gathers in a step under ZeRO-3 (every block, the embeddings, the head, per
    micro-batch); 0 when ZeRO-3 does not run (another stage, or one replica)."""
    return micro_batches * (n_layers + 2) if zero == 3 and dp > 1 else 0


def check_zero3(zero: int, dp: int, micro_batches: int, n_layers: int) -> None:
    gathers = zero3_gathers(zero, dp, micro_batches, n_layers)
    if gathers > MAX_ZERO3_GATHERS:
        raise ConfigError(
            f"ZeRO-3 over {micro_batches:,} micro-batches per replica x ({n_layers:,} layers + 2) = {gathers:,} unit "
            f"gathers per step, more than the {MAX_ZERO3_GATHERS:,} the simulator replays ({ADVICE}): give a smaller "
            f"--global-batch, a larger --micro-batch, or --zero 2"
        )


def check_job(n_layers: int, pp: int, dp: int, virtual_chunks: int, global_batch: int, micro_batch: int,
              n_gpus: int, zero: int = 0, cp: int = 1) -> None:
    """Every limit of one simulated step, from numbers alone (nothing built yet). A global batch that
    does not divide into micro-batches is left to the simulator's own check. `dp` replicas hold whole
    sequences (the micro-batches); ZeRO-3 gathers over the dp x `cp` ranks of a stage."""
    check_gpus(n_gpus, "the layout (tp x cp x pp x dp)" if cp > 1 else "the layout (tp x pp x dp)")
    check_layers(n_layers)
    per_step = micro_batch * dp
    if global_batch % per_step == 0:
        check_schedule(pp, virtual_chunks, global_batch // per_step)
        check_zero3(zero, dp * cp, global_batch // per_step, n_layers)


def check_sweep(counts: list[int]) -> None:
    """A sweep's GPU counts: at most MAX_SWEEP_POINTS of them, each within MAX_GPUS, MAX_SWEEP_GPUS in all."""
    if len(counts) > MAX_SWEEP_POINTS:
        raise ConfigError(f"a sweep of {len(counts)} GPU counts: give at most {MAX_SWEEP_POINTS} ({ADVICE})")
    for n in counts:
        check_gpus(n, "a point of the sweep (--gpus)")
    if sum(counts) > MAX_SWEEP_GPUS:
        raise ConfigError(f"the sweep simulates {sum(counts):,} GPUs over its points, more than {MAX_SWEEP_GPUS:,} "
                          f"({ADVICE}): give fewer or smaller GPU counts")
