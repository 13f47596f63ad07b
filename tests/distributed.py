"""Multi-rank tests: run a function on N gloo ranks on the CPU and get every rank's result.

The ranks are started by parallel.launch.elastic.launch(), the launcher training uses, so every
multi-rank test exercises it as well. They are forked from the one server of the test session
(parallel/launch/rank_start.py), which imported torch once: a group of 8 ranks starts in under a second,
so each test may launch its own group and keep its ranks' state its own.

The function must be defined at module level: the ranks import it by name. Functions in test
modules work because a rank starts with the parent's sys.path, which under pytest's default
"prepend" import mode holds tests/ (there is no tests/__init__.py), so `test_x.check` and this
module import in the ranks as they did in pytest.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from parallel.launch.elastic import finish_worker, init_worker, launch


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """fn(*args) on world_size gloo ranks, one thread each; the return values, ordered by rank.

    A rank that raises makes this raise TrainingError naming it; world size 1 runs in this
    process without a process group.
    """
    return launch(gather_results, (fn, args), world_size, threads_per_rank=1)


def gather_results(job: tuple[Callable[..., Any], tuple[Any, ...]]) -> list[Any] | None:
    """One rank's part: run the function, then hand every rank's value to rank 0."""
    fn, args = job
    init_worker("cpu")
    try:
        value = fn(*args)
        if not dist.is_initialized():
            return [value]
        values: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(value, values, dst=0)
        return values
    finally:
        finish_worker()


def run_worlds(world_fn: Callable[..., dict], worlds: Iterable[int],
               extra: Callable[[int], Any] | None = None) -> dict[str, list]:
    """{layout name: every rank's result} of world_fn(world) (with extra(world) after it when given) on `world`
    gloo ranks for each world size: a parity test's layouts started once per size, gathered by name (by_layout)."""
    runs: dict[str, list] = {}
    for world in worlds:
        by_layout(run_ranks(world, world_fn, world, *(() if extra is None else (extra(world),))), runs)
    return runs


def named_world(trained: Callable, config: Callable, layouts: dict[int, dict], world: int) -> dict:
    """This rank's run of every layout of `world` ranks in {world: {name: (model name, layout)}}:
    trained(config(model name, **layout)) by name (run_worlds(partial(named_world, trained, config, layouts), ...))."""
    torch.set_num_threads(1)
    return {name: trained(config(model, **layout)) for name, (model, layout) in layouts[world].items()}


def layout_world(trained: Callable, config: Callable, layouts: dict[int, dict], world: int) -> dict:
    """This rank's run of every layout of `world` ranks in {world: {name: layout}} of one model:
    trained(config(**layout)) by name (run_worlds(partial(layout_world, trained, config, layouts), ...))."""
    torch.set_num_threads(1)
    return {name: trained(config(**layout)) for name, layout in layouts[world].items()}


def one_process(trained: Callable, config: Callable) -> dict:
    """trained(config()): the one-process reference, on one thread."""
    with one_thread():
        return trained(config())


def named_references(trained: Callable, config: Callable, models: Iterable[str]) -> dict:
    """{model name: trained(config(model name))}: the one-process references, on one thread."""
    with one_thread():
        return {model: trained(config(model)) for model in models}


def named_parity(trained: Callable, config: Callable, models: Iterable[str], layouts: dict[int, dict]) -> tuple:
    """A parity test module's two module-scoped fixtures, `spawned` (every layout of {world: {name: (model name,
    layout)}} run once per world size: named_world) and `references` (each model in one process: named_references);
    the module binds them to those names (`spawned, references = named_parity(...)`)."""
    import pytest

    @pytest.fixture(scope="module", name="spawned")
    def spawned():
        return run_worlds(partial(named_world, trained, config, layouts), layouts)

    @pytest.fixture(scope="module", name="references")
    def references():
        return named_references(trained, config, models)

    return spawned, references


def layout_parity(trained: Callable, config: Callable, layouts: dict[int, dict]) -> tuple:
    """A one-model parity test module's two module-scoped fixtures, `spawned` (every layout of {world: {name:
    layout}} run once per world size: layout_world) and `reference` (one process: one_process); the module binds
    them to those names (`spawned, reference = layout_parity(...)`)."""
    import pytest

    @pytest.fixture(scope="module", name="spawned")
    def spawned():
        return run_worlds(partial(layout_world, trained, config, layouts), layouts)

    @pytest.fixture(scope="module", name="reference")
    def reference():
        return one_process(trained, config)

    return spawned, reference


def layout_parity_test(label: str, layouts: dict[int, dict], tolerance: float) -> Callable:
    """The test that every layout of {world: {name: layout}} trains the one-process reference's losses and gradient
    norms within `tolerance` (layout_parity's fixtures), one case a layout; bound to a test_ name by the module."""
    import pytest

    from parity import assert_runs_match

    cases = every_layout(layouts)

    @pytest.mark.parametrize("world, name", cases, ids=[name for _, name in cases])
    def test(spawned, reference, world, name):
        assert_runs_match(spawned[name], reference, f"{label} {name}", tolerance)

    return test


def every_layout(layouts: dict[int, dict]) -> list[tuple[int, str]]:
    """(world size, layout name) of every layout of {world size: {name: layout}}: a parity test's parameters."""
    return [(world, name) for world, named in layouts.items() for name in named]


def by_layout(ranks: list[dict], runs: dict | None = None) -> dict[str, list]:
    """Every rank's {layout name: result} gathered by name: {name: [rank 0's, rank 1's, ...]} (added to `runs`)."""
    runs = {} if runs is None else runs
    for rank in ranks:
        for name, run in rank.items():
            runs.setdefault(name, []).append(run)
    return runs


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside (a one-process reference computed as each rank computes), as before after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
