"""simulator/memory.py: predicted bytes per GPU, checked against config.py, the precision policy, hand counts and torch."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from minigpt.config import GPTConfig
from minigpt.presets import preset
from minigpt.errors import ConfigError
from precision.policy import policy
from simulator.costs.hardware import load_hardware
from job.layout import Layout, padded_vocab, stage_units
from simulator.memory import layer_activation_bytes, predict_memory
from simulator.states import MAX_IN_FLIGHT

FP32 = 4


def loss_gradients(model: GPTConfig, tp: int, tokens: int) -> int:
    """What our executor's loss holds at its peak beside its saved log-probabilities, per logit (measured in
    tests/test_loss_memory.py): torch's cross entropy two fp32 gradients; under tp our VocabParallelCrossEntropy, whose
    backward works in place, its forward's fp32 logits."""
    return tokens * padded_vocab(model, tp) // tp * (2 if tp == 1 else 1) * FP32

TINY = GPTConfig(vocab_size=256, seq_len=32, n_layers=2, n_heads=4, d_model=64, d_ff=128)
TINY_LLAMA = preset("tiny-llama").with_(seq_len=32, n_layers=2)  # 4 heads, 2 kv heads, SwiGLU 352, no biases, untied
ROLES = {"parameters": "compute", "gradients": "grad", "master_weights": "master", "adam_m": "adam_m", "adam_v": "adam_v"}


def test_simulator_modules_do_not_import_torch():
    code = "import sys, job.layout, simulator.memory, simulator.costs.compute; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def by_hand(model: GPTConfig, tp: int) -> int:
    """Parameters one tensor-parallel rank holds (one pipeline stage), from the rules of parallel/tensor/parallelize.py."""
    d, f, s = model.d_model, model.d_ff, model.seq_len
    vocab = -(-model.vocab_size // tp) * tp
    block = 4 * d + (3 * d * d + 3 * d) // tp + d * d // tp + d + (d * f + f) // tp + f * d // tp + d
    head = 0 if model.tied_head else vocab // tp * d
    return vocab // tp * d + s * d + model.n_layers * block + 2 * d + head


@pytest.mark.parametrize("model", [TINY, TINY.with_(tied_head=False), TINY.with_(vocab_size=259)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parameters_per_rank_by_hand(model, tp):
    estimate = predict_memory(model, Layout(tp=tp), "fp32", 1)
    assert estimate.parameters == 4 * by_hand(model, tp)
    assert estimate.per_stage[0].numel == by_hand(model, tp)
    if tp == 1:
        assert by_hand(model, 1) == model.n_params()


def by_hand_llama(model: GPTConfig, tp: int) -> int:
    """The same for a Llama shape: RMSNorm gains, no biases, qkv (a + 2K) head_dim wide, fc1 2f wide, no position
    embedding, an untied head with its own padded vocabulary."""
    d, f, hd = model.d_model, model.d_ff, model.head_dim
    vocab = -(-model.vocab_size // tp) * tp
    block = 2 * d + d * (model.n_heads + 2 * model.kv_heads) * hd // tp + d * d // tp + d * 2 * f // tp + f * d // tp
    return vocab // tp * d + model.n_layers * block + d + vocab // tp * d


@pytest.mark.parametrize("model", [TINY_LLAMA, TINY_LLAMA.with_(vocab_size=259)])
@pytest.mark.parametrize("tp", [1, 2])
def test_llama_parameters_per_rank_by_hand(model, tp):
    estimate = predict_memory(model, Layout(tp=tp), "fp32", 1)
    held = by_hand_llama(model, tp)
    assert estimate.parameters == 4 * held and estimate.per_stage[0].numel == held
    if tp == 1:
        assert by_hand_llama(model, 1) == model.n_params()


def test_parameters_and_buckets_match_torch():
    """The real modules, made tensor-parallel (parallelize reads only size and rank while it builds) and flattened."""
    from minigpt.model import GPT
    from parallel.tensor.parallelize import parallelize
    from parallel.data.zero import MAX_IN_FLIGHT as ZERO_MAX_IN_FLIGHT
    from parallel.data.zero3 import units_of
    from precision.flat import FlatParameters

    assert MAX_IN_FLIGHT == ZERO_MAX_IN_FLIGHT
    bucket_mb = 0.01
    for model in (TINY, TINY.with_(vocab_size=259, tied_head=False), TINY_LLAMA, TINY_LLAMA.with_(qkv_bias=True)):
        for tp in (1, 2, 4) if model.kv_heads % 4 == 0 else (1, 2):
            for sequence_parallel in (False, True):
                gpt = GPT(model)
                parallelize(gpt, SimpleNamespace(size=tp, rank=0), sequence_parallel)
                held = sum(p.numel() for p in gpt.parameters())
                for dp in (1, 3):
                    layout = Layout(tp=tp, dp=dp, sequence_parallel=sequence_parallel)
                    estimate = predict_memory(model, layout, "fp32", 1, bucket_mb=bucket_mb)
                    assert estimate.per_stage[0].numel == held
                    flat = FlatParameters(gpt, bucket_numel=int(bucket_mb * 2**20) // 4, pad_to=dp, grads=False)
                    assert estimate.parameters == 4 * flat.padded_numel
                    if dp > 1:
                        zero3 = predict_memory(model, Layout(tp=tp, dp=dp, zero=3), "fp32", 1)
                        seen, units = set(), []
                        for _, modules in units_of(gpt):
                            named = [(n, p) for m in modules for n, p in m.named_parameters() if id(p) not in seen]
                            seen.update(id(p) for _, p in named)
                            units.append(FlatParameters(named, pad_to=dp, grads=False).padded_numel // dp)
                        assert zero3.parameters == 4 * sum(units)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
def test_single_process_equals_policy_bytes_per_param(precision):
    estimate = predict_memory(TINY, Layout(), precision, 1)
    per_param = policy(precision).bytes_per_param()
    for category, role in ROLES.items():
        assert getattr(estimate, category) == per_param[role] * TINY.n_params()
    assert estimate.comm_buffers == 0 and estimate.fits is None and estimate.capacity is None


def test_zero_stages_shard_what_they_promise():
    model, dp = preset("gpt2-124m"), 8
    stage = [predict_memory(model, Layout(dp=dp, zero=zero), "bf16", 1) for zero in range(4)]
    full = stage[0]
    assert stage[1].parameters == stage[2].parameters == full.parameters
    assert stage[1].gradients == full.gradients
    for estimate in stage[1:]:
        assert estimate.adam_m == pytest.approx(full.adam_m / dp, rel=1e-3)
        assert estimate.master_weights == pytest.approx(full.master_weights / dp, rel=1e-3)
    assert stage[2].gradients == pytest.approx(full.gradients / dp, rel=1e-3)
    assert stage[3].model_states == pytest.approx(full.model_states / dp, rel=1e-3)
    assert 0 == stage[0].comm_buffers < stage[1].comm_buffers < stage[2].comm_buffers
    assert {e.activations for e in stage} == {full.activations}  # data parallelism leaves activations alone
    alone = predict_memory(model, Layout(dp=1, zero=3), "bf16", 1)
    assert alone.model_states == predict_memory(model, Layout(), "bf16", 1).model_states
    assert any("stage 0" in note for note in alone.notes)


def test_buckets_are_padded_to_the_data_parallel_size():
    padded = predict_memory(TINY, Layout(dp=7), "fp32", 1, bucket_mb=0.01)
    tensors = 2 + 12 * TINY.n_layers + 2  # at most one bucket per tensor, each padded by at most 6 elements
    assert TINY.n_params() * 4 < padded.parameters <= (TINY.n_params() + 6 * tensors) * 4
    assert padded.parameters % (7 * 4) == 0  # every bucket is a multiple of 7 elements
    one_bucket = predict_memory(TINY, Layout(dp=7), "fp32", 1, bucket_mb=100)
    assert one_bucket.parameters == -(-TINY.n_params() // 7) * 7 * 4


@pytest.mark.parametrize("model", [TINY, TINY_LLAMA, preset("tiny-llama"), preset("llama3-8b")],
                         ids=["tiny", "tiny-llama-32", "tiny-llama", "llama3-8b"])
def test_activations_without_tensor_parallelism_equal_config(model):
    batch, tokens = 3, 3 * model.seq_len
    for precision, dtype_bytes in (("fp32", 4), ("bf16", 2)):
        for recompute in ("none", "selective", "full"):
            estimate = predict_memory(model, Layout(), precision, batch, recompute=recompute)
            kept = model.activation_bytes_per_token_per_layer(dtype_bytes, recompute)
            expected = kept * tokens * model.n_layers + model.head_activation_bytes_per_token(dtype_bytes) * tokens
            # one block is recomputed at a time: what it rebuilds is alive beside what it kept
            rebuilt = model.activation_bytes_per_token_per_layer(dtype_bytes) - kept
            if recompute == "selective" and model.positions == "rope":  # the rotated copy, beside the kept input
                rebuilt += model.qkv_width * dtype_bytes
            expected += rebuilt * tokens
            expected += loss_gradients(model, 1, tokens)  # one micro-batch's loss backward at a time
            assert estimate.activations == expected
    twice = predict_memory(model, Layout(), "bf16", batch, micro_batches_in_flight=2)
    once, loss = predict_memory(model, Layout(), "bf16", batch).activations, loss_gradients(model, 1, tokens)
    assert twice.activations == 2 * (once - loss) + loss


def test_activations_under_tensor_and_sequence_parallelism():
    model = TINY.with_(dropout=0.1)
    d, f, h, b, tokens = model.d_model, model.d_ff, model.n_heads, 2, 2 * model.seq_len
    bf16 = policy("bf16")
    for tp in (2, 4):
        split = (3 * d + d + 2 * f) * b + 4 * h  # q, k, v, attention output, GELU in/out, log-sum-exp
        replicated = 2 * d * b  # the LayerNorm outputs that qkv and fc1 save (gathered under sequence parallelism)
        sequence = 2 * d * b + 4 * 4 + 2 * d  # LayerNorm inputs, their statistics, dropout masks
        plain = layer_activation_bytes(model, Layout(tp=tp), bf16, 1)
        assert plain == tokens // 2 * (split // tp + replicated + sequence)
        sp = layer_activation_bytes(model, Layout(tp=tp, sequence_parallel=True), bf16, 1)
        assert sp == tokens // 2 * (split // tp + replicated + sequence // tp)
        assert model.activation_bytes_per_token_per_layer(b) * tokens // 2 > plain > sp
    padded = model.with_(vocab_size=259)  # the loss keeps fp32 log-probabilities for 260 / tp padded ids
    for sequence_parallel in (False, True):
        layout = Layout(tp=2, sequence_parallel=sequence_parallel)
        estimate = predict_memory(padded, layout, "bf16", 1)
        ends = estimate.activations - padded.n_layers * layer_activation_bytes(padded, layout, bf16, 1)
        sequence = (d * b + 2 * 4) // (2 if sequence_parallel else 1)  # final LayerNorm input and statistics
        embedding_mask = d  # the embeddings' dropout mask (before the sequence is split), 1 byte per element
        assert ends == tokens // 2 * (sequence + d * b + 4 * 260 // 2 + embedding_mask) + loss_gradients(padded, 2,
                                                                                                          tokens // 2)
    # fp8 Linears save their inputs in e4m3 (1 byte, not 2), the attention output once more in e4m3, and their
    # weights in e4m3 once per micro-batch: more bytes for a tiny model, fewer once the tokens dominate.
    d, f, tokens = TINY.d_model, TINY.d_ff, 8 * TINY.seq_len
    matrices = 3 * d * d + d * d + 2 * d * f
    fp8, plain = (layer_activation_bytes(TINY, Layout(), p, 8) for p in (policy("fp8"), bf16))
    assert fp8 == plain - tokens * (2 * d + f) + tokens * d + matrices
    assert fp8 < plain
    assert layer_activation_bytes(TINY, Layout(), policy("fp8"), 1) > layer_activation_bytes(TINY, Layout(), bf16, 1)


def test_llama_activations_under_tensor_and_sequence_parallelism():
    model, b, tp = TINY_LLAMA, 2, 2
    d, f, tokens = model.d_model, model.d_ff, 2 * model.seq_len
    bf16 = policy("bf16")
    split = (model.qkv_width + d + 4 * f) * b + 4 * model.n_heads  # qkv (rotated), attention output, SwiGLU, lse
    replicated = 2 * d * b  # the norm outputs that qkv and fc1 save (gathered under sequence parallelism)
    sequence = 2 * d * b + 2 * 4  # the norm inputs and one fp32 1/rms each
    assert layer_activation_bytes(model, Layout(tp=tp), bf16, 1) == tokens // 2 * (split // tp + replicated + sequence)
    sp = layer_activation_bytes(model, Layout(tp=tp, sequence_parallel=True), bf16, 1)
    assert sp == tokens // 2 * (split // tp + replicated + sequence // tp)
    estimate = predict_memory(model, Layout(tp=tp, sequence_parallel=True), "bf16", 1)
    ends = estimate.activations - model.n_layers * sp
    assert ends == tokens // 2 * ((d * b + 4) // tp + d * b + 4 * model.vocab_size // tp) + loss_gradients(
        model, tp, tokens // 2)  # no embedding mask


def test_pipeline_stages():
    model = TINY.with_(n_layers=5)
    estimate = predict_memory(model, Layout(pp=2), "fp32", 1, micro_batches_in_flight=[2, 1])
    first, last = estimate.per_stage
    assert (first.layers, last.layers) == (3, 2)  # the first stages take the extra layers
    block, embedding = model.block_params(), model.embedding_params()
    assert first.numel == embedding + 3 * block
    assert last.numel == 2 * block + model.head_params() + model.vocab_size * model.d_model  # the tied copy
    assert any("copy of the embedding" in note for note in estimate.notes)
    assert estimate.stage == 0 and estimate.total == first.total
    untied = predict_memory(model.with_(tied_head=False), Layout(pp=2), "fp32", 1)
    assert untied.per_stage[1].numel == last.numel and not untied.notes
    units = stage_units(model, Layout(pp=2, virtual_chunks=2))  # rank 0 holds chunks 0 and 2
    assert [len(chunk) for chunk in units[0]] == [1 + 2, 1] and [len(chunk) for chunk in units[1]] == [1, 1 + 1]


def test_interleaving_holds_the_heads_activations_for_its_own_chunk_only():
    """With virtual chunks the last rank keeps the head's logits for the micro-batches in flight in the last chunk
    (one: its backward follows its forward), not for every chunk it has in flight; the blocks' share is unchanged.
    simulate_step charges what its schedule says (job/schedule.py's peak_ends_in_flight)."""
    from job.schedule import ScheduleConfig, build_schedule, peak_ends_in_flight, peak_in_flight
    from simulator.engine.simulate import simulate_step
    from simulator.network.topology import build_cluster

    model = TINY.with_(n_layers=8, vocab_size=4096, dropout=0.1)  # dropout: the embedding keeps its mask
    layout = Layout(pp=2, dp=2, virtual_chunks=2)
    schedule = build_schedule(ScheduleConfig(2, 8, "interleaved", 2))
    in_flight, ends = peak_in_flight(schedule), peak_ends_in_flight(schedule)
    assert in_flight == [5, 3] and ends == [(4, 0), (0, 1)]
    upper = predict_memory(model, layout, "fp32", 1, micro_batches_in_flight=in_flight)
    charged = predict_memory(model, layout, "fp32", 1, micro_batches_in_flight=in_flight, ends_in_flight=ends)
    twice = predict_memory(model, layout, "fp32", 1, micro_batches_in_flight=in_flight, ends_in_flight=[(4, 0), (0, 2)])
    head = twice.per_stage[1].activations - charged.per_stage[1].activations  # one micro-batch's head and loss
    assert head > 4 * 4096 * 32 // 2  # at least the logits, fp32
    assert upper.per_stage[1].activations - charged.per_stage[1].activations == (3 - 1) * head
    embedding = predict_memory(model, layout, "fp32", 1, micro_batches_in_flight=in_flight,
                               ends_in_flight=[(5, 0), (0, 1)]).per_stage[0].activations
    assert upper.per_stage[0].activations == embedding > charged.per_stage[0].activations
    result = simulate_step(model, layout, build_cluster("h100-sxm", 4, 1), "fp32", 16, 1, "interleaved", 2)
    assert result.memory.per_stage == charged.per_stage
    with pytest.raises(ConfigError, match="ends_in_flight"):
        predict_memory(model, layout, "fp32", 1, micro_batches_in_flight=in_flight, ends_in_flight=[(6, 0), (0, 1)])


def test_gpt3_175b_on_a100_80gb():
    gpu = load_hardware("a100-80gb").gpu
    model, layout = preset("gpt3-175b"), Layout(tp=8, pp=16, dp=8, zero=1)
    in_flight = [16 - rank for rank in range(16)]  # 1F1B: rank r holds pp - r micro-batches
    estimate = predict_memory(model, layout, "bf16", 1, gpu=gpu, micro_batches_in_flight=in_flight)
    gib = 2**30
    assert estimate.parameters == pytest.approx(2 * model.n_params() / (8 * 16), rel=0.1)
    assert estimate.master_weights + estimate.adam_m + estimate.adam_v == pytest.approx(12 * estimate.parameters / 2 / 8, rel=1e-3)
    assert 15 * gib < estimate.total < 60 * gib and estimate.fits and estimate.capacity == gpu.hbm_bytes
    assert estimate.stage == 0 and len(estimate.per_stage) == 16
    assert estimate.as_dict()["fits"] is True
    alone = predict_memory(model, Layout(), "bf16", 1, gpu=gpu)
    assert alone.fits is False and alone.total > 16 * model.n_params()


@pytest.mark.parametrize(
    "call",
    [
        lambda: Layout(tp=0),
        lambda: Layout(zero=4),
        lambda: predict_memory(TINY, Layout(tp=3), "fp32", 1),
        lambda: predict_memory(TINY, Layout(pp=3), "fp32", 1),
        lambda: predict_memory(TINY.with_(seq_len=30), Layout(tp=4, sequence_parallel=True), "fp32", 1),
        lambda: predict_memory(TINY, Layout(), "fp64", 1),
        lambda: predict_memory(TINY, Layout(), "fp32", 0),
        lambda: predict_memory(TINY, Layout(), "fp32", 1, recompute="half"),
        lambda: predict_memory(TINY, Layout(), "fp32", 1, bucket_mb=0),
        lambda: predict_memory(TINY, Layout(pp=2), "fp32", 1, micro_batches_in_flight=[1]),
    ],
)
def test_bad_input_raises_config_error(call):
    with pytest.raises(ConfigError):
        call()
