"""The time-by-rank picture of a schedule, as text. Torch-free.

One row per pipeline rank, one column per tick of the unit-cost timing
(`simulate_order`: forward 1, backward 2, zero-bubble halves 1 each). A compute
shows its label in its first tick ("F3", "B3", "Bi3", "W3"; with virtual
chunks the global chunk too, "F3c5") and "-" in the ticks it goes on for;
"." is a tick the rank waits. Communication and data-parallel actions take no
time in this model and do not show.
"""

from __future__ import annotations

from job.schedule_actions import Compute, Schedule
from job.schedule_check import Costs, Timeline, simulate_order


def cell_label(action: Compute, with_chunk: bool) -> str:
    """"F3" for forward of micro-batch 3; "F3c5" when a rank holds several chunks."""
    return action.name if with_chunk else f"{action.letter}{action.micro_batch}"


def render_timeline(schedule: Schedule, timeline: Timeline) -> str:
    """The diagram of an already timed schedule."""
    with_chunk = schedule.config.virtual_chunks > 1
    span = timeline.makespan
    rows: list[list[str]] = []
    for timed in timeline.ranks:
        cells = ["."] * span
        for t in timed:
            if isinstance(t.action, Compute) and t.end > t.start:
                cells[t.start] = cell_label(t.action, with_chunk)
                for tick in range(t.start + 1, t.end):
                    cells[tick] = "-"
        rows.append(cells)
    width = max((len(cell) for row in rows for cell in row), default=1)
    label_width = len(f"rank {len(rows) - 1}")
    ruler = [str(tick) if tick % 5 == 0 else "" for tick in range(span)]
    lines = [" " * label_width + " | " + " ".join(mark.ljust(width) for mark in ruler).rstrip()]
    for rank, cells in enumerate(rows):
        body = " ".join(cell.rjust(width) if cell == "." else cell.ljust(width) for cell in cells)
        lines.append(f"rank {rank}".ljust(label_width) + " | " + body.rstrip())
    return "\n".join(lines)


def render(schedule: Schedule, costs: Costs = Costs()) -> str:
    """Time (ticks, left to right) by pipeline rank (rows): the familiar pipeline picture."""
    return render_timeline(schedule, simulate_order(schedule, costs))
