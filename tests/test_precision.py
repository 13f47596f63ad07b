"""The precision policy wired into a model: compute paths, flat buffers, master AdamW, loss scaling."""

import copy

import pytest
import torch
import torch.nn.functional as F

from minigpt.config import GPTConfig
from minigpt.model import GPT
from precision.compute import EmulatedLinear, apply_precision
from precision.experiments import experiment_master_weights
from precision.formats import FORMATS
from precision.fp8 import Fp8Linear
from precision.flat import FlatParameters
from precision.optimizer import MasterAdamW, state_bytes
from precision.policy import FORMAT_BYTES, POLICIES, policy
from precision.scaler import LossScaler

CFG = GPTConfig(vocab_size=256, seq_len=16, n_layers=2, n_heads=2, d_model=32, d_ff=64)
CPU = torch.device("cpu")


def batch(seed=0, size=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (size, CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def test_format_bytes_agree_with_torch():
    for name, dtype in FORMATS.items():
        assert FORMAT_BYTES[name] == dtype.itemsize


def test_master_adamw_matches_torch_adamw_in_fp32():
    torch.manual_seed(0)
    ours, reference = GPT(CFG), GPT(CFG)
    reference.load_state_dict(ours.state_dict())
    flat = FlatParameters(ours)
    optimizer = MasterAdamW.for_flat(flat, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, masters_are_weights=True)
    decay = [p for p in reference.parameters() if p.dim() >= 2]
    no_decay = [p for p in reference.parameters() if p.dim() < 2]
    torch_adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95),
    )
    for step in range(5):
        x, y = batch(step)
        flat.zero_grad()
        ours(x, y).backward()
        optimizer.step(flat.grad, grad_clip=0.5)
        torch_adamw.zero_grad()
        reference(x, y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        torch_adamw.step()
    # atol: the key bias has a zero true gradient, so Adam amplifies rounding noise
    # (ours sums squares in one flat buffer, torch per tensor) to ~1e-5 there.
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)
    x, y = batch(99)
    torch.testing.assert_close(ours(x, y), reference(x, y), rtol=1e-6, atol=0)


def test_flat_buffers_hold_parameters_and_accumulate_gradients():
    model = GPT(CFG)
    flat = FlatParameters(model)
    assert flat.numel == CFG.n_params()  # the tied head is stored once
    assert model.head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    x, y = batch()
    model(x, y).backward()
    once = flat.grad.clone()
    model(x, y).backward()
    torch.testing.assert_close(flat.grad, 2 * once)
    assert model.blocks[0].mlp.fc1.weight.grad.data_ptr() >= flat.grad.data_ptr()


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_emulated_linear_rounds_like_a_tensor_core(name):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
    linear = torch.nn.Linear(48, 24).to(dtype)
    emulated = EmulatedLinear(linear)
    x = torch.randn(5, 7, 48).to(dtype).requires_grad_()
    out = emulated(x)
    expected = F.linear(x.float(), linear.weight.float(), linear.bias.float()).to(dtype)
    assert out.dtype == dtype and torch.equal(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected_wgrad = (grad.float().reshape(-1, 24).t() @ x.detach().float().reshape(-1, 48)).to(dtype)
    assert torch.equal(linear.weight.grad, expected_wgrad)
    assert torch.equal(x.grad, (grad.float() @ linear.weight.float()).to(dtype))


def test_apply_precision_swaps_modules_from_outside():
    reference = GPT(CFG)  # the same weights, all fp32
    model = apply_precision(copy.deepcopy(reference), policy("fp8"), CPU)
    block = model.blocks[0]
    assert isinstance(block.attn.qkv, Fp8Linear) and isinstance(block.mlp.fc2, Fp8Linear)
    assert isinstance(model.head, EmulatedLinear)  # the head stays 16-bit
    assert model.tok_emb.weight.dtype == torch.bfloat16
    x, y = batch()
    loss, expected = model(x, y), reference(x, y)
    loss.backward()
    expected.backward()
    # An untrained model predicts about uniformly (ln 256 = 5.55); fp8 rounding moves that loss by far less than 0.01,
    # and its gradients (e4m3 forward, e5m2 backward: 3 and 2 mantissa bits) stay within 20% of fp32's.
    assert loss.item() == pytest.approx(expected.item(), abs=0.01) and expected.item() == pytest.approx(5.545, abs=0.1)
    grad, grad32 = block.mlp.fc1.weight.grad.float(), reference.blocks[0].mlp.fc1.weight.grad
    assert ((grad - grad32).norm() / grad32.norm()).item() < 0.2


@pytest.mark.parametrize("name", list(POLICIES))
def test_measured_bytes_per_parameter_equal_the_policy(name):
    p = policy(name)
    model = apply_precision(GPT(CFG), p, CPU)
    flat = FlatParameters(model)
    optimizer = MasterAdamW.for_flat(flat, masters_are_weights=p.master is None)
    x, y = batch()
    model(x, y).backward()
    optimizer.step(flat.grad)
    owned = {"compute": flat.data, "grad": flat.grad}
    measured = {role: t.numel() * t.element_size() / flat.numel for role, t in owned.items()}
    measured.update({role: b / flat.numel for role, b in state_bytes(optimizer).items()})
    measured.setdefault("master", 0.0)
    assert measured == {role: float(b) for role, b in p.bytes_per_param().items()}
    assert sum(measured.values()) == 16  # mixed precision does not shrink the model states


def test_overflow_skips_the_step_bit_for_bit_then_the_scale_grows():
    torch.manual_seed(0)
    model = apply_precision(GPT(CFG), policy("fp16"), CPU)
    flat = FlatParameters(model)
    optimizer = MasterAdamW.for_flat(flat, lr=1e-3)
    scaler = LossScaler(init_scale=2.0**10, growth_interval=3)

    def backward(seed):
        flat.zero_grad()
        x, y = batch(seed)
        scaler.scale_loss(model(x, y)).backward()

    backward(0)
    assert not optimizer.step(flat.grad, scaler=scaler).skipped  # one clean step so the states are non-zero
    before = {
        "weights": flat.data.clone(),
        "masters": optimizer.masters.clone(),
        "m": optimizer.exp_avg.clone(),
        "v": optimizer.exp_avg_sq.clone(),
    }
    backward(1)
    model.blocks[1].mlp.fc1.weight.grad[3, 5] = float("inf")
    result = optimizer.step(flat.grad, scaler=scaler)
    assert result.skipped and scaler.scale == 2.0**9 and scaler.skipped_steps == 1
    assert torch.equal(flat.data, before["weights"])
    assert torch.equal(optimizer.masters, before["masters"])
    assert torch.equal(optimizer.exp_avg, before["m"]) and torch.equal(optimizer.exp_avg_sq, before["v"])
    assert optimizer.steps == 1
    for seed in range(2, 5):
        backward(seed)
        assert not optimizer.step(flat.grad, scaler=scaler).skipped
    assert scaler.scale == 2.0**10  # grew again after three clean steps
    assert not torch.equal(flat.data, before["weights"])


def test_pure_fp16_weights_stall_where_masters_learn():
    result = experiment_master_weights(steps=150)
    pure, master = result["pure_fp16"], result["fp32_master"]
    assert pure["gain_moved"] == 0.0  # every update rounded away
    assert pure["loss_ratio"] > 0.95
    assert master["gain_moved"] > 0.01
    assert master["loss_ratio"] < 0.5


def test_fp16_training_step_survives_through_the_scaler():
    model = apply_precision(GPT(CFG), policy("fp16"), CPU)
    flat = FlatParameters(model)
    optimizer = MasterAdamW.for_flat(flat, lr=1e-2)
    scaler = LossScaler()
    losses = []
    for step in range(8):
        flat.zero_grad()
        x, y = batch(0)
        loss = model(x, y)
        scaler.scale_loss(loss).backward()
        optimizer.step(flat.grad, scaler=scaler)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
