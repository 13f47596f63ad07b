"""What hides what in a simulated step: explicit overlap settings, with named presets. Torch-free.

`Overlap` holds every choice the engine makes about overlapping communication with compute
(simulator/engine/costs.py applies them, simulator/engine/replay.py the pipeline's):

  tp              False: the tensor-parallel collectives sit between the layer's matmuls and
                  are exposed (our executor; Megatron 2021). True: each pass hides its
                  collectives behind the Linears' GEMMs of the same pass as far as their time
                  allows (Megatron-core / Transformer Engine pipelining the all-gather and
                  reduce-scatter with the GEMMs next to them): exposed = max(0, collectives -
                  Linear GEMMs), per block and pass. The attention core and the element-wise
                  kernels hide nothing; the GEMMs are assumed not slowed by the communication.
  dp              "executor": our ZeRO code (parallel/data/zero.py, zero3.py), as the schedule lists
                  it: ZeRO 0/1 reduce each bucket as soon as its gradients are ready, in each
                  chunk's last backward, except
                  the bucket of a tied embedding split over stages, reduced after the two
                  copies are summed at the end; ZeRO 2/3 reduce in every backward and wait at
                  its end.
                  "backward": the same, and the tied matrix's bucket too is reduced during the
                  backward (its gradient synced apart, as Megatron does).
                  "after": nothing overlapped: ZeRO 0/1 reduce every bucket after the last
                  backward, before the optimizer; ZeRO 2/3 start each backward's reductions when
                  its compute ends.
  zero3_prefetch  ZeRO-3 units all-gathered ahead of the one computing (our code: 1; 0: a unit's
                  gather is issued only when the unit before it is done).
  p2p             False: a pipeline send and its receive meet and both ranks wait for the
                  transfer (our executor's batched isend/irecv and wait; Megatron 2021). True:
                  sends are asynchronous and receives posted early: the sender goes on at once,
                  the receiver waits only for data that has not arrived yet.

Presets (`overlap_preset`):
  "executor"       the default: what parallel/ does (`minigpt compare` measures it).
  "megatron-2021"  Narayanan et al. 2021 (Megatron-LM on Selene): tp exposed, the data-parallel
                   reduction after the last backward (not overlapped), p2p exposed.
  "overlapped"     a modern stack: tp hidden behind the Linears, dp reduced during the backward,
                   ZeRO-3 prefetch 1, p2p overlapped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from minigpt.errors import ConfigError

DP_MODES = ("executor", "backward", "after")


@dataclass(frozen=True)
class Overlap:
    name: str = "executor"
    tp: bool = False
    dp: str = "executor"
    zero3_prefetch: int = 1
    p2p: bool = False

    def __post_init__(self) -> None:
        for flag in ("tp", "p2p"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"overlap {flag} must be true or false, got {getattr(self, flag)!r}")
        if self.dp not in DP_MODES:
            raise ConfigError(f"overlap dp must be one of {', '.join(DP_MODES)}, got {self.dp!r}")
        prefetch = self.zero3_prefetch
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"the ZeRO-3 prefetch depth must be a whole number of units >= 0, got {prefetch!r}")

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    "executor": Overlap(),
    "megatron-2021": Overlap("megatron-2021", tp=False, dp="after", zero3_prefetch=1, p2p=False),
    "overlapped": Overlap("overlapped", tp=True, dp="backward", zero3_prefetch=1, p2p=True),
}


def overlap_preset(name: str) -> Overlap:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown overlap preset {name!r}: choose one of {', '.join(PRESETS)}") from None


def resolve_overlap(overlap: Overlap | str | None = None, **changes) -> Overlap:
    """A preset (by name, default "executor") with any settings changed; changed settings rename it "<preset>+custom"."""
    base = overlap if isinstance(overlap, Overlap) else overlap_preset(overlap or "executor")
    changes = {key: value for key, value in changes.items() if value is not None}
    unknown = sorted(set(changes) - {"tp", "dp", "zero3_prefetch", "p2p"})
    if unknown:
        raise ConfigError(f"unknown overlap setting(s) {', '.join(unknown)}: use tp, dp, zero3_prefetch, p2p")
    if not changes or all(getattr(base, key) == value for key, value in changes.items()):
        return base
    return replace(base, name=f"{base.name}+custom", **changes)
