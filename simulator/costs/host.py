"""A calibrated CPU host: what `minigpt calibrate` measured of this machine, as the simulator uses it. Torch-free.

On a CPU the roofline of compute.py and the fluid link model of engine/links.py miss
most of the cost: a block is many small kernels with Python between them, gloo moves
bytes with the same cores that compute, and 8 ranks on 2 cores take turns. A profile's
optional "measured" object (parallel/calibrate/host.py writes it) holds what replaces them:

    "measured": {
      "cores": C,                  (on CUDA: the GPUs, one per rank)
      "device": "cpu" | "cuda",
      "units": [{"d_model", "n_heads", "d_ff", "seq_len", "vocab_size", "tp", "sequence_parallel"?, "dtype"?,
                 "kv_heads"?, "mlp"?, "norm"?, "positions"?, "bias"?, "experts"?,
                 "micro_batches": [b, ...],
                 "block_forward": [s, ...], "block_backward": [...],
                 "embedding_forward": [...], "embedding_backward": [...],
                 "head_forward": [...], "head_backward": [...]}, ...],
      "sharing": [[ranks, threads_per_rank, slowdown], ...],
      "variation"?: [[ranks, threads_per_rank, cv], ...],
      "stragglers"?: [[ranks, threads_per_rank, factor], ...],
      "failure_costs"?: {"write": {"alpha", "beta", "points"}, "read": {...}, "start_s", "monitor_s", "note"?},
      "collectives": [{"kind", "group", "active", "alpha", "beta", "points": [[S, s], ...], "cpu_share"?}, ...],
      "reliability"?: {"cpu_share_before", "cpu_share_alone", "cpu_share_after", "cpu_share_threads"?,
                       "spread_block", "spread_units",
                       "spread_matmuls", "threads_ratio"?, "confidence", "reliable", "why", "allowed_busy"?,
                       "note"?}
    }

- units: seconds of one tensor-parallel rank's share of a block, of the embedding and of the
  final norm + head + loss, for one micro-batch of b sequences, measured by one rank alone on
  one thread (the real tensor-parallel modules, their communication left out). Between measured
  b the time is interpolated linearly; beyond the last, extended along the last segment. A unit
  is the shape it was measured on: its sizes and the shape's options (minigpt/config.py:
  key/value heads, MLP kind, norm kind, positions, biases, the q/k/v biases, the query and key norms,
  the head width), so a Llama-style unit never prices a GPT of the same sizes or the reverse. A unit
  written before the options were keys lacks them and was a GPT-2-style block: as many key/value heads
  as heads, GELU, LayerNorm, learned positions, biases, heads d_model / n_heads wide, no query and key
  norms (UNIT_SHAPE_DEFAULTS). A mixture of experts' block is a unit of its own, its "experts"
  ({"n_experts", "top_k", "d_expert" (the width, d_ff when the model leaves it unset), "n_shared_experts",
  "router", "capacity_factor"}) part of its shape: its block series are its MoE blocks' (routing, the experts one
  after another, combine), never a dense block's of the same sizes, nor the reverse; a unit without "experts"
  is dense. A MoE model's dense first blocks (dense_layers) take the dense unit of its sizes where there is one.
  Multi-head latent attention's "latent" ({"kv_lora_rank", "q_lora_rank", "rope_head_dim", "v_head_dim"}) is part
  of the shape too: a unit without it measured ordinary attention (simulator/costs/host_units.py keys both).
  "dtype" is the number format they were measured in
  (calibrate measures fp32; a unit without one was written before units carried it, and was
  fp32). Units are for simulations computing in that format only: `unit_times` with another
  dtype finds none, and the engine then prices the chunk with compute.py's roofline in the
  simulation's own format (the profile's measured per-format peak and efficiency table). Not a
  refusal: on a GPU profile that roofline rests on measured per-format GEMM rates, so a bf16
  simulation (or `minigpt compare` of a bf16 run) with an fp32-calibrated profile stays
  possible, and its result says the units were not used (host "units_measured": false). The
  sharing slowdown and the collectives hold for any format (they time cores and bytes).
  engine/host.py's host_compute passes the format (unit_format: fp32 on a CPU host, where 16-bit
  compute is emulated with fp32 matmuls; the compute format on GPUs); dtype None finds any
  format's units.
- sharing: compute time of a rank when `ranks` ranks with `threads_per_rank` threads each
  compute at once, over that of one rank alone on one thread. Between measured rank
  counts (same threads) it is interpolated linearly; any other pair takes
  the ideal processor-sharing value (each rank gets min(threads, cores / ranks) cores)
  times the measured-to-ideal ratio of the nearest measured load (ranks x threads).
  The factor applies to every compute second of the step (the units, the roofline when
  the model was not measured, and the optimizer). Ranks idle in pipeline bubbles free
  their cores, and ranks blocked in collectives all but the share of a core the collective
  computes (its "cpu_share"): engine.share_idle_cores replays the step with the slowdown of
  the ranks busy on average.
- stragglers: what waiting for the slowest rank costs a synchronous step with `ranks` ranks of `threads_per_rank`
  threads at work: the mean over runs taken in step (parallel/calibrate/host.py) of the slowest rank's time over
  the mean of every rank's, measured (>= 1). The simulator reads a row as the coefficient of variation of
  independent normal ranks giving that factor, cv = (factor - 1) / E[max of `ranks` standard normals]
  (simulator/stragglers.py), looked up as sharing is (linear in ranks between measured counts, else the nearest
  load's): at a measured count the step's factor is the measured one, elsewhere the order statistics carry it.
- variation: the same model's coefficient of variation given directly: profiles written before calibrate took
  its runs in step held the spread of every busy rank's runs pooled here (with more ranks than cores the ranks
  take turns, so that spread overstates the slowest rank). Used when there is no stragglers row; absent from
  both: no variation.
- failure_costs: what a failure costs on this host (parallel/calibrate/storage.py): a checkpoint written and read
  back by every rank at once with torch.distributed.checkpoint, t = alpha + beta * S over the bytes S of all ranks
  (and the measured points); start_s, from launching the ranks to the last one's process group; monitor_s, the
  launcher's interval between checks of its ranks. `minigpt simulate --campaign` prices checkpoints and restarts
  with them when its flags do not (cli/options/campaign.py).
- collectives: seconds of one collective on a buffer of S bytes in a group of `group`
  ranks while `active` ranks run such groups at once (p2p: pairs; all_to_all: S the input each rank hands
  to all_to_all_single, its own part included, split evenly, as expert parallelism's exchanges are counted).
  Between measured sizes interpolated linearly; outside them the fitted line alpha + beta * S.
  "cpu_share" (optional; calibrate measures it on a CPU): the share of one core the calling rank's process
  computed while in the call (its CPU time over the wall time, the median over sizes and busy ranks); what a rank
  waiting in it leaves to the others is the rest.
- reliability: how quiet the machine was while calibrate measured (parallel/calibrate/noise.py: the
  CPU share a measuring thread got, the spread of repeated runs, the threads row's ratio (did the other cores
  compute), whether the profile is reliable and why,
  the confidence of the calibration's own times); absent from profiles written before calibrate kept it.
  The simulator does not use it to price anything; `minigpt compare` reports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from simulator.costs.host_units import UNIT_KEYS, UNIT_SHAPE_DEFAULTS, positive, shape_options, unit_key
from simulator.costs.rates.efficiency import FLOP_FORMATS
from simulator.json_file import BYTES, RELATIVE, SHARE, in_range
from simulator.stragglers import cv_giving

UNIT_SERIES = ("block_forward", "block_backward", "embedding_forward", "embedding_backward",
               "head_forward", "head_backward")
# A block's backward as zero-bubble's schedules split it (parallel/calibrate/device.py's split_runs): its input half
# and its weight half, each a pass of its own (a unit without them, measured before they were: halves of the backward)
SPLIT_SERIES = ("block_backward_input", "block_backward_weight")
UNIT_OPTIONAL = ("sequence_parallel", "cp", "dtype", *UNIT_SHAPE_DEFAULTS, "experts", "latent", *SPLIT_SERIES)
LEGACY_UNIT_DTYPE = "fp32"  # a unit without "dtype" predates the field; calibrate measured it in fp32
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")
# measured["reliability"] (parallel/calibrate/noise.py writes it): CPU shares of a core (0-1), spreads of repeated
# runs ((slowest - fastest) / median, >= 0) and the confidence (a relative bound, >= 0); each may be null
RELIABILITY_NUMBERS = {"cpu_share_before": SHARE, "cpu_share_alone": SHARE, "cpu_share_after": SHARE,
                       "cpu_share_threads": SHARE, "spread_block": RELATIVE, "spread_units": RELATIVE, "spread_matmuls": RELATIVE,
                       "threads_ratio": RELATIVE, "confidence": RELATIVE}
RELIABILITY_FLAGS = ("reliable", "allowed_busy")
RELIABILITY_TEXT = ("why", "note")


def _interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear through (xs, ys); beyond either end, extended along the end segment."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class UnitTimes:
    """Measured seconds of the model's pieces on one tensor-parallel rank, by micro-batch size."""

    key: tuple  # unit_key: the sizes (UNIT_KEYS), then the shape's options, experts and latent attention
    micro_batches: tuple[int, ...]
    series: dict[str, tuple[float, ...]] = field(hash=False)
    sequence_parallel: bool = False
    dtype: str = LEGACY_UNIT_DTYPE  # the number format they were measured in
    cp: int = 1  # context-parallel size: a rank's two chunks of 2 cp, its ring's blocks computed alone

    @property
    def split(self) -> bool:
        """Whether the block's backward was also timed in zero-bubble's two halves (SPLIT_SERIES)."""
        return all(name in self.series for name in SPLIT_SERIES)

    def seconds(self, name: str, micro_batch: int) -> float:
        ys = self.series[name]
        if micro_batch < self.micro_batches[0]:  # below the table: in proportion to the first point
            return ys[0] * micro_batch / self.micro_batches[0]
        return max(_interpolate(self.micro_batches, ys, micro_batch), 0.0)


@dataclass(frozen=True)
class MeasuredCollective:
    kind: str
    group: int
    active: int
    alpha: float
    beta: float
    points: tuple[tuple[int, float], ...] = ()
    cpu_share: float | None = None  # the share of a core the calling rank computed while in it (None: not measured)

    def seconds(self, nbytes: float) -> float:
        pts = self.points
        if len(pts) >= 2 and pts[0][0] <= nbytes <= pts[-1][0]:
            return _interpolate(tuple(p[0] for p in pts), tuple(p[1] for p in pts), nbytes)
        return self.alpha + self.beta * nbytes


@dataclass(frozen=True)
class FailureCosts:
    """What a failure costs on a measured host: checkpoint writes and reads by size, the ranks' start."""

    write: MeasuredCollective  # kind "write": seconds for S bytes written by every rank at once (S: all ranks')
    read: MeasuredCollective
    start_s: float  # from launching the ranks to the last one's process group
    monitor_s: float  # the launcher's interval between checks of its ranks: a failure's detection

    def restart_seconds(self, checkpoint_bytes: float) -> float:
        """From a failure to training again on this host: noticed, the ranks started, `checkpoint_bytes` read back."""
        return self.monitor_s + self.start_s + self.read.seconds(checkpoint_bytes)


@dataclass(frozen=True)
class MeasuredHost:
    cores: int
    units: tuple[UnitTimes, ...] = ()
    sharing: tuple[tuple[int, int, float], ...] = ()
    collectives: tuple[MeasuredCollective, ...] = ()
    device: str = "cpu"  # "cuda": measured on GPUs (NCCL), whose copies do not take the compute's cores
    variation: tuple[tuple[int, int, float], ...] = ()  # (ranks, threads per rank, coefficient of variation)
    stragglers: tuple[tuple[int, int, float], ...] = ()  # (ranks, threads per rank, measured slowest-rank factor)
    failure_costs: "FailureCosts | None" = None  # checkpoint writes and reads, the ranks' start (None: not measured)
    raw: dict = field(default_factory=dict, hash=False, compare=False)  # the profile's object, for writing back
    reliability: dict | None = field(default=None, hash=False, compare=False)  # None: written before calibrate kept it

    def unit_times(self, model: GPTConfig, tp: int, sequence_parallel: bool = False,
                   dtype: str | None = None, cp: int = 1) -> UnitTimes | None:
        """The measured pieces of this model at this tp and cp (with sequence parallelism when measured so,
        else without) in the compute format `dtype`, or None when they were not measured so: never
        another format's or context-parallel size's times (dtype None: any format, for callers that do not
        know theirs)."""
        key = unit_key(model, tp)
        same = [u for u in self.units if u.key == key and u.cp == cp and (dtype is None or u.dtype == dtype)]
        return next((u for u in same if u.sequence_parallel == sequence_parallel), same[0] if same else None)

    def block_units(self, model: GPTConfig, tp: int, sequence_parallel: bool = False, dtype: str | None = None,
                    cp: int = 1) -> tuple[UnitTimes | None, UnitTimes | None]:
        """(the unit of this model's blocks, embedding and head; that of its dense blocks): a MoE model's MoE unit
        and the unit of the same sizes without experts for its dense first blocks (None without dense_layers);
        a dense model's unit twice. unit_times' rules for each."""
        units = self.unit_times(model, tp, sequence_parallel, dtype, cp)
        if not model.is_moe:
            return units, units
        dense = model.with_(n_experts=0, dense_layers=0) if model.dense_layers else None
        return units, None if dense is None else self.unit_times(dense, tp, sequence_parallel, dtype, cp)

    def ideal_slowdown(self, ranks: int, threads: int) -> float:
        return 1.0 / min(threads, self.cores / ranks)

    def slowdown(self, ranks: int, threads: int) -> float:
        """Compute time of each of `ranks` ranks with `threads` threads each, over one rank alone on one thread."""
        for r, t, value in self.sharing:
            if (r, t) == (ranks, threads):
                return value
        rows = sorted((r, value) for r, t, value in self.sharing if t == threads)
        if len(rows) >= 2 and rows[0][0] <= ranks <= rows[-1][0]:  # between measured loads: linear in ranks
            return _interpolate(tuple(r for r, _ in rows), tuple(v for _, v in rows), ranks)
        ideal = self.ideal_slowdown(ranks, threads)
        if not self.sharing:
            return ideal
        r, t, value = min(self.sharing, key=lambda row: (abs(math.log(row[0] * row[1] / (ranks * threads))), -row[0]))
        return ideal * value / self.ideal_slowdown(r, t)

    def variation_cv(self, ranks: int, threads: int) -> float:
        """How much one rank's compute time varies (its coefficient of variation) with `ranks` ranks of `threads`
        threads at work: the measured row, linear between measured rank counts of those threads, else the
        nearest load's; 0 when none was measured."""
        table = self.variation
        if self.stragglers:  # measured factors, as the cv of the stragglers model that gives each
            table = tuple((r, t, cv_giving(factor, r)) for r, t, factor in self.stragglers if r > 1)
        rows = sorted((r, cv) for r, t, cv in table if t == threads)
        for r, cv in rows:
            if r == ranks:
                return cv
        if len(rows) >= 2 and rows[0][0] <= ranks <= rows[-1][0]:
            return _interpolate(tuple(r for r, _ in rows), tuple(cv for _, cv in rows), ranks)
        if not table:
            return 0.0
        return min(table, key=lambda row: (abs(math.log(row[0] * row[1] / (ranks * threads))), -row[0]))[2]

    def collective_seconds(self, kind: str, group: int, active: float, nbytes: float) -> float | None:
        """Seconds of one collective of `nbytes` in a group of `group` with `active` ranks busy: linear
        between the two measured loads around `active`, else at the nearest; None when not measured."""
        same = sorted((c for c in self.collectives if c.kind == kind and c.group == group), key=lambda c: c.active)
        if not same:
            return None
        below = [c for c in same if c.active <= active]
        above = [c for c in same if c.active >= active]
        if below and above and below[-1].active != above[0].active:
            lo, hi = below[-1], above[0]
            return _interpolate((lo.active, hi.active), (lo.seconds(nbytes), hi.seconds(nbytes)), active)
        return self.collective(kind, group, active).seconds(nbytes)

    def collective(self, kind: str, group: int, active: int) -> MeasuredCollective | None:
        """The measured collective of this kind and group size at the nearest load (`active` ranks), or None."""
        same = [c for c in self.collectives if c.kind == kind and c.group == group]
        if not same:
            return None
        return min(same, key=lambda c: (abs(math.log(c.active / active)), -c.active))


# ---------------------------------------------------------------- parsing


def parse_measured_host(data: object, where: str) -> MeasuredHost:
    """Check a "measured" object (the schema above); every problem raises ConfigError naming the field."""
    where = f"{where}.measured"
    if not isinstance(data, dict) or "cores" not in data:
        raise ConfigError(f"{where} must be a JSON object with cores, units, sharing and collectives")
    unknown = sorted(set(data) - {"cores", "device", "units", "sharing", "variation", "stragglers", "collectives",
                                  "note", "reliability", "failure_costs"})
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {', '.join(unknown)}")
    cores = int(positive(data["cores"], f"{where}.cores", integer=True))
    device = data.get("device", "cpu")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"{where}.device must be cpu or cuda, got {device!r}")
    for name in ("units", "sharing", "variation", "stragglers", "collectives"):
        if not isinstance(data.get(name, []), list):
            raise ConfigError(f"{where}.{name} must be a JSON list, got {data[name]!r}")
    units = []
    for i, entry in enumerate(data.get("units", [])):
        at = f"{where}.units[{i}]"
        required = {*UNIT_KEYS, "micro_batches", *UNIT_SERIES}
        if not isinstance(entry, dict) or set(entry) - set(UNIT_OPTIONAL) != required:
            raise ConfigError(f"{at} must hold exactly {', '.join((*UNIT_KEYS, 'micro_batches', *UNIT_SERIES))} "
                              f"(and optionally {', '.join(UNIT_OPTIONAL)})")
        key = tuple(int(positive(entry[k], f"{at}.{k}", integer=True, high=BYTES[1])) for k in UNIT_KEYS)
        key += shape_options(entry, at, key[1], key[0])
        sp = entry.get("sequence_parallel", False)
        if not isinstance(sp, bool):
            raise ConfigError(f"{at}.sequence_parallel must be true or false, got {sp!r}")
        cp = int(positive(entry.get("cp", 1), f"{at}.cp", integer=True, high=2**20))
        dtype = entry.get("dtype", LEGACY_UNIT_DTYPE)
        if dtype not in FLOP_FORMATS:
            raise ConfigError(f"{at}.dtype must be one of {', '.join(FLOP_FORMATS)}, got {dtype!r}")
        sizes = entry["micro_batches"]
        if not isinstance(sizes, list) or not sizes:
            raise ConfigError(f"{at}.micro_batches must be increasing micro-batch sizes")
        sizes = tuple(int(positive(b, f"{at}.micro_batches", integer=True)) for b in sizes)
        if any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise ConfigError(f"{at}.micro_batches must be increasing micro-batch sizes")
        series = {}
        split = [name for name in SPLIT_SERIES if name in entry]
        if split and len(split) < len(SPLIT_SERIES):
            raise ConfigError(f"{at} has {split[0]} without {', '.join(set(SPLIT_SERIES) - set(split))}: both halves "
                              f"of the split backward, or neither")
        for name in (*UNIT_SERIES, *split):
            values = entry[name]
            if not isinstance(values, list) or len(values) != len(sizes):
                raise ConfigError(f"{at}.{name} must hold one time per micro-batch size ({len(sizes)})")
            series[name] = tuple(float(positive(v, f"{at}.{name}")) for v in values)
        units.append(UnitTimes(key, sizes, series, sp, dtype, cp))
    sharing = _load_rows(data.get("sharing", []), f"{where}.sharing", "slowdown", zero=False, high=1e6)
    variation = _load_rows(data.get("variation", []), f"{where}.variation", "coefficient of variation", zero=True,
                           high=10.0)
    stragglers = _load_rows(data.get("stragglers", []), f"{where}.stragglers", "factor", zero=False, high=1e6)
    if any(factor < 1 for _, _, factor in stragglers):
        raise ConfigError(f"{where}.stragglers: a slowest rank's factor is at least 1 (the slowest of a step's ranks "
                          f"over their mean), got {min(f for _, _, f in stragglers):g}")
    collectives = []
    for i, entry in enumerate(data.get("collectives", [])):
        at = f"{where}.collectives[{i}]"
        if not isinstance(entry, dict) or not {"kind", "group", "active", "alpha", "beta"} <= set(entry):
            raise ConfigError(f"{at} must hold kind, group, active, alpha, beta (and points)")
        if entry["kind"] not in KINDS:
            raise ConfigError(f"{at}.kind must be one of {', '.join(KINDS)}, got {entry['kind']!r}")
        points = _points(entry.get("points", []), at)
        share = entry.get("cpu_share")
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 <= share <= 1):
            raise ConfigError(f"{at}.cpu_share must be a share of one core from 0 to 1, got {share!r}")
        collectives.append(MeasuredCollective(
            entry["kind"], int(positive(entry["group"], f"{at}.group", integer=True)),
            int(positive(entry["active"], f"{at}.active", integer=True)),
            float(positive(entry["alpha"], f"{at}.alpha", zero=True)),
            float(positive(entry["beta"], f"{at}.beta", high=1.0)),
            points, None if share is None else float(share)))
    return MeasuredHost(cores, tuple(units), sharing, tuple(collectives), device, variation, stragglers,
                        parse_failure_costs(data.get("failure_costs"), f"{where}.failure_costs"), raw=data,
                        reliability=parse_reliability(data.get("reliability"), f"{where}.reliability"))


def _load_rows(rows: list, at: str, third: str, zero: bool, high: float) -> tuple[tuple[int, int, float], ...]:
    """[[ranks, threads_per_rank, value], ...] (the sharing, variation and stragglers tables); ConfigError naming the row."""
    checked = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 3:
            raise ConfigError(f"{at}[{i}] must be [ranks, threads_per_rank, {third}]")
        checked.append((int(positive(row[0], f"{at}[{i}] ranks", integer=True)),
                        int(positive(row[1], f"{at}[{i}] threads", integer=True)),
                        float(positive(row[2], f"{at}[{i}] {third}", zero=zero, high=high))))
    return tuple(checked)


def _points(points: object, at: str) -> tuple[tuple[int, float], ...]:
    """[[bytes, seconds], ...] sorted by size, each size once; ConfigError naming `at` otherwise."""
    if not isinstance(points, list) or not all(isinstance(p, list) and len(p) == 2 for p in points):
        raise ConfigError(f"{at}.points must be [[bytes, seconds], ...]")
    points = tuple(sorted((int(positive(s, f"{at}.points", integer=True, high=BYTES[1])),
                           float(positive(t, f"{at}.points"))) for s, t in points))
    if any(a[0] == b[0] for a, b in zip(points, points[1:])):
        raise ConfigError(f"{at}.points must measure each size once")
    return points


def parse_failure_costs(data: object, where: str) -> FailureCosts | None:
    """The "failure_costs" object (the schema above), or None when absent."""
    if data is None:
        return None
    if not isinstance(data, dict) or set(data) - {"note"} != {"write", "read", "start_s", "monitor_s"}:
        raise ConfigError(f"{where} must hold exactly write, read, start_s and monitor_s (and optionally note)")
    fits = []
    for kind in ("write", "read"):
        entry, at = data[kind], f"{where}.{kind}"
        if not isinstance(entry, dict) or set(entry) != {"alpha", "beta", "points"}:
            raise ConfigError(f"{at} must hold exactly alpha, beta and points")
        fits.append(MeasuredCollective(kind, 1, 1, float(positive(entry["alpha"], f"{at}.alpha", zero=True)),
                                       float(positive(entry["beta"], f"{at}.beta", high=1.0)),
                                       _points(entry["points"], at)))
    return FailureCosts(*fits, float(positive(data["start_s"], f"{where}.start_s", zero=True)),
                        float(positive(data["monitor_s"], f"{where}.monitor_s", zero=True)))


def parse_reliability(data: object, where: str) -> dict | None:
    """The "reliability" object (RELIABILITY_NUMBERS, RELIABILITY_FLAGS, RELIABILITY_TEXT), or None when absent."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object of the calibration's measured noise")
    unknown = sorted(set(data) - {*RELIABILITY_NUMBERS, *RELIABILITY_FLAGS, *RELIABILITY_TEXT})
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {', '.join(unknown)}")
    for name, bounds in RELIABILITY_NUMBERS.items():
        value = data.get(name)
        if value is not None and not in_range(value, bounds):
            raise ConfigError(f"{where}.{name} must be null or a number from {bounds[0]:g} to {bounds[1]:g}, "
                              f"got {value!r}")
    for name in RELIABILITY_FLAGS:
        if not isinstance(data.get(name, False), bool):
            raise ConfigError(f"{where}.{name} must be true or false, got {data[name]!r}")
    for name in RELIABILITY_TEXT:
        if not isinstance(data.get(name, ""), str):
            raise ConfigError(f"{where}.{name} must be text, got {data[name]!r}")
    if "reliable" not in data:
        raise ConfigError(f"{where} must say whether the profile is reliable (\"reliable\": true or false)")
    return data
