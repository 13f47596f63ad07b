"""The commands' pictures, with matplotlib on the Agg backend (files only, no display): one simulated step's
breakdown (`simulate --plot`), the best layouts of a search (`plan --plot`), predicted against measured by phase
(`compare`, and `compare --matrix` with a panel per layout).

matplotlib costs about a second to import, so it is imported inside the drawing functions only, once a command's
work is done; `check_png` checks the path a user gave before any work (a ConfigError: one line, exit code 2).
Torch-free: simulate and plan load no torch.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from cli.output_file import check_output_file
from minigpt.errors import ConfigError

GIB = 2**30
COLORS = {"predicted": "tab:blue", "measured": "tab:orange"}


def check_png(flag: str, value: str, example: str) -> Path:
    """`value` as a PNG path that can be written (an existing file there is replaced, as a user asking for
    out.png again expects); ConfigError saying why not: a directory, a parent that does not exist, another format."""
    path = check_output_file(flag, value, example)
    if path.suffix.lower() != ".png":
        raise ConfigError(f"{flag} draws a PNG: give a file name ending in .png, such as {example}, not {path.name!r}")
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(f"{flag} draws with matplotlib, which is not installed: pip install matplotlib")
    return path


def if_drawable(draw, *args) -> str | None:
    """`draw(*args)`'s path, or None where matplotlib is not installed (a GPU machine given torch alone, bench/gpu.sh):
    a command whose picture is a by-product of its tables (compare) still gives them."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    return str(draw(*args))


NOT_DRAWN = "not drawn: matplotlib is not installed"


def pyplot():
    """matplotlib's pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt, figure, path: str | Path) -> Path:
    """The figure written to `path` as a PNG (the legends outside the axes kept in), then closed."""
    try:
        figure.savefig(path, format="png", dpi=100, bbox_inches="tight")
    finally:
        plt.close(figure)
    return Path(path)


def mesh_label(tp: int, cp: int, pp: int, dp: int, ep: int) -> str:
    """tp x cp x pp x dp (ep), cp and ep where they are used."""
    context, experts = f" x cp {cp}" if cp > 1 else "", f" (ep {ep})" if ep > 1 else ""
    return f"tp {tp}{context} x pp {pp} x dp {dp}{experts}"


def draw_step(result, path: str | Path) -> Path:
    """One simulated step (simulator/engine/simulate.py's SimResult) as a bar of its phases, stacked in the order
    the simulate table lists them (simulator/report.py's step_rows), each labelled with its seconds and share."""
    from simulator.report import BREAKDOWN_LABELS, seconds

    step = result.step_time_s
    parts = [(BREAKDOWN_LABELS[key], value) for key, value in result.breakdown.items() if value > 0]
    lay = result.layout
    mesh = mesh_label(lay.tp, lay.cp, lay.pp, lay.dp, lay.ep)
    scale, unit = (1.0, "s") if step >= 1 else (1e3, "ms")
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(9, 2.2))
    left = 0.0
    for index, (label, value) in enumerate(parts):
        axes.barh([0], [value * scale], left=left * scale, color=plt.get_cmap("tab10")(index % 10),
                  label=f"{label}: {seconds(value)} ({value / step:.1%})")
        left += value
    axes.set_yticks([])
    axes.set_xlim(0, step * scale)
    axes.set_xlabel(f"{unit} (the step of the slowest pipeline rank, {result.critical_rank})")
    axes.set_title(f"one step on {result.n_gpus} x {result.gpu}, {mesh}, ZeRO-{lay.effective_zero}, "
                   f"{result.precision}: {seconds(step)}, MFU {result.mfu:.1%}", fontsize=10)
    axes.legend(loc="upper left", bbox_to_anchor=(0, -0.45), ncol=2, fontsize=9, frameon=False)
    return save(plt, figure, path)


def draw_plan(result, path: str | Path) -> Path:
    """The layouts `minigpt plan` lists (simulator/search/plan.py's best), fastest on top: their step time, and
    their memory per GPU against the GPU's capacity."""
    from simulator.report import seconds

    best = result.best
    labels = [f"#{rank} {candidate.describe()}" for rank, (candidate, _, _) in enumerate(best, 1)]
    steps = [simulated.step_time_s for _, simulated, _ in best]
    memory = [simulated.memory.total / GIB for _, simulated, _ in best]
    plt = pyplot()
    figure, (time_axes, memory_axes) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.45 * len(best)), sharey=True,
                                                    gridspec_kw={"width_ratios": [3, 2]})
    rows = range(len(best))
    time_axes.barh(rows, steps, color="tab:blue")
    time_axes.set_yticks(list(rows), labels, fontsize=8)
    time_axes.invert_yaxis()
    time_axes.set_xlabel("step time (s)")
    label_bars(time_axes, steps, [seconds(value) for value in steps])
    memory_axes.barh(rows, memory, color="tab:green")
    label_bars(memory_axes, memory, [f"{value:.1f}" for value in memory])
    memory_axes.axvline(result.capacity / GIB, color="red", linestyle="--")
    memory_axes.set_xlabel(f"memory per GPU (GiB; dashed: the {result.gpu}'s {result.capacity / GIB:.1f})")
    figure.suptitle(f"the {len(best)} fastest layouts that fit: {result.n_gpus} x {result.gpu}, "
                    f"global batch {result.global_batch}", fontsize=10)
    return save(plt, figure, path)


def label_bars(axes, values: list[float], texts: list[str]) -> None:
    """Each horizontal bar's value written just past its end."""
    for row, (value, text) in enumerate(zip(values, texts)):
        axes.annotate(text, (value, row), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)


def time_phases(rows: list[dict]) -> list[dict]:
    """Of a comparison's rows (cli/tools/compare.py's pair), the phases of the step: those in seconds."""
    return [{"name": row["name"], "predicted": row["predicted"], "measured": row["measured"]}
            for row in rows if row.get("unit") == "s"]


def phase_panel(axes, phases: list[dict], title: str) -> None:
    """Predicted and measured milliseconds of each phase side by side, one pair of bars a phase; a phase not
    measured apart has its predicted bar only, and says so."""
    rows = range(len(phases))
    for offset, side in ((-0.2, "predicted"), (0.2, "measured")):
        values = [math.nan if p[side] is None else p[side] * 1e3 for p in phases]
        axes.barh([row + offset for row in rows], values, height=0.4, color=COLORS[side], label=side)
    for row, phase in zip(rows, phases):
        if phase["measured"] is None:
            axes.annotate("not measured apart", (0, row + 0.2), xytext=(3, 0), textcoords="offset points",
                          va="center", fontsize=7, color="grey")
    axes.set_yticks(list(rows), [p["name"] for p in phases], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("ms per step", fontsize=8)
    axes.set_title(title, fontsize=9)


def draw_compare(report: dict, path: str | Path) -> Path:
    """One layout's comparison (cli/tools/compare.py's run_compare report): predicted against measured by phase."""
    lay = report["layout"]
    error = report["step_time_relative_error"]
    title = (f"{mesh_label(lay['tp'], lay.get('cp', 1), lay['pp'], lay['dp'], lay.get('ep', 1))}, ZeRO-{lay['zero']}, "
             f"{report['precision']}: step predicted {'-' if error is None else f'{error:+.1%}'} off the measured")
    plt = pyplot()
    phases = time_phases(report["rows"])
    figure, axes = plt.subplots(figsize=(8, 1.4 + 0.55 * len(phases)))
    phase_panel(axes, phases, title)
    axes.legend(loc="lower right", fontsize=8)
    return save(plt, figure, path)


def draw_compare_matrix(report: dict, path: str | Path) -> Path:
    """`compare --matrix` (cli/tools/compare_matrix.py's report): a panel per layout, predicted against measured
    by phase, three panels a row."""
    rows = report["rows"]
    columns = min(3, len(rows))
    lines = -(-len(rows) // columns)
    plt = pyplot()
    figure, grid = plt.subplots(lines, columns, figsize=(6 * columns, 2.8 * lines), squeeze=False)
    for axes, row in zip(grid.flat, rows):
        error = row["step_time_error"]
        phase_panel(axes, row["phases"], f"{row['layout']}: step {'-' if error is None else f'{error:+.1%}'}")
    for axes in list(grid.flat)[len(rows):]:
        axes.set_visible(False)
    grid.flat[0].legend(loc="lower right", fontsize=8)
    figure.suptitle(f"predicted against measured by phase, {len(rows)} layouts: step-time MAPE "
                    f"{report['step_time_mape']:.1%}", fontsize=11)
    figure.tight_layout()
    return save(plt, figure, path)
