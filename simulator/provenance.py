"""What a prediction's numbers rest on, said with every result. Torch-free.

`provenance(...)` names, for one simulated step:
  compute            the op-level roofline (simulator/costs/ops.py priced by simulator/costs/compute.py), or a
                     calibrated host's measured units (simulator/engine/host.py), with what the host did not
                     measure of this model where it has units of other shapes only;
  matmul_efficiency  per number format the GEMMs run in: "GEMM model" (a preset's model by (m, n, k) with
                     wave quantisation, fitted to published sweeps: simulator/costs/rates/gemm_model.py),
                     "cited table" (a preset's published microbenchmarks), "measured table" (a `minigpt
                     calibrate` profile) or "fallback curve" (no table: the uncalibrated x/(x+128) curve),
                     with its source, and "mamf" where the model is capped at a measured maximum
                     (simulator/costs/rates/gemm_model.py);
  kernel_overhead_s  what every kernel costs beyond its roofline;
  achieved           the HBM and NVLink fractions and the per-kernel overhead, with their source
                     (simulator/costs/rates/achieved.py; the datasheet itself when the GPU gives none);
  implementation     attention kernel, recompute kind, what sequence parallelism saves;
  attention          what prices the attention: a fused kernel's published table (FlashAttention-2's or
                     cuDNN's, Implementation.attention_kernel) with its source, or the GEMMs;
  overlap            the overlap preset and its settings (simulator/engine/overlap.py);
  context            with context parallelism: its size and kind, the block length the attention
                     kernel's table is read at, and how the exchange overlaps (simulator/engine/context.py);
  experts            with a mixture of experts: what its experts' GEMMs, routing and all-to-alls rest on
                     (docs/efficiency.md, "Mixture of experts").
"""

from __future__ import annotations

from simulator.costs.compute import FALLBACK_CURVE, EfficiencyProfile, kernel_overhead
from simulator.costs.hardware import GPUSpec
from simulator.costs.op_types import cp_merge
from simulator.costs.rates.attention_rates import kernel_table

ROOFLINE = "op-level roofline (simulator/costs/ops.py, simulator/costs/compute.py)"
MEASURED_UNITS = "measured units of a calibrated host (simulator/costs/host.py)"


def efficiency_sources(gpu: GPUSpec, formats, profile: EfficiencyProfile | None = None) -> dict[str, dict]:
    """For each format: {"kind": GEMM model | cited table | measured table | fallback curve, "source": ...}."""
    sources = {}
    for fmt in dict.fromkeys(formats):
        if profile is not None and profile.gemm is not None and profile.gemm.fit(fmt) is not None:
            mamf = profile.gemm.fit(fmt).mamf  # the measured maximum no shape passes (1: none)
            sources[fmt] = {"kind": "GEMM model", "source": profile.gemm.source or profile.source or gpu.source,
                            **({"mamf": mamf} if mamf < 1 else {})}
        elif profile is not None and profile.points.get(fmt):
            measured = gpu.calibration is not None or gpu.measured is not None
            sources[fmt] = {"kind": "measured table" if measured else "cited table",
                            "source": profile.source or gpu.source}
        else:
            sources[fmt] = {"kind": "fallback curve", "source": FALLBACK_CURVE}
    return sources


def attention_source(gpu: GPUSpec, implementation) -> str:
    """What prices the attention: a fused kernel's published table (its kernel and source), or the GEMMs."""
    if implementation.attention != "flash":
        return "unfused: its matmuls at the GEMM efficiency, softmax and dropout as memory-bound kernels"
    table = kernel_table(gpu, implementation.attention_kernel)
    return (f"{table.kernel} table ({table.source})" if table is not None
            else "no attention table: the unmasked share of the scores at the GEMM efficiency")


def context(gpu: GPUSpec, layout, seq_len: int, kernel: str = "flash-attn-2", merge: str = "fused") -> dict:
    """What a context-parallel prediction rests on beyond the rest (`merge`: Implementation.cp_attention)."""
    block = seq_len // (2 * layout.cp)
    chosen = kernel_table(gpu, kernel)
    table = (f"{chosen.kernel} table read at the {block:,}-token chunk each block spans"
             if chosen is not None else "no attention table: the GEMM efficiency")
    exchange = ("passes hidden behind each block, the backward's dk/dv sent on behind the next block, the last "
                "hop home exposed (parallel/context/ring.py)" if layout.cp_kind == "ring"
                else "all-gathers and reduce-scatters over the cp group, not overlapped")
    merged = "inside the fused kernel's online softmax"
    merge = cp_merge(layout, merge)
    if merge == "te":
        merged = ("by Transformer Engine's ring: an attention call a step, outputs and gradients merged in the "
                  "compute format by compiled kernels (simulator/costs/te_context.py)")
        exchange = ("Transformer Engine's: passes hidden behind each block, dk and dv sent on in the compute format "
                    "with the next block's keys, the last hop exposed")
    elif merge == "torch":
        merged = ("by torch's context_parallel: an attention call a step, in eager fp32 kernels "
                  "(simulator/costs/torchtitan/context.py)")
        exchange = ("torch's: k and v of every query head all-gathered once a pass behind the first step, dk and dv "
                    "sent on in fp32 each step behind the next, the last pass exposed")
    return {"cp": layout.cp, "kind": layout.cp_kind, "attention": table, "merge": merged, "exchange": exchange}


def experts(layout, load: float = 1.0, measured: bool = False, dispatcher: str = "alltoall",
            gemms: str = "grouped") -> dict:
    """What a mixture of experts' prediction rests on beyond the rest (assumptions stated in docs/efficiency.md);
    `load`: the routing imbalance priced (Implementation.expert_load); `measured`: a calibrated host's MoE unit
    prices the blocks (and its measured gloo all-to-all the exchanges, where calibrate timed one)."""
    ep = layout.ep if layout is not None else 1
    routing = "balanced (expert load 1.0): every expert gets routed rows / E" if load == 1 else (
        f"imbalanced (expert load {load:.3g}): the busiest expert gets {load:.3g}x the mean routed rows, priced on "
        f"the busiest rank of each expert group (its experts' rows and all-to-alls x {min(load, ep):.3g}: at most ep), "
        f"which the step waits for")
    if measured:
        return {"ep": ep, "experts": "the calibrated host's measured MoE unit (routing, experts, combine), measured "
                                     "at ep 1 with its own routing (an expert load scales the all-to-alls only)", "routing": routing, "expert_load": load,
                "all_to_all": "exposed: the host's measured all-to-all for the group, else its links" if ep > 1
                else "none (ep 1)"}
    moved = ("each token once per destination server over the NICs and rank over NVLink (deepep)"
             if dispatcher == "deepep" else "a copy per routed row (alltoall)")
    grouped = ("a GEMM per local expert, 4 at a time on Transformer Engine's streams, each round at the GEMM model's "
               "efficiency" if gemms == "te-streams" else "grouped GEMM (batch E/ep) at the GEMM model's efficiency: "
                                                          "an assumption")
    return {"ep": ep, "experts": grouped,
            "routing": routing, "expert_load": load, "dispatcher": dispatcher,
            "all_to_all": f"exposed, on the expert group's links (NVLink, NICs beyond), {moved}" if ep > 1
            else "none (ep 1)"}


def provenance(gpu: GPUSpec, profile: EfficiencyProfile | None, policy, implementation, overlap,
               host_compute=None, layout=None, seq_len: int = 0, moe: bool = False) -> dict:
    formats = [policy.compute] + (["fp8"] if policy.fp8_linears else [])
    measured = host_compute is not None and host_compute.units is not None
    extra = ({"context": context(gpu, layout, seq_len, implementation.attention_kernel,
                                 implementation.cp_attention)}
             if layout is not None and layout.cp > 1 else {})
    extra.update({"experts": experts(layout, implementation.expert_load, measured, implementation.dispatcher,
                                     implementation.expert_gemms)} if moe else {})
    return {
        "compute": (MEASURED_UNITS if measured else ROOFLINE) + (
            f"; {host_compute.missing}" if host_compute is not None and host_compute.missing else ""),
        "matmul_efficiency": efficiency_sources(gpu, formats, profile),
        "kernel_overhead_s": kernel_overhead(gpu, profile),
        "achieved": gpu.reached.as_dict(),
        "implementation": implementation.as_dict(),
        "attention": attention_source(gpu, implementation),
        "overlap": overlap.as_dict(),
        **extra,
    }


AMAX_GROUPS = {"tp_cp": "tp x cp", "data": "tp x cp x dp"}


FP8_SETTINGS = (("fp8_weight_cache", "fp8 weights cast once a step"), ("fp8_fused_casts", "fused fp8 casts"),
                ("fp8_experts", "fp8 grouped experts"), ("fp8_param_gather", "fp8 weights kept and all-gathered in fp8"),
                ("fp8_recast", "16-bit inputs saved and cast again in the backward"))
OTHER_SETTINGS = (("wgrad_fusion", "wgrad fused into main_grad"), ("ub_chunks", "userbuffers' GEMMs in chunks"),
                  ("fused_optimizer", "fused AdamW"), ("grad_reduce_fp32", "gradients reduced in fp32"),
                  ("eager", "element-wise ops in eager PyTorch (one kernel per aten op, torchtitan's code)"))


def _fp8_text(impl: dict, fp8: bool, moe: bool = False) -> str:
    """The fp8 (only for a job with fp8 Linears, `fp8`; the grouped experts' only for a mixture of experts, `moe`) and
    weight-gradient settings where they differ from our executor's (none: nothing)."""
    settings = [(key, text) for key, text in FP8_SETTINGS if fp8 and (moe or key != "fp8_experts")]
    parts = [text for key, text in (*settings, *OTHER_SETTINGS) if impl.get(key)]
    if fp8 and impl.get("fp8_scaling", "tensor") != "tensor":
        parts.append(f"fp8 {impl['fp8_scaling']} scaling")
    elif fp8 and impl.get("fp8_amax_group", "none") != "none":
        parts.append(f"fp8 amaxes all-reduced per chunk over {AMAX_GROUPS[impl['fp8_amax_group']]}")
    if impl.get("userbuffers"):
        parts.append(impl["userbuffers"])
    return "".join(f", {p}" for p in parts)


def _held_text(achieved: dict) -> str:
    """The tensor cores' share of a burst held under the power limit (achieved.tensor_sustained), or nothing."""
    held = achieved.get("tensor_sustained", {})
    if not held:
        return ""
    shares = set(held.values())
    if len(shares) == 1:
        return f", tensor cores held at {shares.pop():.1%} of a burst under the power limit ({', '.join(held)})"
    return ", tensor cores held under the power limit at " + ", ".join(f"{f} {v:.1%}" for f, v in held.items())


def summary_rows(data: dict) -> list[list[str]]:
    """The provenance as short table rows (what, rests on)."""
    rows = [["compute", data["compute"]]]
    for fmt, source in data["matmul_efficiency"].items():
        text = source["kind"] if source["kind"] == "fallback curve" else f"{source['kind']} ({_short(source['source'])})"
        if "mamf" in source:
            text += f", at most MAMF's {source['mamf']:.1%} of the peak"
        rows.append([f"{fmt} GEMM efficiency", text])
    achieved = data["achieved"]
    rows.append(["achieved fractions", f"HBM {achieved['hbm_fraction']:.0%}, NVLink {achieved['nvlink_fraction']:.0%}, "
                 f"{data['kernel_overhead_s'] * 1e6:.1f} us per kernel{_held_text(achieved)} "
                 f"({_short(achieved['source'])})"])
    impl = data["implementation"]
    kernel = f" ({impl['attention_kernel']})" if impl.get("attention_kernel", "flash-attn-2") != "flash-attn-2" else ""
    modules = f" + modules {', '.join(impl['recompute_modules'])}" if impl.get("recompute_modules") else ""
    # a document mask: the kernel skips the tiles between documents (simulator/costs/layers/attention.py)
    documents = f" within documents of {impl['document_length']:,} tokens on average" \
        if impl.get("document_length") else ""
    rows.append(["implementation", f"{impl['attention']}{kernel} attention{documents}, "
                 f"recompute {impl['recompute']}{modules}, sequence-parallel inputs saved {impl['sp_saved_input']}"
                 + _fp8_text(impl, "fp8" in data["matmul_efficiency"], "experts" in data)
                 + ("; Muon on the hidden matrices (simulator/engine/muon.py)" if impl.get("optimizer") == "muon"
                    else "")])
    o = data["overlap"]
    rows.append(["overlap", f"{o['name']}: tp {'hidden behind the Linears' if o['tp'] else 'exposed'}, dp {o['dp']}, "
                 f"ZeRO-3 prefetch {o['zero3_prefetch']}, p2p {'overlapped' if o['p2p'] else 'exposed'}, "
                 f"update gathers hidden by {'the next forward' if o['param_gather'] == 'forward' else 'nothing'}; "
                 f"overlapped compute slowed by tp {o['tp_slowdown']:.1%}, dp {o['dp_slowdown']:.1%}, "
                 f"p2p {o['p2p_slowdown']:.1%} (the SMs the collectives hold)"])
    if "context" in data:
        c = data["context"]
        rows.append(["context parallelism", f"cp {c['cp']} {c['kind']}: {c['attention']}; blocks merged "
                     f"{c['merge']}; {c['exchange']}"])
    if "experts" in data:
        e = data["experts"]
        rows.append(["mixture of experts", f"ep {e['ep']}: {e['experts']}; routing {e['routing']}; all-to-alls "
                     f"{e['all_to_all']}"])
    return rows


def _short(text: str, limit: int = 80) -> str:
    text = text.split(":")[0] if len(text) > limit else text
    return text if len(text) <= limit else text[: limit - 3] + "..."
