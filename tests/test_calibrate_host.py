"""parallel/calibrate_host.py without starting ranks: the plans, the pieces' shapes, the profile's assembly."""

from __future__ import annotations

import pytest
import torch

from minigpt.config import preset
from parallel.calibrate import fit_alpha_beta, make_plan
from parallel.calibrate_host import AloneCollectives, build_measured, collective_points, group_pairs, piece_model, \
    piece_step, powers_up_to, tp_sizes, variants


def test_the_loads_and_group_sizes():
    assert powers_up_to(8, 2) == [2, 4, 8] and powers_up_to(6, 2) == [2, 4, 6] and powers_up_to(1, 2) == []
    assert group_pairs(8) == [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8)]
    assert group_pairs(6) == [(2, 2), (4, 2), (4, 4), (6, 2), (6, 6)]
    assert group_pairs(3) == [(2, 2), (3, 3)] and group_pairs(1) == []
    assert tp_sizes(preset("tiny"), 8) == [1, 2, 4]  # 4 heads: no tp 8
    assert tp_sizes(preset("tiny"), 2) == [1, 2] and tp_sizes(preset("tiny"), 1) == [1]
    assert tp_sizes(preset("small"), 8) == [1, 2]  # 6 heads


def test_the_pieces_are_one_tensor_parallel_ranks_modules_and_communicate_nothing():
    from dataclasses import replace

    assert variants(preset("tiny"), 8) == [(1, False), (2, False), (2, True), (4, False), (4, True)]
    config = replace(preset("tiny"), vocab_size=257)
    model = piece_model(config, 2)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["tok_emb.weight"] == (129, 128)  # 257 padded to 258, half on this rank
    assert {s for n, s in shapes.items() if "qkv" in n and n.endswith("weight")} == {(3 * 128 // 2, 128)}
    assert {s for n, s in shapes.items() if "fc2" in n and n.endswith("weight")} == {(128, 256)}
    for sp in (False, True):
        for piece in ("block", "embedding", "head"):
            forward, backward = piece_step(piece, config, 2, 1, sequence_parallel=sp)()
            assert forward > 0 and backward > 0
    with torch.no_grad():  # under sequence parallelism a rank holds half the sequence between the layers
        assert piece_model(config, 2, True).embed(torch.zeros(1, config.seq_len, dtype=torch.long)).shape[1] == 64
    group = AloneCollectives(4)
    full, shard = torch.arange(8.0), torch.tensor([5.0, 6.0])
    group.all_gather(full, shard)
    assert full.tolist() == [5.0, 6.0] * 4 and group.calls == {}  # a local copy, nothing counted or sent
    group.reduce_scatter(shard, torch.arange(8.0))
    assert shard.tolist() == [0.0, 1.0]


def host(rank: int, units=None, busy=None, threads=None, collectives=None) -> dict:
    sharing = {"busy": busy or {}}
    if threads is not None:
        sharing["threads"] = threads
    return {"cores": 2, "units": units, "sharing": sharing, "collectives": collectives or {}, "seconds": {}}


def test_the_measured_field_is_assembled_from_every_rank():
    plan = make_plan(4, quick=True)
    series = {f"{p}_{w}": [1e-3, 2e-3, 4e-3] for p in ("block", "embedding", "head") for w in ("forward", "backward")}
    hosts = [
        host(0, {(1, False): series, (2, False): series}, {1: 0.010, 2: 0.012, 4: 0.020}, threads=0.006,
             collectives={("all_reduce", 2, 2, 4096): 1e-3, ("all_reduce", 2, 2, 2**20): 2e-3,
                          ("p2p", 2, 2, 4096): 1e-4, ("all_reduce", 4, 4, 4096): 3e-3}),
        host(1, None, {2: 0.014, 4: 0.024},
             collectives={("all_reduce", 2, 2, 4096): 1.5e-3, ("all_reduce", 2, 2, 2**20): 1e-3,
                          ("p2p", 2, 2, 4096): 2e-4, ("all_reduce", 4, 4, 4096): 2e-3}),
    ]
    points = collective_points(hosts)
    assert points[("all_reduce", 2, 2)] == [[4096, 1.5e-3], [2**20, 2e-3]]  # the slowest rank per size
    measured = build_measured(hosts, plan, fit_alpha_beta)
    assert measured["cores"] == 2 and [u["tp"] for u in measured["units"]] == [1, 2]
    assert measured["units"][0]["micro_batches"] == [1, 4, 16] and measured["units"][0]["vocab_size"] == 256
    assert measured["sharing"] == [[1, 1, 1.0], [2, 1, pytest.approx(1.3)], [4, 1, pytest.approx(2.2)],
                                   [1, 2, pytest.approx(0.6)]]
    assert [(c["kind"], c["group"], c["active"]) for c in measured["collectives"]] == [
        ("all_reduce", 2, 2), ("p2p", 2, 2), ("all_reduce", 4, 4)]
    for fit in measured["collectives"]:
        assert fit["alpha"] >= 0 and fit["beta"] > 0
