"""The units a comparison's prediction uses, timed again beside its training: a prediction in the same breath.

On this project's shared 2-core VM the same block's time moves by 20-30% from one minute to the next, and a
profile's units were measured minutes or hours before the run they price. `minigpt compare` (each layout, each
round of `--matrix`) therefore re-times the units its simulation uses (simulator/costs/host.py's block_units: the
blocks, embedding and head of the layout's shape, tp split, sequence parallelism and cp, dense first blocks
included) at the layout's micro-batch, as calibrate measured them (parallel/calibrate/host.py's measure_units:
rank 0 alone on one thread, parallel/calibrate/device.py's piece_step and timed_runs), once before the training
and once after, and prices the step with them: each series of a unit is scaled by the median of those runs over
the profile's value at that micro-batch. A one-rank layout on several threads also has its block timed on them
and on one, in turn (parallel/calibrate/device.py's threads_ratio, as calibrate times the sharing table's threads
row), and the median ratio replaces that row. What is timed is the pieces alone, never the training: the sharing
of cores between ranks, the collectives and the schedule stay the profile's and the simulator's.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch


PIECES = ("block", "embedding", "head")


@dataclasses.dataclass
class Retimed:
    """A comparison's units timed again: the series' runs gathered over its timings (before and after the training)."""

    model: object  # minigpt.config.GPTConfig: the layout's model
    micro_batch: int
    repeats: int = 5
    min_run_s: float = 0.02
    threads: int = 1  # a one-rank layout's torch threads: above 1, the block's speed-up on them is timed too
    runs: dict = dataclasses.field(default_factory=dict)  # (unit key, sp, cp, dense) -> {series: [s, ...]}
    ratios: list = dataclasses.field(default_factory=list)  # the block on `threads` threads over one, pairs in turn

    def time(self, host, layout, fmt: str = "fp32") -> None:
        """Time the units `host` prices this layout with (one thread, alone), adding to the runs."""
        from parallel.calibrate.device import piece_model, piece_step, split_runs, threads_ratio, timed_runs

        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)  # as calibrate's rank 0 measured them
            torch.manual_seed(0)
            for dense, unit, config in self._units(host, layout, fmt):
                model = piece_model(config, layout.tp, unit.sequence_parallel, torch.device("cpu"), unit.cp)
                series = self.runs.setdefault((unit.key, unit.sequence_parallel, unit.cp, dense), {})
                for piece in PIECES:
                    step = piece_step(piece, config, layout.tp, self.micro_batch, model, unit.sequence_parallel,
                                      torch.device("cpu"), unit.cp)
                    for forward, backward in timed_runs(step, self.repeats, self.min_run_s * self.repeats):
                        series.setdefault(f"{piece}_forward", []).append(forward)
                        series.setdefault(f"{piece}_backward", []).append(backward)
                    if piece == "block" and not dense and layout.world_size == 1 and self.threads > 1:
                        self.ratios.append(threads_ratio(step, self.threads, self.repeats))  # leaves one thread
                if unit.split:  # the block's backward in zero-bubble's halves, as the profile timed it
                    for first, second in split_runs(config, layout.tp, self.micro_batch, model, self.repeats,
                                                    self.min_run_s * self.repeats, unit.sequence_parallel,
                                                    torch.device("cpu"), unit.cp):
                        series.setdefault("block_backward_input", []).append(first)
                        series.setdefault("block_backward_weight", []).append(second)
        finally:
            torch.set_num_threads(threads)

    def _units(self, host, layout, fmt: str):
        """(dense, the unit, the model it is timed on) for the layout's units: its blocks' and a MoE model's dense
        first blocks'."""
        model = self.model
        units, dense = host.block_units(model, layout.tp, layout.sequence_parallel, fmt, layout.cp)
        if units is not None:
            yield False, units, model
        if model.is_moe and dense is not None:
            yield True, dense, model.with_(n_experts=0, dense_layers=0)

    def apply(self, hardware, layout, fmt: str = "fp32"):
        """`hardware` with the timed units' series scaled to the runs' medians at the micro-batch (and a one-rank
        layout's threads row replaced), and a note of each unit's block (forward + backward seconds) and of the
        threads' ratio now against the profile's: (hardware, notes)."""
        host = hardware.gpu.measured
        replaced, notes = {}, []
        for dense, unit, _ in self._units(host, layout, fmt):
            series = self.runs.get((unit.key, unit.sequence_parallel, unit.cp, dense))
            if not series:
                continue
            scaled = {name: tuple(v * statistics.median(series[name]) / max(unit.seconds(name, self.micro_batch), 1e-12)
                                  for v in values) for name, values in unit.series.items()}
            replaced[id(unit)] = dataclasses.replace(unit, series=scaled)
            then = unit.seconds("block_forward", self.micro_batch) + unit.seconds("block_backward", self.micro_batch)
            now = statistics.median(series["block_forward"]) + statistics.median(series["block_backward"])
            notes.append({"unit": "dense first blocks" if dense else "blocks", "measure": "s", "profile": then,
                          "now": now, "change": now / then - 1 if then > 0 else None})
        sharing = host.sharing
        if self.ratios:  # the sharing table's row for one rank on these threads, as timed now
            ratio = statistics.median(self.ratios)
            then = host.slowdown(1, self.threads)
            notes.append({"unit": f"time on {self.threads} threads over one", "measure": "ratio", "profile": then,
                          "now": ratio, "change": ratio / then - 1})
            sharing = tuple(row for row in host.sharing if row[:2] != (1, self.threads)) + ((1, self.threads, ratio),)
        if not replaced and sharing == host.sharing:
            return hardware, notes
        units = tuple(replaced.get(id(unit), unit) for unit in host.units)
        measured = dataclasses.replace(host, units=units, sharing=sharing)
        return dataclasses.replace(hardware, gpu=dataclasses.replace(hardware.gpu, measured=measured)), notes
