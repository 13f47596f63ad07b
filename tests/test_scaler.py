"""precision/scaler.py: static and dynamic loss scaling."""

import json

import pytest
import torch

from minigpt.errors import ConfigError
from precision.scaler import LossScaler


def _run(scaler: LossScaler, outcomes: str) -> list[bool]:
    """Feed a string of steps: 'o' = overflow, '.' = clean. Returns the skip decisions."""
    return [scaler.update(step == "o") for step in outcomes]


def test_defaults():
    scaler = LossScaler()
    assert scaler.scale == 2.0**16 and scaler.dynamic
    assert (scaler.growth_factor, scaler.backoff_factor) == (2.0, 0.5)
    assert (scaler.growth_interval, scaler.hysteresis, scaler.min_scale) == (1000, 1, 1.0)


def test_scale_loss_multiplies_by_scale():
    scaler = LossScaler(init_scale=8.0)
    assert scaler.scale_loss(torch.tensor(1.5)).item() == 12.0


def test_overflow_halves_scale_and_skips():
    scaler = LossScaler(init_scale=1024.0)
    assert _run(scaler, "o") == [True]
    assert scaler.scale == 512.0
    assert _run(scaler, "o.") == [True, False]
    assert scaler.scale == 256.0
    assert (scaler.steps, scaler.skipped_steps) == (3, 2)


def test_grows_after_growth_interval_clean_steps():
    scaler = LossScaler(init_scale=4.0, growth_interval=3)
    _run(scaler, "..")
    assert scaler.scale == 4.0
    _run(scaler, ".")
    assert scaler.scale == 8.0
    _run(scaler, "..o..")  # the overflow restarts the count
    assert scaler.scale == 4.0
    _run(scaler, ".")
    assert scaler.scale == 8.0


def test_growth_respects_max_scale():
    scaler = LossScaler(init_scale=4.0, growth_interval=1, max_scale=10.0)
    _run(scaler, "...")
    assert scaler.scale == 10.0


def test_never_below_min_scale():
    scaler = LossScaler(init_scale=8.0, min_scale=2.0)
    assert _run(scaler, "oooooo") == [True] * 6
    assert scaler.scale == 2.0
    assert scaler.skipped_steps == 6


def test_hysteresis_two_needs_two_overflows():
    scaler = LossScaler(init_scale=64.0, hysteresis=2, growth_interval=100)
    assert _run(scaler, "o") == [True]  # tolerated, but the step is still skipped
    assert scaler.scale == 64.0
    _run(scaler, "o")
    assert scaler.scale == 32.0
    _run(scaler, "o")  # hysteresis used up: every further overflow backs off
    assert scaler.scale == 16.0


def test_hysteresis_is_restored_by_growth():
    scaler = LossScaler(init_scale=64.0, hysteresis=2, growth_interval=2)
    _run(scaler, "oo")
    assert scaler.scale == 32.0
    _run(scaler, "..")
    assert scaler.scale == 64.0
    _run(scaler, "o")
    assert scaler.scale == 64.0


def test_static_never_changes_but_skips():
    scaler = LossScaler.static(128.0)
    assert not scaler.dynamic
    assert _run(scaler, "o..o" + "." * 50) == [True, False, False, True] + [False] * 50
    assert scaler.scale == 128.0
    assert (scaler.steps, scaler.skipped_steps) == (54, 2)
    tiny_interval = LossScaler(init_scale=128.0, dynamic=False, growth_interval=1)
    _run(tiny_interval, "...o")
    assert tiny_interval.scale == 128.0


def test_update_accepts_the_overflow_tensor():
    scaler = LossScaler(init_scale=16.0)
    assert scaler.update(torch.tensor(1.0)) is True
    assert scaler.update(torch.tensor(0.0)) is False
    assert scaler.scale == 8.0


def test_state_dict_round_trip():
    scaler = LossScaler(init_scale=64.0, growth_interval=5, hysteresis=3)
    _run(scaler, "o..o...")
    state = scaler.state_dict()
    assert all(type(v) in (int, float) for v in state.values())
    restored = LossScaler(init_scale=64.0, growth_interval=5, hysteresis=3)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    # the restored scaler continues exactly like the original
    assert _run(restored, "..ooo.") == _run(scaler, "..ooo.")
    assert restored.state_dict() == scaler.state_dict()
    assert scaler.scale == 64.0  # grew at step 8, then three overflows used hysteresis 3


def test_load_state_dict_rejects_bad_state():
    scaler = LossScaler()
    with pytest.raises(ConfigError, match="missing"):
        scaler.load_state_dict({"scale": 2.0})
    good = scaler.state_dict()
    with pytest.raises(ConfigError, match="scale"):
        scaler.load_state_dict({**good, "scale": 0.0})
    with pytest.raises(ConfigError, match="steps"):
        scaler.load_state_dict({**good, "steps": -1})
    with pytest.raises(ConfigError):
        scaler.load_state_dict({**good, "scale": torch.tensor(2.0)})


def test_unscale_divides_fp32_grads_in_place():
    scaler = LossScaler(init_scale=1024.0)
    grads = [torch.full((3,), 2048.0), torch.tensor([[1.0, -512.0]]), None]
    first = grads[0]
    scaler.unscale_(grads)
    assert grads[0] is first
    assert grads[0].tolist() == [2.0, 2.0, 2.0]
    assert grads[1].tolist() == [[1.0 / 1024, -0.5]]
    with pytest.raises(ConfigError, match="fp32"):
        scaler.unscale_([torch.ones(2, dtype=torch.float16)])


def test_found_overflow_detects_inf_and_nan_anywhere():
    scaler = LossScaler()
    clean = [torch.randn(4, 4), torch.randn(7), torch.randn(3, dtype=torch.float16)]
    flag = scaler.found_overflow(clean)
    assert flag.dtype == torch.float32 and flag.dim() == 0 and flag.item() == 0.0
    for bad in (float("inf"), float("-inf"), float("nan")):
        for index in range(len(clean)):
            grads = [g.clone() for g in clean]
            grads[index].view(-1)[-1] = bad
            assert scaler.found_overflow(grads).item() == 1.0, (bad, index)
    big_but_finite = [torch.full((2,), 6e4, dtype=torch.float16)]
    assert scaler.found_overflow(big_but_finite).item() == 0.0
    assert scaler.found_overflow([None, torch.ones(2)]).item() == 0.0


def test_found_overflow_flag_lives_on_the_ranks_device():
    """The flag is all-reduced with NCCL on a GPU, so it must be on the rank's device even when this
    rank has no gradients; a tensor made without a device would land on the default device."""
    scaler = LossScaler()
    with torch.device("meta"):  # the default device: where a flag made without a device would go
        assert scaler.found_overflow([], device="cpu").device == torch.device("cpu")
        assert scaler.found_overflow([torch.ones(2, device="cpu")]).device == torch.device("cpu")
        assert scaler.found_overflow([None, torch.ones(2, device="cpu")], device="cpu").item() == 0.0
    assert scaler.found_overflow([], device="cpu").item() == 0.0
    with pytest.raises(ConfigError, match="device="):
        scaler.found_overflow([None])


@pytest.mark.parametrize(
    "settings",
    [
        {"init_scale": 0.0},
        {"init_scale": -4.0},
        {"init_scale": float("inf")},
        {"growth_factor": 1.0},
        {"growth_factor": 0.5},
        {"backoff_factor": 0.0},
        {"backoff_factor": 1.0},
        {"backoff_factor": 1.5},
        {"growth_interval": 0},
        {"growth_interval": 2.5},
        {"hysteresis": 0},
        {"min_scale": 0.0},
        {"max_scale": 0.5},
        {"init_scale": 0.5, "min_scale": 1.0},
        {"init_scale": 1024.0, "max_scale": 512.0},
    ],
)
def test_bad_settings_raise_config_error(settings):
    with pytest.raises(ConfigError):
        LossScaler(**settings)
