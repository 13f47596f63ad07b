"""parallel/calibrate_host.py without starting ranks: the plans, the pieces' shapes, the profile's assembly."""

from __future__ import annotations

import pytest
import torch

from minigpt.config import preset
from parallel.calibrate import fit_alpha_beta, make_plan
from parallel.calibrate_host import build_measured, collective_points, group_pairs, piece_modules, piece_step, \
    powers_up_to, tp_sizes


def test_the_loads_and_group_sizes():
    assert powers_up_to(8, 2) == [2, 4, 8] and powers_up_to(6, 2) == [2, 4, 6] and powers_up_to(1, 2) == []
    assert group_pairs(8) == [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8)]
    assert group_pairs(6) == [(2, 2), (4, 2), (4, 4), (6, 2), (6, 6)]
    assert group_pairs(3) == [(2, 2), (3, 3)] and group_pairs(1) == []
    assert tp_sizes(preset("tiny"), 8) == [1, 2, 4]  # 4 heads: no tp 8
    assert tp_sizes(preset("tiny"), 2) == [1, 2] and tp_sizes(preset("tiny"), 1) == [1]
    assert tp_sizes(preset("small"), 8) == [1, 2]  # 6 heads


def test_the_pieces_have_one_tensor_parallel_ranks_shapes():
    from dataclasses import replace

    config = replace(preset("tiny"), vocab_size=257)
    block = piece_modules("block", config, 2)
    assert block.attn.qkv.out_features == 3 * 128 // 2 and block.attn.proj.in_features == 64
    assert block.mlp.fc1.out_features == 256 and block.mlp.fc2.in_features == 256
    assert block(torch.randn(2, config.seq_len, 128)).shape == (2, config.seq_len, 128)
    tok, pos = piece_modules("embedding", config, 2)
    norm, head = piece_modules("head", config, 2)
    assert tok.num_embeddings == 129 == head.out_features and pos.num_embeddings == config.seq_len  # padded to 258
    for piece in ("block", "embedding", "head"):
        forward, backward = piece_step(piece, config, 2, 1)()
        assert forward > 0 and backward > 0


def host(rank: int, units=None, busy=None, threads=None, collectives=None) -> dict:
    sharing = {"busy": busy or {}}
    if threads is not None:
        sharing["threads"] = threads
    return {"cores": 2, "units": units, "sharing": sharing, "collectives": collectives or {}, "seconds": {}}


def test_the_measured_field_is_assembled_from_every_rank():
    plan = make_plan(4, quick=True)
    series = {f"{p}_{w}": [1e-3, 2e-3, 4e-3] for p in ("block", "embedding", "head") for w in ("forward", "backward")}
    hosts = [
        host(0, {1: series, 2: series}, {1: 0.010, 2: 0.012, 4: 0.020}, threads=0.006,
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
