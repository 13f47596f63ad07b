"""`minigpt calibrate`'s links: a least-squares line per measured collective, and the profile's link, node and NIC
figures from those fits, a preset's datasheet figures (one rank on a GPU a preset names), or a placeholder.

- `fit_alpha_beta`: t = alpha + beta * S over the (S bytes, seconds) points of one collective.
- `link_from_fit`: the per-step latency and link bandwidth that make simulator/network/collectives.py's ring reproduce
  a fit (ring all-reduce: 2(n-1) steps of S/n; all-gather and reduce-scatter: n-1; p2p: one transfer of S).
- `profile_links`, `node_and_nic`: what parallel/calibrate/measure.py's build_profile writes of them.
"""

from __future__ import annotations

import statistics


def fit_alpha_beta(points: list[list[float]] | list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares t = alpha + beta * S over [(S, t), ...], with alpha >= 0 and beta > 0.

    A negative intercept (noise at small sizes) refits the line through the origin; a slope
    that is not positive (too few or too noisy points) falls back to the largest point's t / S.
    """
    if not points:
        raise ValueError("no points to fit")
    xs, ys = [float(p[0]) for p in points], [float(p[1]) for p in points]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    beta = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    alpha = mean_y - beta * mean_x
    if alpha < 0:
        alpha, beta = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    if beta <= 0:
        big = max(range(n), key=lambda i: xs[i])
        alpha, beta = max(0.0, min(ys)), max(ys[big] / xs[big], 1e-15)
    return alpha, beta


def link_from_fit(kind: str, ranks: int, alpha: float, beta: float) -> tuple[float, float]:
    """(per-step latency s, link bandwidth B/s) that make the simulator's ring reproduce the fit.

    simulator/network/collectives.py: ring all-reduce = 2(n-1) steps of S/n, all-gather and
    reduce-scatter (n-1) steps of S/n, p2p one transfer of S.
    """
    steps = {"all_reduce": 2 * (ranks - 1), "all_gather": ranks - 1, "reduce_scatter": ranks - 1, "p2p": 1}[kind]
    share = 1.0 if kind == "p2p" else 1.0 / ranks
    return alpha / steps, steps * share / beta


def profile_links(collectives: dict, copy_bandwidth: float, links_from: dict | None) -> dict:
    """The GPU's link figures and where they come from: the fitted collectives, else a preset's
    datasheet figures (links_from), else half the copy bandwidth with no latency (a placeholder)."""
    if collectives:
        links = [link_from_fit(kind, fit["ranks"], fit["alpha"], fit["beta"]) for kind, fit in collectives.items()]
        return {"bandwidth": statistics.median(bw for _, bw in links),
                "latency": statistics.median(latency for latency, _ in links), "preset": None,
                "note": "measured: median over the fitted collectives of the per-step latency and link bandwidth "
                        "of a ring"}
    if links_from is not None:
        return {"bandwidth": links_from["nvlink_bandwidth"], "latency": links_from["nvlink_latency"],
                "preset": links_from,
                "note": (f"not measured (one rank), from preset {links_from['preset']}'s datasheet figures "
                         f"(simulator/costs/hardware.json): {links_from['nvlink_bandwidth'] / 1e9:.0f} GB/s per "
                         f"direction (datasheet), {links_from['nvlink_latency'] * 1e6:.1f} us per step "
                         f"(hardware.json's stated assumption); node {links_from['node_name']} and NIC "
                         f"{links_from['nic_name']} from the same presets")}
    return {"bandwidth": copy_bandwidth / 2, "latency": 0.0, "preset": None,
            "note": (f"not measured (one rank) and no preset matches the device: set to half the measured copy "
                     f"bandwidth ({copy_bandwidth / 2e9:.1f} GB/s) with no latency, a placeholder and not a link: "
                     f"collectives simulated with this profile rest on it; calibrate with --ranks 2 or more to "
                     f"measure them")}


def node_and_nic(name: str, source: str, ranks: int, links: dict) -> dict:
    """The profile's "nodes" and "nics": a preset's (links from a preset) or this machine's loopback."""
    preset = links["preset"]
    if preset is not None:
        node, nic = f"{name}-node", f"{name}-{preset['nic_name']}"
        return {"nodes": {node: {**preset["node"], "nic": nic,
                                 "source": f"preset {preset['node_name']} (simulator/costs/hardware.json): "
                                           f"{preset['node']['source']}"}},
                "nics": {nic: {**preset["nic"], "source": f"preset {preset['nic_name']} (simulator/costs/hardware.json): "
                                                          f"{preset['nic']['source']}"}}}
    node, nic = f"{name}-node", f"{name}-loopback"
    return {"nodes": {node: {"source": f"{source}: this machine; every local rank is one device of this node",
                             "gpus_per_node": max(64, ranks), "nics_per_node": 1, "nvswitch": True, "nic": nic}},
            "nics": {nic: {"source": f"{source}: there is no network; set as the links above ({links['note']})",
                           "bandwidth": links["bandwidth"], "latency": links["latency"], "switch_latency": 0.0,
                           "switch_radix": 64}}}
