"""The optimizer settings of a chunk stepped on the CPU while the model trains on a CUDA device.

# NOTE [ CPU steps of offloaded chunks ]
1. On a CUDA device an offloaded chunk steps on the CPU, over its host home (NOTE [ Exact
   optimizer step ]). The user's param groups and state were made for CUDA parameters and may
   carry settings a CPU step cannot take; :func:`for_cpu_step` cleans them, on copies (the live
   ``param_groups`` and the chunk's records are never edited), or refuses with
   :class:`UnsupportedOptimizerError` naming the setting, the values and what to do.
2. ``capturable=True`` exists for CUDA graphs: it keeps the bias corrections on the device as
   tensors so that no step reads a scalar back. A CPU step is never captured, and torch refuses
   ``capturable`` for CPU parameters; it runs with ``capturable=False``: the same update, with the
   scalars computed as torch's non-capturable path computes them.
3. Tensors the step reads as values (a tensor ``lr``, ``step`` scalars of a chunk that was
   persistent on the device, GradScaler's ``grad_scale``/``found_inf``) are copied to the CPU with
   their dtype: the same numbers, on the device the step runs on.
4. ``fused=True`` needs torch's fused CPU kernels (torch >= 2.4 lists the CPU among the fused
   devices). Without them the CPU step is refused: dropping ``fused`` would change the math.
5. On the CPU device (no CUDA) nothing is cleaned: the settings reach torch as the user gave
   them, so a setting plain PyTorch refuses on the CPU is refused alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tiermem.states.errors import UnsupportedOptimizerError

__all__ = ["cpu_fused_supported", "for_cpu_step"]

Groups = list[tuple[dict[str, Any], list[torch.Tensor]]]
State = dict[torch.Tensor, dict[str, Any]]


def cpu_fused_supported() -> bool:
    """Whether this torch has fused optimizer kernels for the CPU (rule 4)."""
    from torch.utils import _foreach_utils

    devices = getattr(_foreach_utils, "_get_fused_kernels_supported_devices", None)
    return devices is not None and "cpu" in devices()


def _on_cpu(value: Any) -> Any:
    """Rule 3: a tensor on another device copied to the CPU (dtype kept); anything else as it is."""
    return value.to("cpu") if isinstance(value, torch.Tensor) and value.device.type != "cpu" else value


def for_cpu_step(
    device: torch.device,
    groups: Groups,
    state: State,
    attributes: Mapping[str, Any],
    *,
    optimizer_class: type[torch.optim.Optimizer],
    fused_supported: Callable[[], bool] = cpu_fused_supported,
) -> tuple[Groups, State, dict[str, Any]]:
    """``groups``, ``state`` and ``attributes`` for a step over the parameters in ``groups`` of a model
    on ``device``: cleaned copies (rules 2, 3) when those are on the CPU and ``device`` is not, else as
    given (rule 5; a chunk stepped on the device keeps its settings).
    Raises UnsupportedOptimizerError for ``fused=True`` where this torch has no fused CPU kernels."""
    if device.type == "cpu" or any(p.device.type != "cpu" for _, params in groups for p in params):
        return groups, state, dict(attributes)  # rule 5, or a chunk stepped on the device
    cleaned: Groups = []
    for group, params in groups:
        if group.get("fused") and not fused_supported():
            raise UnsupportedOptimizerError(
                f"tiermem manage: {optimizer_class.__name__}(fused=True) on {device}: offloaded chunks step on the "
                f"CPU, and torch {torch.__version__} has no fused CPU kernels (torch >= 2.4 has); pass fused=False "
                "(or leave it out), upgrade torch, or keep every chunk on the device "
                "(NOTE [ CPU steps of offloaded chunks ] rule 4)"
            )
        copy = {key: _on_cpu(value) for key, value in group.items() if key != "params"}
        if copy.get("capturable"):
            copy["capturable"] = False  # rule 2: a CPU step is never captured, same math
        cleaned.append((copy, params))
    moved = {param: {key: _on_cpu(value) for key, value in entry.items()} for param, entry in state.items()}
    return cleaned, moved, {name: _on_cpu(value) for name, value in attributes.items()}
