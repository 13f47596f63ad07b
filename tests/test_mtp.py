"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437, 2.2): the objective against its definition, trained in
the layouts that run it against one process, refused where it does not run yet, and priced by the simulator.

Spawned worlds of 2, 4 and 8 ranks run the layouts of LAYOUTS (data, tensor with and without sequence parallelism,
pipeline, expert parallelism and ZeRO-3, and their products); their tp-group calls are checked against the
simulator's. The one-process references run here."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from cli.main import main
from distributed import one_thread, run_ranks
from job.exchange.context import backward_exchanges as context_backward, forward_exchanges as context_forward
from job.layout import Layout
from job.train_config import TrainConfig
from minigpt.config import GPTConfig
from minigpt.errors import ConfigError
from minigpt.model import GPT, IGNORED, NextTokenLoss, ahead, predict_ahead, prediction_loss
from minigpt.presets import preset
from parallel.run.train import train_on_rank
from parity import worst_gap
from precision.policy import policy as precision_policy
from simulator.costs.compute import chunk_times
from simulator.costs.tp_collectives import tp_collectives
from simulator.costs.hardware import load_hardware
from simulator.engine.simulate import simulate_step
from simulator.memory import predict_memory
from simulator.network.topology import build_cluster

DENSE = GPTConfig(vocab_size=256, seq_len=32, n_layers=2, n_heads=4, d_model=32, d_ff=64, mlp="swiglu",
                  norm="rmsnorm", positions="rope", bias=False, tied_head=False, mtp_depth=2, mtp_weight=0.3)
MOE = preset("tiny-moe").with_(seq_len=32, n_layers=2, router="sigmoid", expert_bias=True, expert_bias_rate=0.01,
                               mtp_depth=1)
BASE = TrainConfig(model=DENSE, steps=20, global_batch=8, micro_batches=2, eval_every=10, eval_batches=1,
                   device="cpu")
TOLERANCE = 1e-5
TIED = DENSE.with_(tied_head=True)
REFERENCES = {DENSE: "dense", MOE: "moe", TIED: "tied"}  # each model's one-process run
LAYOUTS = {
    2: {"dp2": (DENSE, dict(dp=2)), "dp2-zero3": (DENSE, dict(dp=2, zero=3)),
        "ep2-moe": (MOE, dict(dp=2, ep=2, zero=1)),
        # under pipelining the last stage's own copy of the embedding (untied), or the tied head's, summed with the
        # first stage's; zero-bubble's split backward; interleaved with the modules on the last virtual chunk
        "pp2": (DENSE, dict(pp=2)), "pp2-tied": (TIED, dict(pp=2)), "pp2-zb-h1": (DENSE, dict(pp=2, schedule="zb-h1")),
        "pp2-interleaved": (DENSE, dict(pp=2, schedule="interleaved", virtual_chunks=2, stage_layers=(0, 1, 1, 0))),
        # sequence parallelism: each module's embedded tokens cut to the rank's slice, its norms' and projection's
        # gradients summed over the group; a MoE module routing the rank's slice
        "tp2-sp": (DENSE, dict(tp=2, sequence_parallel=True)), "tp2-sp-moe": (MOE, dict(tp=2, sequence_parallel=True)),
        # context parallelism: the targets moved ahead over whole sequences before the cut, each depth's loss
        # weighed by the share of its positions a rank holds (the last k run past the sequence); ring and all-gather
        "cp2": (DENSE, dict(cp=2)), "cp2-moe": (MOE, dict(cp=2)), "cp2-allgather": (DENSE, dict(cp=2, cp_kind="allgather"))},
    4: {"ep2-dp4-zero3-shard2": (MOE, dict(dp=4, ep=2, zero=3, shard_group=2)),
        "pp2-dp2-zero3-tied": (TIED, dict(pp=2, dp=2, zero=3)), "pp2-ep2-moe": (MOE, dict(pp=2, dp=2, ep=2, zero=1)),
        # tensor parallelism: the modules' blocks split as the model's, the lookups and the loss vocabulary-parallel
        "tp2-dp2": (DENSE, dict(tp=2, dp=2)), "tp2-pp2-tied": (TIED, dict(tp=2, pp=2)),
        "tp2-pp2": (DENSE, dict(tp=2, pp=2)), "tp2-pp2-zb-h1": (DENSE, dict(tp=2, pp=2, schedule="zb-h1")),
        "tp2-sp-pp2-tied": (TIED, dict(tp=2, pp=2, sequence_parallel=True)),
        "cp2-pp2": (DENSE, dict(cp=2, pp=2)), "cp2-tp2-sp": (DENSE, dict(cp=2, tp=2, sequence_parallel=True)),
        "cp2-ep2-moe": (MOE, dict(cp=2, dp=2, ep=2, zero=1))},
    8: {"tp2-pp2-dp2-zero3": (DENSE, dict(tp=2, pp=2, dp=2, zero=3)),
        "tp2-ep2-pp2-moe": (MOE, dict(tp=2, pp=2, dp=2, ep=2, zero=1)),
        "cp2-tp2-pp2": (DENSE, dict(cp=2, tp=2, pp=2))},
}


def test_ahead_moves_the_targets_and_ignores_what_runs_past():
    targets = torch.tensor([[1, 2, 3, 4, 5]])
    assert ahead(targets, 0).tolist() == [[1, 2, 3, 4, 5]]
    assert ahead(targets, 1).tolist() == [[2, 3, 4, 5, IGNORED]]
    assert ahead(targets, 2).tolist() == [[3, 4, 5, IGNORED, IGNORED]]
    assert targets.tolist() == [[1, 2, 3, 4, 5]]  # not moved in place


def test_the_objective_is_the_papers():
    """L = L_main + lambda / D x sum_k L_k, L_k the mean cross-entropy of depth k's prediction of token i + k + 1
    over the positions that have one (T - k of them), computed here by slicing, not by ignoring."""
    torch.manual_seed(0)
    model = GPT(DENSE)
    idx, targets = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    hidden = model.norm_f(model.trunk(idx))
    expected = F.cross_entropy(model.head(hidden).flatten(0, 1), targets.flatten())
    depths = []
    for k, module in enumerate(model.mtp, start=1):
        tokens = torch.cat([targets[:, k - 1:], targets[:, :k - 1]], dim=1)  # t_{i+k} for i < T - k + 1
        hidden = module(hidden, model.tok_emb(tokens))
        logits = model.head(hidden)[:, :32 - k]
        depths.append(F.cross_entropy(logits.flatten(0, 1), targets[:, k:].flatten()))
    expected = expected + 0.3 / 2 * sum(depths)
    assert model.objective(idx, targets).item() == pytest.approx(expected.item(), rel=1e-6)
    assert model(idx, targets).item() < model.objective(idx, targets).item()  # the next-token loss alone


def test_the_executor_minimises_the_models_objective():
    """The pipeline executor's last chunk (one process: the whole model) returns the logits and each depth's; its
    objective is GPT.objective, its reported loss the next token's."""
    from parallel.pipeline.executor import split_model

    torch.manual_seed(0)
    model = GPT(DENSE)
    idx, targets = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    expected, plain = model.objective(idx, targets).item(), model(idx, targets).item()
    [chunk] = split_model(model, 1, 0, 1).chunks
    loss, objective = chunk.losses(chunk(idx, targets), targets)
    assert objective.item() == pytest.approx(expected, rel=1e-6) and loss.item() == pytest.approx(plain, rel=1e-6)
    assert chunk.losses(chunk(idx), targets)[1].item() == pytest.approx(plain, rel=1e-6)  # evaluation: no targets


@pytest.mark.parametrize("cp", [2, 4])
def test_the_pieces_objectives_average_to_the_whole_sequences(cp):
    """Context parallelism's ranks each hold two pieces of every sequence (parallel/context/chunks.py) and average
    their objectives: with every depth's targets moved over the whole sequences before the cut and each depth's loss
    weighed by the share of its positions a piece holds, the average is the whole sequences' objective; unweighed it
    is not (the positions that run past the sequence all sit in the last piece)."""
    from parallel.context.chunks import local_part

    torch.manual_seed(0)
    loss, depths, batch, seq = NextTokenLoss(), 3, 2, 32
    logits = [torch.randn(batch, seq, 256, dtype=torch.float64) for _ in range(1 + depths)]
    targets = torch.randint(0, 256, (batch, seq))
    whole = prediction_loss(loss, logits[0], logits[1:], targets, 0.3)[1]
    moved = torch.stack([ahead(targets, k) for k in range(1 + depths)])
    pieces = [[local_part(t, rank, cp, dim=1) for t in logits] for rank in range(cp)]
    weighed = sum(prediction_loss(loss, part[0], part[1:], local_part(moved, rank, cp, dim=2), 0.3, seq)[1]
                  for rank, part in enumerate(pieces)) / cp
    plain = sum(prediction_loss(loss, part[0], part[1:], local_part(moved, rank, cp, dim=2), 0.3)[1]
                for rank, part in enumerate(pieces)) / cp
    assert weighed.item() == pytest.approx(whole.item(), rel=1e-6)  # NextTokenLoss sums in fp32
    assert abs(plain.item() - whole.item()) > 1e-5 * whole.item(), (plain.item(), whole.item())  # 7e-5, 2.5e-4


def test_a_depth_never_sees_what_it_predicts():
    """Depth k's hidden state at position i reads tokens up to t_{i+k} only: changing the targets from position
    i + k on (t_{i+k+1} and later) leaves it."""
    torch.manual_seed(0)
    model = GPT(DENSE)
    idx, targets = torch.randint(0, 256, (1, 32)), torch.randint(0, 256, (1, 32))
    hidden, i = model.norm_f(model.trunk(idx)), 10
    for k in (1, 2):
        changed = targets.clone()
        changed[:, i + k:] = (targets[:, i + k:] + 1) % 256
        before = predict_ahead(model.mtp, model.tok_emb, hidden, targets)[k - 1]
        after = predict_ahead(model.mtp, model.tok_emb, hidden, changed)[k - 1]
        assert torch.equal(before[:, : i + 1], after[:, : i + 1])
        assert not torch.equal(before[:, i + 1:], after[:, i + 1:])


def test_parameters_are_counted_as_the_modules_hold_them():
    for config in (DENSE, MOE, preset("tiny-deepseek").with_(mtp_depth=1)):
        assert sum(p.numel() for p in GPT(config).parameters()) == config.n_params()
        assert config.n_params() == config.main_params() + config.mtp_params()
    v3 = preset("deepseek-v3").with_(mtp_depth=1)
    assert v3.main_params() == 671_026_404_352  # the published 671B
    assert v3.mtp_params() == 11_610_067_968  # the published 14B holds copies of the embedding and head (1.85B)


def run_layouts(world: int, out: str) -> dict:
    found = {}
    with one_thread():
        for name, (model, changes) in LAYOUTS[world].items():
            cfg = dataclasses.replace(BASE, model=model, out_dir=f"{out}/{name}", **changes)
            summary = train_on_rank(cfg, torch.device("cpu"))
            found[name] = None if summary is None else {"losses": summary["losses"], "grad_norms": summary["grad_norms"],
                                                        "reference": REFERENCES[model],
                                                        "tp": summary["comm_bytes_per_step"].get("tp", {}),
                                                        "cp": summary["comm_bytes_per_step"].get("cp", {})}
    return found


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp-reference")
    runs = {}
    with one_thread():
        for model, name in REFERENCES.items():
            summary = train_on_rank(dataclasses.replace(BASE, model=model, out_dir=f"{out}/{name}"),
                                    torch.device("cpu"))
            runs[name] = {"losses": summary["losses"], "grad_norms": summary["grad_norms"]}
    return runs


@pytest.fixture(scope="module", params=[2, 4, 8])
def layouts(request, tmp_path_factory):
    return run_ranks(request.param, run_layouts, request.param, str(tmp_path_factory.mktemp("mtp")))[0]


def test_every_layout_trains_as_one_process(layouts, references):
    for name, run in layouts.items():
        reference = references[run["reference"]]
        gap = worst_gap(run, reference)
        print(f"{name}: {gap}")
        assert len(run["losses"]) == 20 and gap.worst < TOLERANCE, (name, str(gap))


NAMED = {name: layout for layouts in LAYOUTS.values() for name, layout in layouts.items()}


def test_tensor_parallel_calls_are_the_simulators(layouts, tmp_path):
    """The last step's tp-group calls and bytes of each kind, with and without sequence parallelism, are
    simulator/costs/tp_collectives.py's tp_collectives for every micro-batch (layouts of one stage): the lookup once over
    every depth's tokens, the head once over every depth's hidden states, the loss's sums per depth, each module's
    block, and under sequence parallelism each module's scatter of its tokens and its norms' and projection's
    gradient sums (one more all-reduce of the step: the gradient norm's, one fp32 number)."""
    for name, run in layouts.items():
        model, changes = NAMED[name]
        if changes.get("tp", 1) == 1 or changes.get("pp", 1) > 1 or changes.get("ep", 1) > 1:
            continue
        cfg = dataclasses.replace(BASE, model=model, out_dir=str(tmp_path), **changes)
        micro_batch = cfg.global_batch // (cfg.micro_batches * cfg.dp)
        forward, backward = tp_collectives(model, model.n_layers, micro_batch, Layout.of(cfg),
                                           precision_policy(cfg.precision), True, True, moe_layers=model.n_moe_layers)
        expected = {"all_reduce": (1, 4)}  # the squared gradient norm's sum
        for c in forward + backward:
            calls, size = expected.get(c.kind, (0, 0))
            expected[c.kind] = (calls + c.calls * cfg.micro_batches, size + c.bytes * c.calls * cfg.micro_batches)
        assert {kind: (c["calls"], c["bytes"]) for kind, c in run["tp"].items()} == expected, name


def test_context_parallel_passes_are_the_schedules(layouts):
    """The ring's passes of keys and values and of their gradients on rank 0 (the first stage, tp rank 0) are
    job/exchange/context.py's for each of its blocks and micro-batches, the modules' blocks among them where the
    stage holds them (simulator/engine/costs.py's _exchanging_blocks)."""
    ring = {name: NAMED[name][1] for name in layouts
            if NAMED[name][1].get("cp", 1) > 1 and NAMED[name][0] is DENSE and "cp_kind" not in NAMED[name][1]}
    assert ring  # every world runs one
    for name, changes in ring.items():
        pp, tp = changes.get("pp", 1), changes.get("tp", 1)
        micro_batch = BASE.global_batch // BASE.micro_batches
        blocks = DENSE.n_layers // pp + (DENSE.mtp_depth if pp == 1 else 0)
        exchanges = context_forward(DENSE, tp, 2, "ring", micro_batch, 4) + context_backward(DENSE, tp, 2, "ring",
                                                                                           micro_batch, 4)
        calls = sum(exchange.calls * 2 for exchange in exchanges) * blocks * BASE.micro_batches
        sent = sum(exchange.calls * exchange.bytes for exchange in exchanges) * blocks * BASE.micro_batches
        assert {kind: (c["calls"], c["bytes"]) for kind, c in layouts[name]["cp"].items()} == {"send": (calls, sent)}


def test_the_objective_moves_the_modules(references, tmp_path):
    """Without the weight the modules still run (and are priced) but learn nothing: the next-token losses are those of
    a model without them; with it they differ."""
    with one_thread():
        plain = train_on_rank(dataclasses.replace(BASE, model=DENSE.with_(mtp_depth=0), out_dir=str(tmp_path / "p"),
                                                  steps=5), torch.device("cpu"))
        unweighted = train_on_rank(dataclasses.replace(BASE, model=DENSE.with_(mtp_weight=0.0),
                                                       out_dir=str(tmp_path / "u"), steps=5), torch.device("cpu"))
    assert unweighted["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-6)
    assert references["dense"]["losses"][:5] != pytest.approx(unweighted["losses"], rel=1e-4)


@pytest.mark.parametrize("args,expected", [
    (["--mtp-depth", "-1"], "mtp_depth must be a whole number"),
    (["--mtp-depth", "1", "--mtp-weight", "nan"], "mtp_weight must be a finite number"),
    (["--mtp-depth", "1", "--tied", "--pp", "2", "--schedule", "zb-h1"], "not yet trained with a tied head under --schedule zb-h1"),
])
def test_refusals_are_one_line(tmp_path, args, expected):
    result = CliRunner().invoke(main, ["train", "--model", "tiny-llama", "--steps", "1", "--out",
                                       str(tmp_path / "never"), *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert not (tmp_path / "never").exists()


def test_the_simulator_prices_the_modules_on_the_last_stage():
    """tiny-deepseek at pp 2: one module is one more MoE block, its projection, one more head and a copy of the
    embedding on the last stage (its gradient summed with the first stage's, as a tied head's); the first stage does
    not change; the FLOPs priced are the model's."""
    model = preset("tiny-deepseek")
    cluster = build_cluster("h100-sxm", 8, 1)
    layout = Layout(pp=2, dp=4, ep=4)
    without = simulate_step(model, layout, cluster, "bf16", 16, 1)
    with_one = simulate_step(model.with_(mtp_depth=1), layout, cluster, "bf16", 16, 1)
    assert with_one.step_time_s > without.step_time_s
    memory = [predict_memory(m, layout, "bf16", 1).per_stage for m in (model, model.with_(mtp_depth=1))]
    assert memory[1][0] == memory[0][0]  # the first stage holds none of it
    copy = model.vocab_size * model.d_model  # the last stage's own copy of the (untied) embedding, Megatron-style
    assert memory[1][1].numel == memory[0][1].numel + model.with_(mtp_depth=1).mtp_params() + copy \
        - model.expert_params() * model.n_experts * 3 // 4  # the module's routed experts split over ep 4
    assert memory[1][1].activations > memory[0][1].activations
    from job.data_parallel import schedule_config
    from job.schedule import SyncEmbedding, build_schedule

    synced = [any(isinstance(a, SyncEmbedding) for actions in build_schedule(
        schedule_config(m, Layout(pp=2), 2, "1f1b", 25.0, "bf16")).actions for a in actions)
        for m in (model, model.with_(mtp_depth=1))]
    assert synced == [False, True]  # the two copies' gradients summed before the optimizer step
    gpu = load_hardware("h100-sxm").gpu
    for m in (model, model.with_(mtp_depth=2)):
        whole = chunk_times(m, m.n_layers, 2, Layout(), gpu, "bf16", first=True, last=True, moe_layers=m.n_moe_layers)
        assert whole.forward_flops == m.forward_flops_per_token() * 2 * m.seq_len
        assert whole.backward_flops == (m.train_flops_per_token(attention="flash") - m.forward_flops_per_token()) \
            * 2 * m.seq_len


def test_the_shape_is_checked():
    with pytest.raises(ConfigError, match="mtp_depth"):
        DENSE.with_(mtp_depth=32)
    with pytest.raises(ConfigError, match="mtp_weight"):
        DENSE.with_(mtp_weight=-0.1)


def test_a_checkpoint_holds_the_modules_and_resumes_exactly(tmp_path):
    """The module's parameters and its MoE's choice bias (a buffer) are saved under the plain model's names, a run
    loaded from them goes on to the bit, and `minigpt export`'s plain model holds them."""
    from minigpt.data import Corpus
    from parallel.checkpoint.layout import stage_buffers
    from parallel.checkpoint.sharded import load_checkpoint, save_checkpoint
    from parallel.run.sample import load_model
    from test_checkpoint import new_rank, train

    cfg = dataclasses.replace(BASE, model=MOE)
    corpus = Corpus.load(None, MOE.seq_len)
    with one_thread():
        rank = new_rank(cfg)
        train(rank, cfg, corpus, range(3))
        path = save_checkpoint(str(tmp_path / "run"), rank, cfg, 3)
        bias = stage_buffers(rank.stage)["mtp.0.block.mlp.expert_bias"].clone()
        reference = train(rank, cfg, corpus, range(3, 5))
        resumed = new_rank(cfg)
        step = load_checkpoint(path, resumed, cfg)["step"]
        assert train(resumed, cfg, corpus, range(step, step + 2)) == reference
    assert bias.max() > bias.min()  # moved by 3 steps' loads
    plain, _ = load_model(path)
    assert plain.config.mtp_depth == 1 and torch.equal(plain.get_buffer("mtp.0.block.mlp.expert_bias"), bias)
    loaded = new_rank(cfg)
    load_checkpoint(path, loaded, cfg)
    held = dict(loaded.stage.named_parameters())
    names = [name for name, _ in plain.named_parameters() if name.startswith("mtp.")]
    assert names == [name for name, _ in GPT(MOE).named_parameters() if name.startswith("mtp.")]
    for name in names:
        assert torch.equal(plain.get_parameter(name), held[f"chunks.0.{name}"].float()), name


def test_deepseeks_layout_holds_the_modules_both_ways(tmp_path):
    """Module k is DeepSeek-V3's layer n_layers + k, with its checkpoints' copies of the embedding and head; read
    back, every tensor and the choice bias is ours to the bit. A checkpoint without the layer (transformers' own
    DeepSeek-V3 drops it while its config.json counts it) is read without modules."""
    from minigpt.hf.files import check_hf_dir, headers, read_hf_dir, weight_files, write_hf_dir

    config = preset("tiny-deepseek").with_(mtp_depth=1)
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for layer in model.modules():
            if hasattr(layer, "expert_bias"):
                layer.expert_bias.normal_()
    state = model.state_dict()
    write_hf_dir(state, config, tmp_path / "with")
    found = headers(weight_files(tmp_path / "with"))
    at = f"model.layers.{config.n_layers}."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
                 "shared_head.head.weight", "self_attn.kv_a_layernorm.weight", "mlp.gate.weight",
                 "mlp.gate.e_score_correction_bias", "mlp.experts.0.gate_proj.weight"):
        assert at + name in found, name
    read = check_hf_dir(tmp_path / "with")
    training = dict(mtp_weight=read.mtp_weight, aux_loss_coef=read.aux_loss_coef, expert_bias_rate=read.expert_bias_rate)
    assert read == config.with_(**training)  # the loss weights and the bias's rate are training's, not the weights'
    assert read.mtp_depth == 1
    back = read_hf_dir(tmp_path / "with", read)
    for name, tensor in state.items():
        if name in back:
            assert torch.equal(back[name], tensor.float()), name
    assert {name for name in state if name.startswith("mtp.")} <= set(back)
    plain = preset("tiny-deepseek")
    write_hf_dir(GPT(plain).state_dict(), plain, tmp_path / "without")
    config_json = tmp_path / "without" / "config.json"
    config_json.write_text(config_json.read_text().replace('"num_nextn_predict_layers": 0', '"num_nextn_predict_layers": 1'))
    assert check_hf_dir(tmp_path / "without").mtp_depth == 0


def test_only_deepseeks_and_glms_layouts_hold_them(tmp_path):
    result = CliRunner().invoke(main, ["train", "--model", "tiny-llama", "--mtp-depth", "1", "--steps", "1",
                                       "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    exported = CliRunner().invoke(main, ["export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")])
    assert exported.exit_code == 2 and "DeepSeek-V3's or GLM-4.5's layout" in exported.stderr, exported.output
    assert not (tmp_path / "hf").exists()
