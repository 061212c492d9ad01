"""The coefficient of a KL penalty in the reward: fixed, or adapted toward a target KL.

verl's ``algorithm.kl_ctrl``: ``type`` fixed|adaptive, ``kl_coef`` (the initial value),
``target_kl`` and ``horizon`` (adaptive only). The adaptive rule is Ziegler et al. 2019
(arXiv:1909.08593, section 2.2): after a batch of ``n_steps`` samples whose KL was ``kl``,

    e = clip(kl / target_kl - 1, -0.2, 0.2)
    coef <- coef * (1 + e * n_steps / horizon)

Both controllers hold their coefficient as state (``state_dict`` / ``load_state_dict``) so a
resumed run continues with the coefficient it had, not the initial one.
"""

from __future__ import annotations

from typing import Any, Protocol

KL_CONTROL_TYPES = ("fixed", "adaptive")

_PROPORTIONAL_CLIP = 0.2


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FixedKLController:
    """A constant coefficient; ``update`` does nothing."""

    kind = "fixed"

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_ctrl.kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = _restored_value(state, self.kind)


class AdaptiveKLController:
    """Moves the coefficient up when the KL is above ``target_kl`` and down when below, by at
    most ``0.2 * n_steps / horizon`` of itself per update."""

    kind = "adaptive"

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if init_kl_coef < 0:
            raise ValueError(f"kl_ctrl.kl_coef must be >= 0, got {init_kl_coef}")
        if not target_kl > 0:
            raise ValueError(f"kl_ctrl.target_kl must be > 0 for the adaptive controller, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -_PROPORTIONAL_CLIP), _PROPORTIONAL_CLIP)
        factor = 1.0 + error * n_steps / self.horizon
        if factor <= 0:  # config/validate.py refuses such a horizon for the run's batch size
            raise ValueError(
                f"kl_ctrl.horizon={self.horizon:g} with {n_steps} responses would multiply the KL coefficient "
                f"by {factor:g}; it must be > {_PROPORTIONAL_CLIP:g} x the responses per step"
            )
        self.value *= factor

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = _restored_value(state, self.kind)


def kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """The controller ``kind`` (``fixed`` or ``adaptive``) starting at ``kl_coef``."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                "kl_ctrl.type=adaptive needs kl_ctrl.target_kl and kl_ctrl.horizon (verl: 0.1, 10000)"
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"kl_ctrl.type={kind!r} is not one of {', '.join(KL_CONTROL_TYPES)}")


def _restored_value(state: dict[str, Any], kind: str) -> float:
    if state.get("type") != kind:
        raise ValueError(
            f"the checkpoint's KL controller is {state.get('type')!r} but this run's kl_ctrl.type is {kind!r}; "
            "set kl_ctrl.type back or start a new run"
        )
    return float(state["value"])
