"""What a fused causal attention kernel reaches, by sequence length and head size: published tables. Torch-free.

A causal kernel computes the key blocks at or below each query block's diagonal and skips the rest: about
half the s x s square, plus the diagonal tiles, which it computes whole and masks (FlashAttention-2, Dao 2023,
section 3.1.1). How fast it runs that work depends on the sequence and the head size far more than a GEMM of
the same shapes: short sequences leave SMs idle and the diagonal tiles cost more than their share. So a GPU
entry of a hardware file may carry the kernel's measured throughput:

    "attention_efficiency": {"kernel": "FlashAttention-2",
                             "source": "...",                   where the table comes from
                             "causal": {"64": [[512, 0.282], ...], "128": [[512, 0.317], ...]}}

Each point is [sequence length, forward + backward throughput / the GPU's dense 16-bit peak], for a head size,
with the FLOPs counted as the kernel's own benchmark counts them (flash-attention's
benchmarks/benchmark_flash_attention.py: forward 4 b s^2 a d, halved with the causal mask; backward 2.5x the
forward, its recomputed scores included; fwd + bwd 3.5x). `seconds` prices a FusedAttention op
(simulator/costs/op_types.py) with it: the op's FLOPs in that convention over the interpolated share of the
peak of the op's format. The tables were measured in 16-bit formats; another format (TF32, fp32) is taken at
the same share of its own peak, as the cited GEMM tables reach about the same share in TF32 and BF16 (H100:
0.41 and 0.41 at 256, 0.57 and 0.63 at 512: docs/efficiency.md). A GPU without a table prices the unmasked
share of the square at the GEMMs' efficiency (simulator/costs/compute.py). docs/efficiency.md gives every
table's values and source.

Between the measured sequence lengths the fraction is read as the GEMM tables are (efficiency.along_log:
linear in log(s)), and between head sizes linearly in the head size; outside either range it is held at the nearest measured value (the
published throughput flattens from 8K to 16K tokens: 182 and 189 TFLOP/s on A100 at head size 128).
"""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.errors import ConfigError
from simulator.costs.rates.efficiency import along_log
from simulator.json_file import FRACTION, in_range



@dataclass(frozen=True)
class AttentionEfficiency:
    kernel: str
    source: str
    causal: tuple[tuple[int, tuple[tuple[int, float], ...]], ...]  # (head size, ((sequence, fraction), ...))

    def fraction(self, head_dim: int, seq: int) -> float:
        """The forward + backward throughput over the 16-bit peak at this head size and sequence length."""
        sizes = [size for size, _ in self.causal]
        by_size = [along_log(points, seq) for _, points in self.causal]
        if head_dim <= sizes[0]:
            return by_size[0]
        if head_dim >= sizes[-1]:
            return by_size[-1]
        i = next(i for i, size in enumerate(sizes) if size >= head_dim)
        share = (head_dim - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return by_size[i - 1] + share * (by_size[i] - by_size[i - 1])

    def as_dict(self) -> dict:
        return {"kernel": self.kernel, "source": self.source,
                "causal": {str(size): [list(p) for p in points] for size, points in self.causal}}


ATTENTION_FIELDS = ("attention_efficiency", "attention_cudnn")  # a GPU entry's tables: FlashAttention-2's, cuDNN's


def kernel_table(gpu, kernel: str) -> AttentionEfficiency | None:
    """`gpu`'s published table of a fused attention kernel (Implementation.attention_kernel): FlashAttention-2's, or
    None (the GEMMs price it); cuDNN's, which only its table can price: one line where the GPU has none; "te"
    (Transformer Engine's choice): cuDNN's where the GPU has its table, else FlashAttention-2's (te_kernel)."""
    if kernel == "te":
        kernel = te_kernel(gpu)
    if kernel != "cudnn":
        return gpu.attention_efficiency
    if gpu.attention_cudnn is None:
        raise ConfigError(f"--attention-kernel {kernel} is priced from the kernel's published table, which {gpu.name} "
                          f"has none of: use --attention-kernel flash-attn-2")
    return gpu.attention_cudnn


def te_kernel(gpu) -> str:
    """The kernel Transformer Engine's DotProductAttention runs on `gpu`: cuDNN's FusedAttention on Hopper and later
    ("Disabling FlashAttention to give FusedAttention preference on Hopper+", get_attention_backend, since TE commit
    32db39288, 2023-12), flash-attn before. The Hopper presets and the B200 carry cuDNN's table (attention_cudnn),
    so: cudnn where the GPU has it; flash-attn-2 elsewhere (the A100s, as TE)."""
    return "cudnn" if gpu.attention_cudnn is not None else "flash-attn-2"


def parse_attention_efficiency(data: object, where: str, field: str = "attention_efficiency") -> AttentionEfficiency | None:
    """The `field` object of a GPU entry ("attention_efficiency", or "attention_cudnn"), checked; None when absent."""
    if data is None:
        return None
    if not isinstance(data, dict) or set(data) != {"kernel", "source", "causal"}:
        raise ConfigError(f"{where}.{field} must be an object of kernel, source and causal")
    for key in ("kernel", "source"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise ConfigError(f"{where}.{field}.{key} must be non-empty text")
    table = data["causal"]
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"{where}.{field}.causal must map head sizes to [[sequence, fraction], ...]")
    causal = []
    for size, points in table.items():
        at = f"{where}.{field}.causal[{size!r}]"
        if not size.isdigit() or int(size) < 1:
            raise ConfigError(f"{at}: a head size must be a positive integer")
        if (not isinstance(points, list) or not points
                or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and p[0] > 0
                           and in_range(p[1], FRACTION) for p in points)):
            raise ConfigError(f"{at} must be [[sequence, fraction in (0, 1]], ...]")
        if [p[0] for p in points] != sorted({p[0] for p in points}):
            raise ConfigError(f"{at}: sequence lengths must increase")
        causal.append((int(size), tuple((p[0], float(p[1])) for p in points)))
    return AttentionEfficiency(data["kernel"], data["source"], tuple(sorted(causal)))


def seconds(table: AttentionEfficiency, benchmark_flops: float, head_dim: int, seq: int, peak: float) -> float:
    """Seconds of a causal attention pass of `benchmark_flops` (the kernel benchmark's count, forward or
    backward) at the table's share, for this head size and sequence, of `peak` (the GPU's in the op's format)."""
    return benchmark_flops / (peak * table.fraction(head_dim, seq))
