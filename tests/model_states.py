"""The model states a training rank holds against the simulator's prediction of them, byte for byte: the helpers the
layout tests share (test_moe_training.py, test_gpt_oss.py, test_gemma.py, test_olmo2.py)."""

from __future__ import annotations

from job.layout import Layout
from minigpt.data import Corpus
from precision.optimizer import state_bytes
from simulator.costs.implementation import Implementation
from simulator.memory import predict_memory


def trained_with_states(cfg, logs: tuple[str, ...] = ()) -> dict:
    """cfg.steps on this rank (test_llama_parallel's train_history: its losses and gradient norms), the model states it
    holds and its pipeline stage, and the last step's calls of each group in `logs` ("tp": under "tp_log")."""
    from test_checkpoint import new_rank
    from test_llama_parallel import train_history

    rank = new_rank(cfg)
    found = train_history(rank, cfg, Corpus.load(None, cfg.model.seq_len))
    found["states"], found["stage"] = held_states(rank), rank.mesh.pp_rank
    return found | {f"{group}_log": list(rank.comms[group].log) for group in logs}


def held_states(rank) -> dict:
    """The bytes a rank holds of its weights and gradients (its data-parallel buffers), masters and AdamW moments."""
    held, states = rank.data_parallel.memory(), state_bytes(rank.optimizer)
    return {"parameters": held["parameters"], "gradients": held["gradients"], "master_weights": states.get("master", 0),
            "adam_m": states["adam_m"], "adam_v": states["adam_v"]}


def predicted_states(cfg, stage: int) -> dict:
    """The same bytes as simulator/memory.py predicts them for pipeline stage `stage` of the run `cfg`."""
    estimate = predict_memory(cfg.model, Layout.of(cfg), cfg.precision, cfg.global_batch // (cfg.micro_batches * cfg.dp),
                              bucket_mb=cfg.bucket_mb, micro_batches=cfg.micro_batches,
                              implementation=Implementation(optimizer=cfg.optimizer))
    predicted = estimate.per_stage[stage]
    return {key: getattr(predicted, key) for key in ("parameters", "gradients", "master_weights", "adam_m", "adam_v")}
