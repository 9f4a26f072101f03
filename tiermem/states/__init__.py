"""Model-state management (ProTrain): parameters, gradients and optimizer states in chunks.

``model, optimizer = rt.manage(model, torch.optim.AdamW, lr=3e-4)``; see
:mod:`tiermem.states.manager` for the mechanism and :mod:`tiermem.layout.placement` for plans.
"""

from tiermem.layout.chunks import ChunkLayout, ParamInfo, Slot, pack, size_candidates, waste
from tiermem.layout.placement import Budgets, ChunkNeeds, Plan, PlanRequest, decide, parse_plan
from tiermem.states.chunks import Chunk
from tiermem.states.errors import (
    PlanError,
    StatesClosedError,
    StatesMemoryError,
    StatesUsageError,
    UnsupportedOptimizerError,
)
from tiermem.states.manager import DeclaredLoop, ModelStates
from tiermem.states.optimizer import SUPPORTED, ManagedOptimizer
from tiermem.states.sharded.manager import ShardedModelStates, ShardedOptimizer

__all__ = [
    "SUPPORTED",
    "Budgets",
    "Chunk",
    "ChunkLayout",
    "ChunkNeeds",
    "DeclaredLoop",
    "ManagedOptimizer",
    "ModelStates",
    "ParamInfo",
    "Plan",
    "PlanError",
    "PlanRequest",
    "ShardedModelStates",
    "ShardedOptimizer",
    "Slot",
    "StatesClosedError",
    "StatesMemoryError",
    "StatesUsageError",
    "UnsupportedOptimizerError",
    "decide",
    "pack",
    "parse_plan",
    "size_candidates",
    "waste",
]
