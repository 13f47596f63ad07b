"""Pipeline schedules: every generated one proven by the symbolic run, broken ones rejected by name,
bubbles against the textbook formulas, activation memory, the text diagram and `minigpt schedule`."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from cli.main import Group
from cli.commands.schedule import schedule as schedule_command
from minigpt.errors import ConfigError
from job.schedule import (
    AllReduceGrads,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    GatherParams,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceScatterGrads,
    Schedule,
    ScheduleConfig,
    SendActivation,
    SendGrad,
    batches,
    build_schedule,
    chunk_layers,
    closed_form_bubble,
    compute_order,
    peak_ends_in_flight,
    peak_in_flight,
    simulate_order,
    validate,
)
from job.schedule_render import render


def valid_configs():
    for kind in ("gpipe", "1f1b", "interleaved", "zb-h1"):
        for pp in range(1, 9):
            for m in range(1, 33):
                for v in range(1, 5) if kind == "interleaved" else (1,):
                    if kind != "interleaved" or m % pp == 0:
                        yield ScheduleConfig(pp, m, kind, v)


def textbook_bubble(p: int, m: int, kind: str, v: int = 1) -> float:
    """The idle share of a pipeline, as the papers give it (not the project's closed_form_bubble): GPipe and
    1F1B (p-1)/(m+p-1) (Huang et al. 2019, Narayanan et al. 2021), interleaved with v chunks (p-1)/(vm+p-1)
    (Narayanan et al. 2021), ZB-H1 (p-1)/(3m+p-1) (Qi et al. 2023, F = B = W)."""
    fills = {"gpipe": m, "1f1b": m, "interleaved": v * m, "zb-h1": 3 * m}[kind]
    return (p - 1) / (fills + p - 1)


def test_every_generated_schedule_is_proven_and_meets_its_closed_forms():
    """One pass over p 1..8, m 1..32, v 1..4: validity, bubble and peak activations.

    The bubble compared is the idle share of the unit-cost symbolic timing (forward 1,
    backward 2; for zb-h1 forward, input gradient and weight gradient 1 each), which
    equals (p-1)/(m+p-1) for GPipe and 1F1B and (p-1)/(v*m+p-1) for interleaved (m a
    multiple of p) to rounding, and (p-1)/(3m+p-1) for ZB-H1 once m >= p.
    """
    count = 0
    for config in valid_configs():
        p, m, v, kind = config.pp, config.micro_batches, config.virtual_chunks, config.kind
        built = build_schedule(config)
        bubble = simulate_order(built).bubble_fraction()  # raises if the schedule were wrong
        peaks = peak_in_flight(built)
        if kind != "zb-h1" or m >= p:
            assert bubble == pytest.approx(textbook_bubble(p, m, kind, v), abs=1e-9), config
            assert closed_form_bubble(p, m, kind, v) == pytest.approx(textbook_bubble(p, m, kind, v), abs=1e-12)
        else:  # too few micro-batches to hide the weight gradients: still no worse than 1F1B
            assert bubble <= (p - 1) / (m + p - 1) + 1e-9, config
        if kind == "gpipe":
            assert peaks == [m] * p
        elif kind == "1f1b":
            assert peaks == [min(p - rank, m) for rank in range(p)]
        elif kind == "zb-h1":
            assert max(peaks) <= p and peaks[0] == min(p, m)
        else:
            assert peaks == [min((v - 1) * p + 2 * (p - rank - 1) + 1, m * v) for rank in range(p)]
        # the embedding's chunk (0, on rank 0) and the head's (the last, on the last rank) in flight, apart
        ends = peak_ends_in_flight(built)
        assert all(first == 0 for first, _ in ends[1:]) and all(last == 0 for _, last in ends[:-1]), config
        first, last = ends[0][0], ends[-1][1]
        if v == 1:  # the rank's only chunk
            assert (first, last) == (peaks[0], peaks[-1]), config
        else:  # Megatron's interleaving: 2p of chunk 0 warm up on rank 0; the head's backward follows its forward
            assert (first, last) == (min(2 * p, m), 1), (config, ends)
        count += 1
    assert count > 1000


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind,pp,m,v", [("gpipe", 3, 5, 1), ("1f1b", 4, 6, 1), ("interleaved", 2, 4, 3),
                                          ("interleaved", 4, 8, 2), ("zb-h1", 4, 7, 1), ("1f1b", 1, 3, 1)])
def test_data_parallel_actions_follow_the_zero_stage(zero_stage, kind, pp, m, v):
    built = build_schedule(ScheduleConfig(pp, m, kind, v, zero_stage, buckets=2))
    validate(built)
    reduce = AllReduceGrads if zero_stage == 0 else ReduceScatterGrads
    for rank, actions in enumerate(built.actions):
        chunks = built.config.chunks_of(rank)
        reductions = [(i, a) for i, a in enumerate(actions) if isinstance(a, (AllReduceGrads, ReduceScatterGrads))]
        if zero_stage <= 1:  # once a step, right after the chunk's last weight gradient
            assert {a for _, a in reductions} == {reduce(c, b) for c in chunks for b in range(2)}
        else:  # every micro-batch's weight gradient, right after it
            assert {a for _, a in reductions} == {reduce(c, b, 0, mb) for c in chunks for b in range(2)
                                                   for mb in range(m)}
        for i, action in reductions:
            producer = next(a for a in reversed(actions[:i]) if isinstance(a, (Backward, BackwardWeight)))
            assert producer.chunk == action.chunk
            assert zero_stage <= 1 or producer.micro_batch == action.micro_batch
        step = actions.index(OptimizerStep(norm_over_dp=zero_stage >= 1))
        gathers = [(i, a) for i, a in enumerate(actions) if isinstance(a, GatherParams)]
        if zero_stage == 0:
            assert not gathers
        elif zero_stage in (1, 2):
            assert {a for _, a in gathers} == {GatherParams(c, b, "update") for c in chunks for b in range(2)}
            assert all(i > step for i, _ in gathers)
        else:  # symbolic units are never kept: every forward and every backward gathers them again
            for i, action in enumerate(actions):  # (zb-h1: units an input gradient gathered stay)
                if kind == "zb-h1" and not (isinstance(action, Forward) and action.micro_batch == 0):
                    continue
                if isinstance(action, (Forward, Backward, BackwardWeight)) or \
                        (isinstance(action, BackwardInput) and action.chunk):
                    phase = {Forward: "forward", BackwardWeight: "weight"}.get(type(action), "backward")
                    assert {GatherParams(action.chunk, b, phase, 0, action.micro_batch) for b in range(2)} <= \
                        set(actions[:i])


def test_compute_orders():
    gpipe = compute_order(ScheduleConfig(3, 4, "gpipe"), 1)
    assert [a.name for a in gpipe] == ["F0c1", "F1c1", "F2c1", "F3c1", "B3c1", "B2c1", "B1c1", "B0c1"]
    for rank in range(4):
        order = compute_order(ScheduleConfig(4, 8, "1f1b"), rank)
        warmup = next(i for i, a in enumerate(order) if isinstance(a, Backward))
        assert warmup == 4 - rank  # p - rank - 1 warm-up forwards, then the first steady forward
    config = ScheduleConfig(4, 8, "interleaved", 2)
    for rank in range(4):
        order = compute_order(config, rank)
        assert next(i for i, a in enumerate(order) if isinstance(a, Backward)) == min(4 + 2 * (3 - rank) + 1, 16)
        assert [a.chunk for a in order if isinstance(a, Forward)][:8] == [rank] * 4 + [rank + 4] * 4
    zb = compute_order(ScheduleConfig(3, 5, "zb-h1"), 2)
    assert [a.name for a in zb][:5] == ["F0c2", "Bi0c2", "F1c2", "Bi1c2", "F2c2"]  # last rank holds 2 W back
    assert sum(isinstance(a, BackwardWeight) for a in zb) == 5


def test_steady_state_exchanges_are_single_batches():
    actions = build_schedule(ScheduleConfig(4, 8, "1f1b")).actions[1]
    kinds = [tuple(type(a) for a in group) for group in batches(actions)]
    assert (SendActivation, RecvGrad) in kinds and (SendGrad, RecvActivation) in kinds
    interleaved = build_schedule(ScheduleConfig(4, 8, "interleaved", 2)).actions[1]
    assert any(len(group) == 4 for group in batches(interleaved))  # both sends and both receives at once


def test_actions_are_plain_hashable_data():
    assert Forward(3, 1).name == "F3c1" and Backward(3, 1).name == "B3c1"
    assert {Forward(3, 1), Forward(3, 1), Backward(3, 1)} == {Forward(3, 1), Backward(3, 1)}
    recv = RecvActivation(3, 1, 0, 0)
    assert str(recv) == "RecvActivation(mb 3, chunk 1, from rank 0)"
    assert recv.partner(1) == SendActivation(3, 0, 1, 1) and SendActivation(3, 0, 1, 1).partner(0) == recv
    with pytest.raises(AttributeError):
        Forward(3, 1).micro_batch = 4


def test_chunk_layers():
    assert chunk_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    with pytest.raises(ConfigError, match="at least one block"):
        chunk_layers(3, 4)


@pytest.mark.parametrize("kwargs,message", [
    (dict(pp=0, micro_batches=4), "pipeline size"),
    (dict(pp=2, micro_batches=0), "micro-batches"),
    (dict(pp=2, micro_batches=4, kind="pipedream"), "unknown schedule"),
    (dict(pp=4, micro_batches=6, kind="interleaved", virtual_chunks=2), "multiple of the pipeline size"),
    (dict(pp=2, micro_batches=4, kind="1f1b", virtual_chunks=2), "need the interleaved schedule"),
    (dict(pp=2, micro_batches=4, zero_stage=4), "ZeRO stage"),
])
def test_bad_configs_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ScheduleConfig(**kwargs)


def edited(config: ScheduleConfig, rank: int, edit) -> Schedule:
    """The generated schedule with rank `rank`'s list changed by edit(list)."""
    built = build_schedule(config)
    actions = [list(rank_actions) for rank_actions in built.actions]
    edit(actions[rank])
    return Schedule(config, actions)


def test_rejects_a_missing_recv():
    broken = edited(ScheduleConfig(2, 4), 1, lambda a: a.remove(RecvActivation(2, 1, 0, 0)))
    with pytest.raises(ConfigError, match=r"rank 0 is stuck at SendActivation\(mb 2, chunk 0, to rank 1\): "
                                          r"no matching RecvActivation"):
        validate(broken)


def test_rejects_a_recv_from_the_wrong_peer():
    def wrong_peer(actions):
        index = actions.index(RecvActivation(1, 2, 1, 1))
        actions[index] = RecvActivation(1, 2, 0, 1)
    with pytest.raises(ConfigError, match=r"rank 2: RecvActivation\(mb 1, chunk 2, from rank 0\): .*rank 1"):
        validate(edited(ScheduleConfig(3, 4), 2, wrong_peer))


def test_rejects_a_deadlock_of_two_blocking_receives():
    def receive_first(actions):  # rank 0 waits for a gradient before sending its first activation
        actions.remove(RecvGrad(0, 0, 1, 1))
        actions.insert(0, RecvGrad(0, 0, 1, 1))
    with pytest.raises(ConfigError, match=r"rank 0 is stuck at RecvGrad\(mb 0, chunk 0, from rank 1\): deadlock, "
                                          r"rank 1 is stuck at RecvActivation\(mb 0, chunk 1, from rank 0\)"):
        validate(edited(ScheduleConfig(2, 2), 0, receive_first))


def test_rejects_a_duplicated_forward():
    broken = edited(ScheduleConfig(2, 4), 0, lambda a: a.insert(5, Forward(1, 0)))
    with pytest.raises(ConfigError, match=r"rank 0 runs Forward\(mb 1, chunk 0\) twice"):
        validate(broken)


def test_rejects_other_breakage():
    def late_recv(actions):  # the forward comes before its input
        actions.remove(RecvActivation(0, 1, 0, 0))
        actions.insert(actions.index(Forward(0, 1)) + 1, RecvActivation(0, 1, 0, 0))
    with pytest.raises(ConfigError, match=r"rank 1: Forward\(mb 0, chunk 1\) comes before RecvActivation"):
        validate(edited(ScheduleConfig(2, 2), 1, late_recv))

    def swap_sends(actions):  # rank 0 sends mb 1 before mb 0; rank 1 receives in the other order
        i, j = actions.index(SendActivation(0, 0, 1, 1)), actions.index(SendActivation(1, 0, 1, 1))
        actions[i], actions[j] = actions[j], actions[i]
    with pytest.raises(ConfigError, match=r"rank 1 posts RecvActivation\(mb 0, chunk 1, from rank 0\) where rank 0 "
                                          r"posts SendActivation\(mb 1, chunk 0, to rank 1\)"):
        validate(edited(ScheduleConfig(2, 4, "gpipe"), 0, swap_sends))

    with pytest.raises(ConfigError, match=r"rank 1: SendGrad\(mb 3, chunk 1, to rank 0\) comes before the backward"):
        validate(edited(ScheduleConfig(2, 4, "gpipe"), 1, lambda a: a.remove(Backward(3, 1))))
    with pytest.raises(ConfigError, match=r"rank 1 never runs OptimizerStep\(\)"):
        validate(edited(ScheduleConfig(2, 4, "gpipe"), 1, lambda a: a.remove(OptimizerStep())))
    with pytest.raises(ConfigError, match=r"ZeRO stage 1 reduces gradients with ReduceScatterGrads"):
        validate(edited(ScheduleConfig(2, 4, zero_stage=1), 1,
                        lambda a: a.__setitem__(a.index(ReduceScatterGrads(1, 0)), AllReduceGrads(1, 0))))
    with pytest.raises(ConfigError, match=r"chunk 1 lives on rank 1"):
        validate(edited(ScheduleConfig(2, 4), 0, lambda a: a.append(Forward(0, 1))))


def test_render_draws_time_by_rank():
    assert render(build_schedule(ScheduleConfig(2, 2, "gpipe"))).splitlines() == [
        "       | 0              5",
        "rank 0 | F0 F1  .  .  . B1 -  B0 -",
        "rank 1 |  . F0 F1 B1 -  B0 -   .  .",
    ]
    assert "F0c2" in render(build_schedule(ScheduleConfig(2, 2, "interleaved", 2)))


def minigpt():
    return Group(name="minigpt", commands={"schedule": schedule_command})


def test_cli_table_and_json():
    runner = CliRunner()
    result = runner.invoke(minigpt(), ["schedule", "--pp", "4", "--micro-batches", "8", "--schedule", "1f1b"])
    assert result.exit_code == 0, result.output
    assert "rank 3 |" in result.output and "bubble 0.2727" in result.output and "peak activations" in result.output
    args = ["schedule", "--pp", "4", "--micro-batches", "8", "--schedule", "interleaved", "--virtual-chunks", "2",
            "--zero", "3", "--json"]
    result = runner.invoke(minigpt(), args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["config"]["virtual_chunks"] == 2 and report["config"]["zero_stage"] == 3
    assert report["bubble_fraction"] == pytest.approx(3 / 19)
    assert sorted(report["actions"]) == ["0", "1", "2", "3"] and report["actions"]["0"][0] == "AllGather.c0b0.forward.mb0"
    assert report["peak_activations"] == [11, 9, 7, 5]


@pytest.mark.parametrize("args", [["--pp", "0"], ["--micro-batches", "0"], ["--schedule", "pipedream"],
                                  ["--pp", "4", "--micro-batches", "6", "--schedule", "interleaved"],
                                  ["--virtual-chunks", "2"]])
def test_cli_bad_input_is_one_line_and_exit_2(args):
    result = CliRunner().invoke(minigpt(), ["schedule"] + args)
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "error" in result.stderr


def test_schedule_modules_do_not_import_torch():
    code = "import sys, job.schedule, job.schedule_render, cli.commands.schedule; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
