"""Transformer Engine's userbuffers: how each tensor-parallel Linear overlaps its collective. Torch-free.

Under sequence parallelism with tensor-parallel overlap (the "megatron-core" stack), Transformer Engine hides the
all-gather before qkv and fc1 and the reduce-scatter after proj and fc2, and their mirrors in the backward, behind
the Linears' GEMMs. Ten overlaps, each named as TE names it, each with a method:

  ring_exchange  the GEMM runs in tp chunks of the rows (tp / 2 when `aggregate`), each as its slice arrives
                 from the neighbour (or, for a reduce-scatter, is sent on); copies on the copy engines;
  pipeline       a reduce-scatter: the GEMM runs in `num_splits` chunks, each chunk's reduce-scatter on
                 `num_sm` SMs while the next chunk computes;
  bulk           a whole GEMM beside a separate collective on `num_sm` SMs (the backward's all-gather of the
                 input and reduce-scatter of the input gradient).

`set_sm_margin` launches the GEMM on the GPU's SMs less `num_sm` for its whole run, leaving those to the
collective (TE's CommOverlapCore: `_math_sms = set_sm_margin ? sm_count - num_comm_sm : sm_count`,
transformer_engine/common/comm_gemm_overlap/comm_gemm_overlap.cpp); without it the collective's kernel takes its
SMs from the GEMM while it runs. The simulator prices the first as a GEMM on fewer SMs (simulator/costs/
gemm_model.py's waves over `sms - margin`) and the second as the overlap's tp slowdown
(simulator/engine/overlap.py): the mean over the ten overlaps of the SMs such a collective holds, those with a
margin counted 0 (their cost is the margin), over the GPU's SMs (`slowdown`).

A configuration is the file Megatron-LM's --tp-comm-overlap-cfg reads and NeMo's ub_tp_comm_overlap_cfg holds: YAML
(.yaml, .yml, as Megatron reads it) or the same as JSON:
{"proj_fprop": {"method": "pipeline", "num_sm": 24, "set_sm_margin": 1, "num_splits": 4}, ...}.
An overlap or a key left out takes TE's default (get_default_config in transformer_engine/pytorch/module/base.py
since TE 2.1, commit 544dd14b4: ring_exchange 1 SM, no margin; pipeline and bulk 16 SMs with the margin,
pipeline in 4 splits; the methods below). Without a file the simulator keeps TE 1.x's behaviour (its defaults
at commit 0004dbd0, the NeMo 2024 stacks'): the same methods and splits, no margin (`TE_1X`), and the overlap
preset's tp slowdown.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass

from minigpt.errors import ConfigError
from simulator.json_file import decode_utf8, read_bytes, read_json_file

AG, RS, BULK = ("ring_exchange",), ("pipeline", "ring_exchange"), ("bulk",)
# TE's name of each overlap: the GEMM of simulator/costs/ops.py it runs beside, the methods TE allows for it
# (all-gathers by ring exchange, reduce-scatters pipelined or by ring exchange, the backward's side collectives bulk)
# and its default method (the first).
OVERLAPS = {
    "qkv_fprop": ("qkv", AG), "fc1_fprop": ("fc1", AG), "proj_dgrad": ("proj.input_grad", AG),
    "fc2_dgrad": ("fc2.input_grad", AG), "proj_fprop": ("proj", RS), "fc2_fprop": ("fc2", RS),
    "qkv_dgrad": ("qkv.input_grad", BULK), "qkv_wgrad": ("qkv.weight_grad", BULK),
    "fc1_dgrad": ("fc1.input_grad", BULK), "fc1_wgrad": ("fc1.weight_grad", BULK),
}
POSITION = {gemm: index for index, (gemm, _) in enumerate(OVERLAPS.values())}  # a Userbuffers' overlaps keep this order
UB_MAX_SM = 32  # TE's limit on a userbuffers collective's SMs (UB_MAX_SM in comm_gemm_overlap.h)
UB_PIPELINE_SPLITS = 4  # TE's default num_splits for its "pipeline" overlap (initialize_ub)
UB_DEFAULT_SMS = 16  # TE's default num_sm for a pipelined or bulk overlap (both TE 1.x and 2.1)
PRICED = {"method", "num_sm", "set_sm_margin", "num_splits", "aggregate"}
# keys of TE's configuration that change no cost here: cluster shape, buffer format, stream priorities, copy engine
UNPRICED = {"cga_size", "fp8_buf", "use_ce", "comm_priority", "gemm_priority", "pipeline_rs_overlap_first_gemm",
            "atomic_gemm", "is_reduce_scatter"}


@dataclass(frozen=True)
class Overlapped:
    """One overlap's settings, as TE reads them."""

    method: str
    num_sm: int
    set_sm_margin: bool
    num_splits: int = UB_PIPELINE_SPLITS  # pipeline only (a ring exchange runs in tp chunks)
    aggregate: bool = False  # ring exchange only: two slices per GEMM

    def chunks(self, tp: int) -> int:
        if self.method == "ring_exchange":
            return max(1, tp // 2) if self.aggregate else tp
        return self.num_splits if self.method == "pipeline" else 1

    @property
    def margin(self) -> int:
        return self.num_sm if self.set_sm_margin else 0


def te_default(method: str) -> Overlapped:
    """TE 2.1's defaults for an overlap run by `method`: a ring exchange on 1 SM without a margin, the others on 16
    with one."""
    ring = method == "ring_exchange"
    return Overlapped(method, 1 if ring else UB_DEFAULT_SMS, not ring)


@dataclass(frozen=True)
class Userbuffers:
    """The ten overlaps' settings and where they come from."""

    overlaps: tuple[tuple[str, Overlapped], ...]  # the ten, in OVERLAPS' order
    origin: str = ""

    def of_gemm(self, gemm: str) -> Overlapped | None:
        position = POSITION.get(gemm)
        return self.overlaps[position][1] if position is not None else None

    def chunks(self, gemm: str, tp: int) -> int:
        """GEMMs the Linear GEMM `gemm` (an op name of simulator/costs/ops.py) runs as."""
        overlap = self.of_gemm(gemm)
        return overlap.chunks(tp) if overlap is not None else 1

    def margin(self, gemm: str) -> int:
        """SMs the GEMM leaves to its collective for its whole run (0: all of the GPU's)."""
        overlap = self.of_gemm(gemm)
        return overlap.margin if overlap is not None else 0

    def competing_sms(self) -> float:
        """SMs a collective takes from the GEMM it overlaps, on average over the ten (equal bytes each): num_sm of
        those without a margin, 0 for those with one."""
        return sum(0 if o.set_sm_margin else o.num_sm for _, o in self.overlaps) / len(self.overlaps)

    def slowdown(self, sms: int) -> float:
        """The overlap's tp slowdown on a GPU of `sms` SMs (simulator/engine/overlap.py)."""
        return self.competing_sms() / sms

    def margins(self) -> dict[str, int]:
        return {name: o.margin for name, o in self.overlaps if o.margin}

    def describe(self) -> str:
        """One line: where it comes from, the GEMMs on fewer SMs."""
        kept = ", ".join(f"{name} leaves {sms} SMs" for name, sms in self.margins().items()) or "no SM margins"
        return f"userbuffers {self.origin or 'configuration'}: {kept}"


TE_1X = Userbuffers(tuple((name, Overlapped(methods[0], UB_DEFAULT_SMS, False))
                          for name, (_, methods) in OVERLAPS.items()), "TE 1.x defaults (commit 0004dbd0)")


def _flag(value: object, where: str) -> bool:
    if value in (0, 1) and not isinstance(value, float):
        return bool(value)
    raise ConfigError(f"{where} must be true or false (or 0 / 1), got {reprlib.repr(value)}")


def _count(value: object, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{where} must be a whole number from {low} to {high}, got {reprlib.repr(value)}")
    return value


def _overlapped(name: str, entry: object, where: str) -> Overlapped:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a JSON object of TE's settings (method, num_sm, set_sm_margin, ...)")
    unknown = sorted(set(entry) - PRICED - UNPRICED)
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {', '.join(unknown)}: use {', '.join(sorted(PRICED | UNPRICED))}")
    if entry.get("atomic_gemm") not in (None, False, 0):
        raise ConfigError(f"{where}: atomic GEMMs are not modelled; drop atomic_gemm")
    allowed = OVERLAPS[name][1]
    method = entry.get("method", allowed[0])
    if method not in allowed:
        raise ConfigError(f"{where}.method must be {' or '.join(allowed)} (what TE runs for {name}), "
                          f"got {reprlib.repr(method)}")
    default = te_default(method)
    return Overlapped(method, _count(entry.get("num_sm", default.num_sm), f"{where}.num_sm", 0, UB_MAX_SM),
                      _flag(entry.get("set_sm_margin", default.set_sm_margin), f"{where}.set_sm_margin"),
                      _count(entry.get("num_splits", default.num_splits), f"{where}.num_splits", 1, 64),
                      _flag(entry.get("aggregate", False), f"{where}.aggregate"))


def parse_userbuffers(data: object, origin: str) -> Userbuffers:
    """Check a configuration (the module docstring); every problem raises ConfigError naming the file and key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin} must hold a JSON object: overlap names ({', '.join(OVERLAPS)}) to their settings")
    unknown = sorted(set(data) - set(OVERLAPS) - {"source"})
    if unknown:
        raise ConfigError(f"{origin} has unknown overlap(s) {', '.join(unknown)}: use {', '.join(OVERLAPS)}")
    if not isinstance(data.get("source", ""), str):
        raise ConfigError(f"{origin}: source must be text naming where the settings come from")
    overlaps = tuple((name, _overlapped(name, data[name], f"{origin}: {name}") if name in data
                      else te_default(methods[0])) for name, (_, methods) in OVERLAPS.items())
    return Userbuffers(overlaps, origin)


WHAT = "the tp overlap configuration"


def read_userbuffers(path: str) -> Userbuffers:
    """A JSON file, or YAML (.yaml, .yml: the file Megatron-LM's --tp-comm-overlap-cfg reads, as it is)."""
    if str(path).lower().endswith((".yaml", ".yml")):
        return parse_userbuffers(_yaml(decode_utf8(read_bytes(path, WHAT), path, WHAT), str(path)), str(path))
    return parse_userbuffers(read_json_file(path, WHAT), str(path))


def _yaml(text: str, origin: str) -> object:
    """YAML's safe subset (no objects built from tags); parse_userbuffers reads known keys and scalars only, so a
    document's aliases and nesting are never walked."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"{WHAT} {origin!r} is not valid YAML{line}: fix the file") from None
    except (RecursionError, ValueError):
        raise ConfigError(f"{WHAT} {origin!r} is not valid YAML (nested too deeply, or a value out of range)") from None
