"""Finding a model's activation blocks: its repeated layers.

By default the blocks are the children of the largest ``nn.ModuleList`` (or
``nn.Sequential``) whose children all have one type — the transformer layers of a
GPT, BERT or T5 stack. ``blocks=`` overrides with module types, qualified names or the
modules themselves (a list of them, or one ``nn.ModuleList``); one type or name alone is taken as
a list of one.
An encoder-decoder has two such lists; both are used, in forward order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

BlockSpec = Sequence[type[nn.Module] | str | nn.Module] | type[nn.Module] | str | None


def _repeated_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = []
    for name, module in model.named_modules():
        # A ModuleList is a stack even of one layer; a one-child Sequential is just a wrapper.
        minimum = 1 if isinstance(module, nn.ModuleList) else 2
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= minimum:
            kinds = {type(child) for child in module}
            if len(kinds) == 1:
                found.append((name, module))
    return found


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _as_list(blocks: Any) -> list[Any]:
    """``blocks=`` as a list: one type or name alone is a list of one (a name is not split into
    its letters); anything else must be an iterable of types, names and modules."""
    if isinstance(blocks, (str, type)):
        return [blocks]
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return [blocks]
    try:
        items = list(blocks)
    except TypeError:
        items = None
    strange = blocks if items is None else next((b for b in items if not isinstance(b, (str, type, nn.Module))), None)
    if items is None or strange is not None:
        raise TypeError(
            f"tiermem activations: blocks= takes module types, qualified names or the model's modules (or a list "
            f"of them); got {strange!r} of type {type(strange).__name__}"
        )
    return items


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[tuple[str, nn.Module]]:
    """The model's activation blocks as ``(qualified name, module)`` in registration order.

    Raises ``ValueError`` naming what was looked for when nothing matches.
    """
    if blocks is not None:
        blocks = _as_list(blocks)
        wanted_types = tuple(b for b in blocks if isinstance(b, type))
        wanted_names = {b for b in blocks if isinstance(b, str)}
        wanted_modules = {id(b) for b in blocks if isinstance(b, nn.Module)}
        chosen = [
            (name, module)
            for name, module in model.named_modules()
            if name
            and (
                (bool(wanted_types) and isinstance(module, wanted_types))
                or name in wanted_names
                or id(module) in wanted_modules
            )
        ]
        # A block inside another chosen block would split it: keep the outermost only.
        outer = [(n, m) for n, m in chosen if not any(n.startswith(o + ".") for o, _ in chosen if o != n)]
        missing = wanted_names - {n for n, _ in outer}
        strangers = len(wanted_modules - {id(m) for _, m in chosen})
        if missing or strangers or not outer:
            elsewhere = f"; {strangers} of the modules given are not in this model" if strangers else ""
            raise ValueError(
                f"tiermem activations: blocks={list(blocks)!r} matched "
                f"{[n for n, _ in outer] or 'nothing'}; names not found: {sorted(missing) or 'none'}{elsewhere}. "
                "Give module types, qualified names from model.named_modules() or the model's own modules."
            )
        return outer
    lists = _repeated_lists(model)
    if not lists:
        raise ValueError(
            f"tiermem activations: {type(model).__name__} has no nn.ModuleList of identical layers to use as "
            "blocks; pass blocks=[LayerType] or blocks=['qualified.name', ...] to rt.offload_activations, or "
            "rt.manage(..., activations=None) to leave its activations alone"
        )
    # The lists holding most of the model's parameters: the encoder and decoder stacks of an
    # encoder-decoder model both qualify; nested lists (heads inside a layer) do not.
    largest = max(_parameter_count(m) for _, m in lists)
    stacks = [
        (name, module)
        for name, module in lists
        if _parameter_count(module) * 4 >= largest
        and not any(name.startswith(other + ".") for other, _ in lists if other != name)
    ]
    return [
        (f"{name}.{index}" if name else str(index), child)
        for name, stack in stacks
        for index, child in enumerate(stack)
    ]


class ForwardPatches:
    """Blocks whose ``forward`` was replaced on the instance (a recompute wrapper, a profiling
    stand-in), each put back as it was by :meth:`restore`: the instance's own forward where
    something (accelerate, peft, a user) had set one, else the class's showing through again."""

    def __init__(self) -> None:
        self._patched: list[tuple[nn.Module, Any]] = []

    def patch(self, block: nn.Module, forward: Callable[..., Any]) -> None:
        self._patched.append((block, vars(block).get("forward")))
        block.forward = forward  # type: ignore[method-assign]

    def restore(self) -> None:
        for block, previous in reversed(self._patched):
            if previous is not None:
                block.forward = previous  # type: ignore[method-assign]
            elif "forward" in vars(block):
                del block.forward
        self._patched.clear()
