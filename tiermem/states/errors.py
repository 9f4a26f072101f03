"""The errors model-state management raises, one class per failure."""

from __future__ import annotations

from tiermem.errors import PlanError, StatesMemoryError, TiermemError

# PlanError and StatesMemoryError live in tiermem.errors: the pure layout vocabulary raises them.
__all__ = [
    "PlanError",
    "StatesClosedError",
    "StatesMemoryError",
    "StatesUsageError",
    "UnsupportedOptimizerError",
]


class UnsupportedOptimizerError(TiermemError, TypeError):
    """Raised when ``rt.manage`` gets an optimizer it cannot reproduce exactly."""


class StatesClosedError(TiermemError, RuntimeError):
    """Raised when a managed model or optimizer is used after its Runtime closed and its
    parameters could not be restored into ordinary tensors."""


class StatesUsageError(TiermemError, RuntimeError):
    """Raised when a managed model or optimizer is used in a way tiermem cannot keep exact
    (e.g. ``load_state_dict(assign=True)``, sparse gradients, ``add_param_group``)."""
