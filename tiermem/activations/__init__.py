"""Activation offloading (TBA): saved tensors kept, recomputed, or moved to host or NVMe."""

from tiermem.activations.blocks import find_blocks
from tiermem.activations.offloader import ActivationCounters, ActivationMemoryError, ActivationOffloader
from tiermem.activations.storages import ActivationStorageError
from tiermem.layout.activation_policy import BlockPolicy, BlockProfile, adaptive_keep, resolve_policies

__all__ = [
    "ActivationCounters",
    "ActivationMemoryError",
    "ActivationOffloader",
    "ActivationStorageError",
    "BlockPolicy",
    "BlockProfile",
    "adaptive_keep",
    "find_blocks",
    "resolve_policies",
]
