"""Loss scaling for 16-bit gradients, written here (not torch.amp.GradScaler).

The loss is multiplied by `scale` before backward so that small gradients stay
above fp16's smallest subnormal; gradients are divided by it again in fp32.

The API is split so that sharded optimizers can share one decision. Our own
MasterAdamW folds the check into the gradient norm's all-reduce instead (inf and
nan survive a sum, so one all-reduced number is both the norm and the flag);
`found_overflow` is the stand-alone form of the same check:

    scaled = scaler.scale_loss(loss); scaled.backward()
    flag = scaler.found_overflow(my_shard_of_grads, device)  # 0-dim float32, 1.0 or 0.0
    dist.all_reduce(flag, op=ReduceOp.MAX)            # every rank sees any overflow
    if not scaler.update(bool(flag)):
        scaler.unscale_(my_fp32_grads); optimizer.step()

Dynamic mode follows Megatron-LM / DeepSpeed: after `growth_interval` clean
steps in a row the scale grows by `growth_factor` (capped at `max_scale`); an
overflow resets that count and uses up one unit of `hysteresis`; when none is
left the scale shrinks by `backoff_factor` (never below `min_scale`), and every
further overflow shrinks it again until the next growth restores the
hysteresis. Every overflowing step is skipped, in both modes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from minigpt.errors import ConfigError

_STATE_KEYS = ("scale", "steps", "skipped_steps", "clean_steps", "hysteresis_left")


@dataclass
class LossScaler:
    """Static (`dynamic=False`, the scale never changes) or dynamic loss scaling."""

    init_scale: float = 2.0**16
    dynamic: bool = True
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float | None = None
    scale: float = field(init=False)
    steps: int = field(init=False, default=0)
    skipped_steps: int = field(init=False, default=0)
    clean_steps: int = field(init=False, default=0)  # clean steps since last growth/overflow
    hysteresis_left: int = field(init=False)

    def __post_init__(self) -> None:
        self._validate()
        self.scale = float(self.init_scale)
        self.hysteresis_left = self.hysteresis

    @classmethod
    def static(cls, scale: float) -> LossScaler:
        return cls(init_scale=scale, dynamic=False)

    def _validate(self) -> None:
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ConfigError(
                f"loss scale init_scale={self.init_scale} must be a finite number > 0, "
                "e.g. 65536 (2**16)"
            )
        if not self.growth_factor > 1:
            raise ConfigError(
                f"growth_factor={self.growth_factor} must be > 1 so the scale can grow; "
                "use 2.0"
            )
        if not 0 < self.backoff_factor < 1:
            raise ConfigError(
                f"backoff_factor={self.backoff_factor} must be strictly between 0 and 1 "
                "so the scale shrinks on overflow; use 0.5"
            )
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a whole number >= 1")
        if not (math.isfinite(self.min_scale) and self.min_scale > 0):
            raise ConfigError(f"min_scale={self.min_scale} must be a finite number > 0, e.g. 1.0")
        if self.max_scale is not None and not self.max_scale >= self.min_scale:
            raise ConfigError(
                f"max_scale={self.max_scale} must be >= min_scale={self.min_scale}, "
                "or None for no upper limit"
            )
        if self.dynamic and self.init_scale < self.min_scale:
            raise ConfigError(
                f"init_scale={self.init_scale} is below min_scale={self.min_scale}: "
                "raise init_scale or lower min_scale"
            )
        if self.dynamic and self.max_scale is not None and self.init_scale > self.max_scale:
            raise ConfigError(
                f"init_scale={self.init_scale} is above max_scale={self.max_scale}: "
                "lower init_scale or raise max_scale"
            )

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the current scale; call backward on this."""
        return loss * self.scale

    def found_overflow(
        self, grads: Iterable[torch.Tensor | None], device: torch.device | str | None = None
    ) -> torch.Tensor:
        """0-dim float32 tensor: 1.0 if any gradient holds inf or nan, else 0.0.

        It stays a tensor so that callers can all-reduce it with MAX across ranks
        before calling `update`; it lives on `device` (default: the first
        gradient's), which must be the rank's own for NCCL, which reduces only
        CUDA tensors. A rank without gradients (an empty shard) still takes part
        in that all-reduce, so it must say where its flag lives. None entries
        (parameters without a gradient) are ignored.
        """
        flags = [(~torch.isfinite(g)).any() for g in grads if g is not None]
        if device is None:
            if not flags:
                raise ConfigError(
                    "found_overflow got no gradients and no device: pass device= (the rank's own) "
                    "so that the flag can be all-reduced with the other ranks'"
                )
            device = flags[0].device
        if not flags:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack([flag.to(device) for flag in flags]).any().to(torch.float32)

    def unscale_(self, grads: Iterable[torch.Tensor | None]) -> None:
        """Divide fp32 gradients by the scale, in place."""
        inverse = 1.0 / self.scale
        for grad in grads:
            if grad is None:
                continue
            if grad.dtype != torch.float32:
                raise ConfigError(
                    f"unscale_ needs fp32 gradients, got {grad.dtype}: copy them into "
                    "the fp32 master gradients first, then unscale those"
                )
            grad.mul_(inverse)

    def update(self, overflow: bool | torch.Tensor) -> bool:
        """Record one step's outcome; returns True when the step must be skipped."""
        overflow = bool(overflow)
        self.steps += 1
        if overflow:
            self.skipped_steps += 1
            if self.dynamic:
                self._back_off()
            return True
        if self.dynamic:
            self._maybe_grow()
        return False

    def _back_off(self) -> None:
        self.clean_steps = 0
        self.hysteresis_left -= 1
        if self.hysteresis_left <= 0:
            self.hysteresis_left = 0
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)

    def _maybe_grow(self) -> None:
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            grown = self.scale * self.growth_factor
            self.scale = grown if self.max_scale is None else min(grown, self.max_scale)

    def state_dict(self) -> dict[str, float | int]:
        """Counters as plain Python numbers (no tensors: safe to save without pickle)."""
        return {key: getattr(self, key) for key in _STATE_KEYS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ConfigError(
                f"loss scaler state is missing {', '.join(missing)}: pass a dict made "
                "by LossScaler.state_dict()"
            )
        scale = state["scale"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
            math.isfinite(scale) and scale > 0
        ):
            raise ConfigError(f"loss scaler state has scale={scale!r}; it must be a number > 0")
        counters = {key: state[key] for key in _STATE_KEYS[1:]}
        for key, value in counters.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"loss scaler state has {key}={value!r}; it must be a whole number >= 0"
                )
        self.scale = float(scale)
        self.steps = counters["steps"]
        self.skipped_steps = counters["skipped_steps"]
        self.clean_steps = counters["clean_steps"]
        self.hysteresis_left = counters["hysteresis_left"]
