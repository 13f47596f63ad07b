"""A mixture of experts' load over a run: the routed choices each expert took, per MoE layer, and its picture.

Each MoE layer counts the choices its tokens made during training steps (minigpt/moe.py's `load`, where the
router runs: on the rank that holds the tokens). The run's load is the sum over the data-parallel ranks (every
rank sees other tokens) of one tensor-parallel rank's counts (its peers route the same tokens; under sequence
parallelism every tp rank's, each routing its slice), the pipeline stages each giving their own layers. The summary gives each layer's shares and its busiest expert against the
mean (1.0: balanced; E: one expert takes everything); expert_load.png draws the shares.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from minigpt.moe import MoE


def rank_load(model: nn.Module, mesh, sequence_parallel: bool) -> dict:
    """This rank's counts by MoE layer (the layer's index in the whole model), and whether they count: at tp rank 0,
    or at every tp rank under sequence parallelism, where each routes its own slice of the tokens."""
    return {"counted": mesh.tp_rank == 0 or sequence_parallel,
            "load": {module.layer: module.load.tolist() for module in model.modules() if isinstance(module, MoE)}}


def run_load(per_rank: list[dict]) -> dict[int, list[float]]:
    """The run's counts from every rank's rank_load."""
    total: dict[int, list[float]] = {}
    for found in per_rank:
        if not found["counted"]:
            continue
        for layer, counts in found["load"].items():
            total[layer] = [a + b for a, b in zip(total.get(layer, [0.0] * len(counts)), counts)]
    return dict(sorted(total.items()))


def load_summary(load: dict[int, list[float]]) -> dict:
    """Per layer: each expert's count and share of the choices, and the busiest expert's count over the mean."""
    layers = {}
    for layer, counts in load.items():
        total = sum(counts)
        shares = [c / total if total else 0.0 for c in counts]
        layers[str(layer)] = {"counts": counts, "shares": shares,
                              "max_over_mean": max(shares) * len(shares) if total else 0.0}
    return {"layers": layers, "choices": sum(sum(c) for c in load.values())}


def write_load_plot(run_dir: Path, summary: dict, name: str = "expert_load.png") -> Path | None:
    """Each layer's expert shares (a load_summary) as a heat map into run_dir/name; None without matplotlib."""
    from parallel.run.files import open_no_follow
    from parallel.run.loss_plot import import_pyplot

    plt = import_pyplot()
    if plt is None or not summary["layers"]:
        return None
    layers = sorted(summary["layers"], key=int)
    shares = [summary["layers"][layer]["shares"] for layer in layers]
    figure, axes = plt.subplots(figsize=(7, 1.2 + 0.4 * len(layers)), dpi=100)
    try:
        image = axes.imshow(shares, aspect="auto", cmap="viridis", vmin=0.0)
        axes.set_xlabel("expert")
        axes.set_ylabel("layer")
        axes.set_yticks(range(len(layers)), layers)
        axes.set_title(f"{run_dir.name}: share of the routed choices each expert took")
        figure.colorbar(image, ax=axes, label="share")
        tmp = run_dir / (name + ".tmp.png")
        with open_no_follow(tmp, "wb") as handle:
            figure.savefig(handle, format="png", bbox_inches="tight")
        tmp.replace(run_dir / name)
    finally:
        plt.close(figure)
    return run_dir / name
