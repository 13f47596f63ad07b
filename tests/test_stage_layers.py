"""Stage layouts (--stage-layers): the blocks of each pipeline chunk given, not split evenly.

Training parity over stage layouts is in tests/test_pipeline.py (uneven, an embeddings-only first chunk, interleaved
with a head-only last chunk, ZeRO-3), their collectives in tests/test_schedule_collectives.py, loading a checkpoint
into one in tests/test_checkpoint.py, the refusals in tests/test_bad_inputs.py. Here: the split itself, the flag,
the executor's chunks, and what the simulator makes of a layout.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from cli.main import main
from cli.options.batch import stage_layers_value
from job.layout import Layout
from job.schedule import chunk_layers
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from minigpt.presets import preset
from simulator.engine.simulate import simulate_step
from simulator.memory import predict_memory
from simulator.network.topology import build_cluster

MODEL = GPTConfig(vocab_size=256, seq_len=32, n_layers=8, n_heads=4, d_model=32, d_ff=64)


def test_the_layout_places_the_blocks_in_chunk_order():
    assert chunk_layers(8, 4, (0, 3, 4, 1)) == [range(0, 0), range(0, 3), range(3, 7), range(7, 8)]
    assert chunk_layers(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]  # without one: the even split
    assert chunk_layers(8, 2, (8, 0)) == [range(0, 8), range(8, 8)]  # a last chunk with the head alone


@pytest.mark.parametrize("sizes,expected", [
    ((4, 4), "adds up to 8 blocks but the model has 9"),
    ((3, 3, 3), "gives 3 chunk(s) but pp x virtual chunks = 2"),
    ((9, 0, 0), "only the first chunk"),
    ((10, -1), "whole numbers of blocks >= 0"),
    ((4.5, 4.5), "whole numbers of blocks >= 0"),
])
def test_a_layout_that_does_not_fit_is_refused(sizes, expected):
    chunks = 3 if len(sizes) == 3 and expected.startswith("only") else 2
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        chunk_layers(9, chunks, sizes)


def test_the_flag_repeats_and_the_headline_folds_back():
    sizes = stage_layers_value(None, None, "4,4*14, 1")
    assert sizes == (4,) * 15 + (1,)
    assert stage_layers_value(None, None, None) == ()
    assert Layout(pp=16, stage_layers=sizes).placement == "4*15,1"
    assert Layout(pp=4, stage_layers=[7, 9, 9, 7]).stage_layers == (7, 9, 9, 7)  # any sequence, kept as a tuple
    assert Layout(pp=4).placement == ""
    with pytest.raises(ConfigError, match="repeats from 1"):
        stage_layers_value(None, None, "4*0")


def test_the_executor_holds_the_chunks_the_layout_gives():
    from minigpt.model import GPT
    from parallel.pipeline.executor import split_model

    held = [[len(chunk.blocks) for chunk in split_model(GPT(MODEL), 2, rank, 2, (0, 3, 4, 1)).chunks]
            for rank in range(2)]
    assert held == [[0, 4], [3, 1]]  # rank r holds chunks r and r + 2
    first = split_model(GPT(MODEL), 2, 0, 2, (0, 3, 4, 1)).chunks[0]
    assert first.first and hasattr(first, "tok_emb")  # the embeddings alone


def test_memory_per_stage_follows_the_layout():
    even = predict_memory(MODEL, Layout(pp=2), "fp32", 1)
    placed = predict_memory(MODEL, Layout(pp=2, stage_layers=(1, 7)), "fp32", 1)
    block = MODEL.block_params()
    assert [s.layers for s in placed.per_stage] == [1, 7]
    assert placed.per_stage[0].numel == even.per_stage[0].numel - 3 * block
    assert placed.per_stage[1].numel == even.per_stage[1].numel + 3 * block
    assert placed.stage == 1 and placed.total > even.total  # the heavier stage is the peak


def test_the_step_waits_for_the_busiest_stage():
    """Llama 3 8B on 4 stages: the last stage also runs the 128K-vocabulary head, so one block fewer there
    shortens the step; all but three blocks on one stage lengthens it."""
    model = preset("llama3-8b").with_(seq_len=4096)
    cluster = build_cluster("h100-sxm", 4, 1)

    def step(sizes: tuple[int, ...]) -> float:
        return simulate_step(model, Layout(pp=4, stage_layers=sizes), cluster, "bf16", 32, 1).step_time_s

    even = step(())
    assert step((8, 8, 9, 7)) < even
    assert step((29, 1, 1, 1)) > 2 * even


def test_simulate_shows_the_layout(tmp_path):
    result = CliRunner().invoke(main, ["simulate", "--model", "llama3-8b", "--pp", "4", "--gpu", "h100-sxm",
                                       "--stage-layers", "8*2,9,7", "--json"])
    assert result.exit_code == 0, result.output
    import json

    report = json.loads(result.stdout)
    assert report["layout"]["stage_layers"] == [8, 8, 9, 7]
    text = CliRunner().invoke(main, ["simulate", "--model", "llama3-8b", "--pp", "4", "--gpu", "h100-sxm",
                                     "--stage-layers", "8*2,9,7"])
    assert "(blocks per chunk 8*2,9,7)" in text.stdout
