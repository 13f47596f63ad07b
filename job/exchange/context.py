"""What context parallelism exchanges inside each compute action of the schedule. Torch-free.

With cp > 1 every Forward and Backward action of job/schedule.py also moves keys and values between the
cp ranks, once per attention layer of its chunk: the calls below, issued by parallel/context/ring.py and
allgather.py when the trainer runs the action and priced by the simulator when it replays it. A test counts
the bytes real training sends and finds them equal to these.

Per layer and micro-batch, with kv = one rank's keys (or values): micro-batch x kv heads / tp x seq / cp x
head_dim elements:
- ring forward: cp - 1 passes, each sending k and v to the next rank (asynchronous p2p, overlapped with the
  block at hand);
- ring backward: cp - 1 passes of k and v sent ahead, and cp passes of their gradients dk and dv (fp32
  accumulators, as parallel/context/ring.py keeps them) following their chunks home;
- all-gather forward: two all-gathers (k and v), each rank giving its kv; backward: two reduce-scatters
  of the gathered gradients (in k's format) back to the ranks that hold them;
- selective recomputation runs the attention core, and so its forward exchange, again in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.config import GPTConfig

GRAD_BYTES = 4  # the ring's dk/dv accumulators are fp32 whatever the compute format


@dataclass(frozen=True)
class Exchange:
    """`calls` collective calls (or p2p passes) of one kind, each moving `bytes` from one rank."""

    kind: str  # "p2p", "all_gather" or "reduce_scatter"
    calls: int
    bytes: int  # per call and rank: p2p what it sends, all_gather its part, reduce_scatter the part it keeps

    @property
    def total(self) -> int:
        return self.calls * self.bytes


def kv_elements(model: GPTConfig, tp: int, cp: int, micro_batch: int) -> int:
    """One rank's keys (or values) of one layer and micro-batch: each head as wide as a query head (under MLA the
    values zero-padded to it before the exchange, minigpt/model.py's AttentionCore)."""
    return micro_batch * (model.kv_heads // tp) * (model.seq_len // cp) * model.qk_head_dim


def forward_exchanges(model: GPTConfig, tp: int, cp: int, kind: str, micro_batch: int,
                      element_bytes: int) -> list[Exchange]:
    """One attention layer's forward exchange on one rank (empty without context parallelism)."""
    if cp == 1:
        return []
    kv = kv_elements(model, tp, cp, micro_batch) * element_bytes
    if kind == "ring":
        return [Exchange("p2p", cp - 1, 2 * kv)]
    return [Exchange("all_gather", 2, kv)]


def backward_exchanges(model: GPTConfig, tp: int, cp: int, kind: str, micro_batch: int, element_bytes: int,
                       recompute: str = "none") -> list[Exchange]:
    """One attention layer's backward exchange on one rank, the recomputed forward's included."""
    if cp == 1:
        return []
    again = forward_exchanges(model, tp, cp, kind, micro_batch, element_bytes) if recompute != "none" else []
    elements = kv_elements(model, tp, cp, micro_batch)
    if kind == "ring":
        return again + [Exchange("p2p", cp - 1, 2 * elements * element_bytes),
                        Exchange("p2p", cp, 2 * elements * GRAD_BYTES)]
    return again + [Exchange("reduce_scatter", 2, elements * element_bytes)]

