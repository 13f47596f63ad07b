"""A precision policy: the number format of every role in mixed-precision training.

This is the seed's "each precision has its job" list as data. Torch-free, so the
simulator can size memory from it.

Roles, per parameter:
  compute   the weights the model multiplies with (forward and backward)
  grad      the gradients autograd writes (the compute format)
  reduce    the format gradients travel in between data-parallel ranks
  master    the optimizer's copy that receives the updates (None: the compute
            weights themselves are the masters, as in plain fp32 training)
  adam_m, adam_v   AdamW's first and second moments
"""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.errors import ConfigError

# Bytes per element of each format (precision/formats.py derives the same from torch; a test checks).
FORMAT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# The matmul formats a GPU's peak and efficiency tables are given in (datasheets, calibrated profiles).
FLOP_FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8")
# the block Linears the fp8 policy runs in fp8 (precision/compute.py); MLA's down and up projections among them
FP8_LINEARS = ("qkv", "proj", "fc1", "fc2", "down", "q_up", "kv_up")
FP8_BYTES = FORMAT_BYTES["fp8_e4m3"]  # a weight kept in fp8 (fp8 parameters)


def weight_bytes(elements: int, fp8_elements: int, element_bytes: int) -> int:
    """Bytes of `elements` weights of which `fp8_elements` are kept in fp8 and the rest in `element_bytes` each."""
    return (elements - fp8_elements) * element_bytes + fp8_elements * FP8_BYTES

ROLES = ("compute", "grad", "master", "adam_m", "adam_v")

# The textbook accounting of mixed-precision Adam (Rajbhandari et al., ZeRO, section 3.1):
# 2 (fp16 weights) + 2 (fp16 grads) + 4 (fp32 master) + 4 (m) + 4 (v) bytes per parameter.
TEXTBOOK_MIXED_ADAM = {"compute": 2, "grad": 2, "master": 4, "adam_m": 4, "adam_v": 4}


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    compute: str
    grad: str
    reduce: str
    master: str | None  # None: no separate master copy, the compute weights are updated
    optimizer_state: str = "fp32"
    loss_scaling: bool = False
    fp8_linears: bool = False  # block Linears multiply in fp8 (e4m3 forward, e5m2 gradients)

    def bytes_per_param(self) -> dict[str, int]:
        """Bytes per parameter of each role (0 where a role has no tensor of its own)."""
        return {
            "compute": FORMAT_BYTES[self.compute],
            "grad": FORMAT_BYTES[self.grad],
            "master": FORMAT_BYTES[self.master] if self.master else 0,
            "adam_m": FORMAT_BYTES[self.optimizer_state],
            "adam_v": FORMAT_BYTES[self.optimizer_state],
        }

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "compute": self.compute,
            "grad": self.grad,
            "reduce": self.reduce,
            "master": self.master or f"{self.compute} (the compute weights)",
            "optimizer_state": self.optimizer_state,
            "loss_scaling": self.loss_scaling,
            "fp8_linears": self.fp8_linears,
        }


POLICIES: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy("fp32", compute="fp32", grad="fp32", reduce="fp32", master=None),
    "bf16": PrecisionPolicy("bf16", compute="bf16", grad="bf16", reduce="bf16", master="fp32"),
    "fp16": PrecisionPolicy("fp16", compute="fp16", grad="fp16", reduce="fp16", master="fp32", loss_scaling=True),
    "fp8": PrecisionPolicy("fp8", compute="bf16", grad="bf16", reduce="bf16", master="fp32", fp8_linears=True),
}


def policy(name: str) -> PrecisionPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown precision {name!r}: choose one of {', '.join(POLICIES)}") from None
