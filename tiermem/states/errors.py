"""The errors model-state management raises, one class per failure."""

from __future__ import annotations

from tiermem.errors import TiermemError


class UnsupportedOptimizerError(TiermemError, TypeError):
    """Raised when ``rt.manage`` gets an optimizer it cannot reproduce exactly."""


class PlanError(TiermemError, ValueError):
    """Raised when a hand-written placement plan is malformed or contradicts the model."""


class StatesMemoryError(TiermemError, MemoryError):
    """Raised when model states do not fit the budgets: at ``rt.manage`` when the plan cannot
    fit, or during a step when every device buffer is pinned."""


class StatesClosedError(TiermemError, RuntimeError):
    """Raised when a managed model or optimizer is used after its Runtime closed and its
    parameters could not be restored into ordinary tensors."""


class StatesUsageError(TiermemError, RuntimeError):
    """Raised when a managed model or optimizer is used in a way tiermem cannot keep exact
    (e.g. ``load_state_dict(assign=True)``, sparse gradients, ``add_param_group``)."""
