"""Expert parallelism's all-to-alls hidden behind the shared experts (Overlap.ep, Megatron-core's
moe_shared_expert_overlap): simulator/engine/experts.py's pricing, what hides them (simulator/costs/compute.py's
shared_halves), the step's exposed and hidden seconds, and the command line's --ep-overlap."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main
from job.exchange.experts import forward_exchanges, routed_rows
from job.layout import Layout
from minigpt.errors import ConfigError
from minigpt.presets import preset
from precision.policy import policy
from simulator.costs.compute import chunk_times, op_time
from simulator.costs.hardware import load_hardware
from simulator.costs.implementation import Implementation
from simulator.costs.ops import block_ops
from simulator.engine.experts import SharedExperts, layer_exchange
from simulator.engine.links import LinkCosts
from simulator.engine.overlap import Overlap, exposed, overlap_preset, resolve_overlap
from simulator.engine.simulate import simulate_step
from simulator.network.topology import build_cluster
from simulator.report import step_rows

H100 = load_hardware("h100-sxm")
MIXTRAL = preset("mixtral-8x7b")
DEEPSEEK = preset("deepseek-v3")
SHARED_MOE = MIXTRAL.with_(n_layers=8, n_shared_experts=1)  # Mixtral's shape with one shared expert
LAYOUT = Layout(dp=16, ep=8)


class Flat:
    """Links on which every all-to-all takes `seconds`."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def all_to_all(self, stage: int, nbytes: float) -> float:
        return self.seconds


def test_nothing_behind_prices_every_call_exposed():
    forward, backward = layer_exchange(MIXTRAL, Layout(dp=4, ep=4), 1, 2, "none", Flat(1e-3), 0)
    again = layer_exchange(MIXTRAL, Layout(dp=4, ep=4), 1, 2, "none", Flat(1e-3), 0, shared=SharedExperts())
    assert (forward.seconds, backward.seconds) == pytest.approx((3e-3, 2e-3))
    assert forward.hidden == backward.hidden == 0
    assert (again[0].seconds, again[1].seconds, again[0].hidden) == (forward.seconds, backward.seconds, 0)


def test_each_all_to_all_hides_behind_its_half_of_the_shared_experts():
    """Forward: counts exposed, dispatch behind fc1 + activation, combine behind fc2; backward: the combine's
    gradient behind fc2's, the dispatch's behind fc1's. Long halves hide a call whole (exposed only f x c)."""
    c, f = 1e-3, 0.1
    long = SharedExperts(forward=(1.0, 1.0), backward=(1.0, 1.0), slowdown=f)
    forward, backward = layer_exchange(MIXTRAL, Layout(dp=4, ep=4), 1, 2, "none", Flat(c), 0, shared=long)
    assert forward.seconds == pytest.approx(c + 2 * f * c) and forward.hidden == pytest.approx(2 * c)
    assert backward.seconds == pytest.approx(2 * f * c) and backward.hidden == pytest.approx(2 * c)
    # short halves: the dispatch sticks out past fc1 by c - g1, the combine past fc2 by c - g2
    g1, g2 = 0.4e-3, 0.7e-3
    short = SharedExperts(forward=(g1, g2), backward=(g2, g1), slowdown=0.0)
    forward, backward = layer_exchange(MIXTRAL, Layout(dp=4, ep=4), 1, 2, "none", Flat(c), 0, shared=short)
    assert forward.seconds == pytest.approx(c + (c - g1) + (c - g2)) and forward.hidden == pytest.approx(g1 + g2)
    # the backward's halves pair crosswise: the combine's gradient (first) with fc2's backward[1]
    assert backward.seconds == pytest.approx((c - g1) + (c - g2)) and backward.hidden == pytest.approx(g1 + g2)
    lopsided = SharedExperts(backward=(0.0, 1.0))
    first, second = layer_exchange(MIXTRAL, Layout(dp=4, ep=4), 1, 2, "none", Flat(c), 0, shared=lopsided)[1].priced
    assert first.bytes == second.bytes  # balanced: the two calls alike, so the pairing shows in the seconds only
    assert layer_exchange(MIXTRAL, Layout(dp=4, ep=4), 1, 2, "none", Flat(c), 0,
                          shared=lopsided)[1].seconds == pytest.approx(c)  # the combine's gradient hid, not the other


def test_a_recomputed_forward_hides_its_all_to_alls_behind_the_recomputed_shared_experts():
    c = 1e-3
    shared = SharedExperts(recompute=(1.0, 1.0))
    backward = layer_exchange(MIXTRAL, Layout(dp=4, ep=4), 1, 2, "full", Flat(c), 0, shared=shared)[1]
    assert len(backward.priced) == 5  # counts, dispatch, combine again, then the two gradients
    assert backward.seconds == pytest.approx(3 * c) and backward.hidden == pytest.approx(2 * c)


def test_the_shared_halves_are_the_shared_experts_ops():
    """fc1 and its activation, then fc2, from the block's own op list, weight gradients left out; nothing for a model
    without shared experts; a full recomputation runs the forward's halves again."""
    layout, bf16 = Layout(dp=8, ep=8), policy("bf16")
    ops = block_ops(DEEPSEEK, 1, layout, bf16, Implementation(), True)
    fc1 = sum(op_time(op, H100.gpu) for op in ops.forward if op.name in ("shared.fc1", "shared.swiglu"))
    fc2 = sum(op_time(op, H100.gpu) for op in ops.forward if op.name == "shared.fc2")
    times = chunk_times(DEEPSEEK, 1, 1, layout, H100.gpu, "bf16", moe_layers=1)
    assert times.shared_forward_s == pytest.approx((fc1, fc2)) and fc1 > fc2 > 0
    grads = [op for op in ops.backward if op.name.startswith("shared.")]
    fc2_back = sum(op_time(op, H100.gpu) for op in grads if op.name == "shared.fc2.input_grad")
    assert times.shared_backward_s[1] == pytest.approx(fc2_back)
    assert times.shared_recompute_s == (0.0, 0.0)
    full = chunk_times(DEEPSEEK, 1, 1, layout, H100.gpu, "bf16", "full", moe_layers=1)
    assert full.shared_recompute_s == pytest.approx(times.shared_forward_s)
    assert chunk_times(MIXTRAL, 1, 1, layout, H100.gpu, "bf16", moe_layers=1).shared_forward_s == (0.0, 0.0)


def step(model, overlap, layout=LAYOUT, recompute="none"):
    return simulate_step(model, layout, build_cluster(H100, 8, layout.world_size // 8), "bf16", 32, 1,
                         overlap=overlap, recompute=recompute)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_hiding_shortens_the_step_and_keeps_the_books(recompute):
    """Per call exposed(c, g, f) <= c and exposed + hidden >= c: the exposed row falls, by no more than what hid,
    and the step with it; the default (and a model without shared experts) hides nothing."""
    off, on = step(SHARED_MOE, "executor", recompute=recompute), step(SHARED_MOE, resolve_overlap(ep=True),
                                                                        recompute=recompute)
    assert off.hidden == {"ep_comm": 0.0} and off.breakdown["ep_comm"] > 0
    assert 0 < on.hidden["ep_comm"] <= off.breakdown["ep_comm"]
    assert on.breakdown["ep_comm"] < off.breakdown["ep_comm"] <= on.breakdown["ep_comm"] + on.hidden["ep_comm"]
    assert on.step_time_s < off.step_time_s
    assert on.breakdown["compute"] == off.breakdown["compute"]
    plain = step(MIXTRAL.with_(n_layers=8), resolve_overlap(ep=True), recompute=recompute)
    assert plain.hidden == {"ep_comm": 0.0}
    assert plain.step_time_s == step(MIXTRAL.with_(n_layers=8), "executor", recompute=recompute).step_time_s


def test_long_shared_experts_hide_every_row_all_to_all():
    """With no slowdown and shared experts far longer than the all-to-alls, only the counts' all-to-all of each
    forward stays exposed; the four row all-to-alls of every MoE layer and micro-batch are the hidden seconds."""
    model = SHARED_MOE.with_(n_shared_experts=8)
    on = step(model, resolve_overlap(ep=True, dp_slowdown=0.0))
    links = LinkCosts(build_cluster(H100, 8, LAYOUT.world_size // 8), LAYOUT, H100.gpu)
    counts, dispatch, combine = forward_exchanges(model, 8, routed_rows(model, model.seq_len, 1), 2)
    passes = model.n_layers * 32 // 16  # MoE layers x micro-batches on the one stage
    assert on.breakdown["ep_comm"] == pytest.approx(passes * links.all_to_all(0, counts.bytes), rel=1e-9)
    assert dispatch.bytes == combine.bytes  # balanced
    assert on.hidden["ep_comm"] == pytest.approx(passes * 4 * links.all_to_all(0, dispatch.bytes), rel=1e-9)


def test_the_setting_is_checked_and_named():
    assert Overlap().ep is False and overlap_preset("megatron-core").ep is False
    assert overlap_preset("overlapped").ep is True
    assert resolve_overlap("megatron-core", ep=True).name == "megatron-core+custom"
    with pytest.raises(ConfigError, match="overlap ep must be true or false"):
        Overlap(ep="yes")
    assert exposed(1.0, 0.0, 0.1) == 1.0


def test_the_report_shows_the_hidden_row():
    rows = {row[0].strip(): row for row in step_rows(step(SHARED_MOE, resolve_overlap(ep=True)))}
    assert "expert all-to-all (exposed)" in rows and rows["expert all-to-all (hidden)"][2].endswith(
        "behind the shared experts")
    rows = {row[0].strip(): row for row in step_rows(step(SHARED_MOE, "executor"))}
    assert rows["expert all-to-all (hidden)"][1:] == ["0", "not in the step: not overlapped (--ep-overlap)"]


def test_simulate_takes_ep_overlap():
    args = ["simulate", "--model", "tiny-moe", "--shared-experts", "1", "--ep", "2", "--dp", "2", "--gpu", "h100-sxm"]
    runner = CliRunner()
    off = json.loads(runner.invoke(main, [*args, "--json"]).output)
    result = runner.invoke(main, [*args, "--json", "--ep-overlap"])
    assert result.exit_code == 0, result.output
    on = json.loads(result.output)
    assert on["overlap"]["ep"] is True and on["overlap"]["name"] == "executor+custom"
    assert on["hidden"]["ep_comm"] > 0 == off["hidden"]["ep_comm"]
    assert on["breakdown"]["ep_comm"] < off["breakdown"]["ep_comm"]
    text = runner.invoke(main, [*args, "--ep-overlap"]).output
    assert "expert all-to-all (hidden)" in text and "behind the shared experts" in text
    assert "--ep-overlap" in runner.invoke(main, ["simulate", "--help"]).output
