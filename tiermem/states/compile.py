"""``torch.compile`` and a managed model: regional compilation works, whole-model compilation is
refused clearly (NOTE [ Compiling a managed model ]). Owns nothing; reads the model's modules and
dynamo's state, and tells the manager which modules a compiled region collapses into one.

# NOTE [ Compiling a managed model ]
1. Regional compilation, as torchtitan does it: each repeated block compiled and put back in its
   parent *before* ``rt.manage`` (``model.blocks[i] = torch.compile(block)``, which makes an
   ``OptimizedModule`` wrapper). Each outermost wrapper is one *region*: the manager treats it as
   one module owning every parameter of its subtree (:func:`collapse_regions`), so its forward
   hooks, its backward pins (rule 3 of NOTE [ Model-state rules ]) and its chunk span are the
   region's, and nothing of tiermem is registered on the wrapped block or its submodules. The
   wrapper's own hooks run eagerly, around the compiled call (``OptimizedModule`` calls its
   hooks outside dynamo and compiles only ``forward``), so dynamo traces exactly the graph it
   traces for plain PyTorch compiled the same way, and the results are bitwise those of
   compiled plain PyTorch (tests/test_compile_regional.py; inductor's are not eager's: step 2's
   loss 18.960037 compiled, 18.960026 eager on the test GPT). The activation offloader's hooks
   follow the same rule (``SavedTensorHooks.protect`` in ``tiermem/activations/hooks.py``);
   the compiled backward's saved tensors go through the saved-tensor hooks like eager ones.
2. Refused, before any compiled code reads a chunk: ``block.compile()`` (it compiles the block's
   ``_call_impl``, hooks included, so no hook of that block runs outside the graph), and a
   wrapper put in after ``rt.manage`` (the manager's hooks are already inside it). Checked by
   the root's forward pre-hook, which runs eagerly unless the whole model is compiled: dynamo
   does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``), so a
   graph compiled for an unmanaged instance of a block class runs for a managed instance
   without its hooks (measured: ``setStorage: ... out of bounds for storage of size 0`` reading
   a released chunk; TRAPS 34); a refusal that waited for dynamo to trace a hook would come too
   late.
3. Whole-model compilation is refused: the manager's hooks fetch, release and refill chunk
   storage through the registry (Python side effects, other threads), which a graph must not
   capture, and the hooks refuse while dynamo traces or runs them (a graph compiled for the
   same model before ``rt.manage`` is not reused: dynamo guards the root's own hooks). The
   error points to regional compilation.
4. Planning from the first step (``rt.manage(plan="auto")`` without ``sample=``; rule 9 of NOTE
   [ Model-state rules ]) is skipped, with a warning logged, for a model with compiled regions:
   its profiling step runs the compiled blocks with the profiler's hooks inside them, and the
   run was not exact (measured on the test GPT, 2 blocks compiled by inductor, 3 AdamW steps:
   losses bitwise, but the parameters after step 2 differed from compiled plain PyTorch's, up to
   0.005 in ``blocks.1.qkv.bias``; the planner also sized buffers by single modules, 3, where a
   region spans 5 chunks). The default placement counts the region's span (``min_buffers``).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections import Counter
from typing import TypeVar

import torch
from torch import nn

from tiermem.states.errors import StatesUsageError
from tiermem.states.facts import ModelFacts

__all__ = ["check_compiled_modules", "collapse_regions", "compiled_regions", "refuse_compile", "without_regions"]

log = logging.getLogger("tiermem.states")
_Planner = TypeVar("_Planner")

_REGIONAL = (
    "compile each repeated block instead and put it back before rt.manage(), as torchtitan does: "
    "`model.blocks[i] = torch.compile(model.blocks[i])` (README, 'Your training loop'; NOTE [ Compiling a managed "
    "model ] in tiermem/states/compile.py)"
)


def _is_wrapper(module: nn.Module) -> bool:
    # Without dynamo imported there is no wrapper (and importing it costs a second).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def compiled_regions(model: nn.Module) -> list[nn.Module]:
    """Rule 1: the outermost ``torch.compile`` wrappers below ``model``, in registration order."""
    regions: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if module is model or id(module) in inside or not _is_wrapper(module):
            continue
        regions.append(module)
        inside.update(id(m) for m in module.modules())
    return regions


def collapse_regions(facts: ModelFacts) -> ModelFacts:
    """Rule 1: ``facts`` with each compiled region one module owning its subtree's parameters
    (names relative to the wrapper, so state-dict keys are ``prefix + name``)."""
    regions = compiled_regions(facts.model)
    if not regions:
        return facts
    module_names = dict(facts.module_names)
    for region in regions:
        names: list[tuple[str, int]] = []
        for prefix, module in region.named_modules():
            names.extend((f"{prefix}.{name}" if prefix else name, i) for name, i in module_names.pop(module, ()))
        if names:
            module_names[region] = names
    owners = Counter(i for names in module_names.values() for i in {i for _, i in names})
    shared = {i for i, count in owners.items() if count > 1}
    return dataclasses.replace(facts, module_names=module_names, shared=shared)


def refuse_compile() -> None:
    """Rule 3: a hook of the manager traced or run by dynamo (whole-model compilation)."""
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    callback = getattr(eval_frame, "get_eval_frame_callback", None)
    # A hook dynamo cannot trace runs eagerly inside the compiled call, where is_compiling() is
    # False but dynamo's frame callback is set.
    if torch.compiler.is_compiling() or (callback is not None and callback() not in (None, False)):
        raise StatesUsageError(
            "tiermem: torch.compile of a whole model whose states rt.manage() manages is not supported: the "
            "manager's hooks fetch, release and refill chunk storage around its modules, which a compiled graph "
            f"must not capture. Run the model itself, and {_REGIONAL}."
        )


def check_compiled_modules(model: nn.Module, regions: set[nn.Module]) -> None:
    """Rule 2, at the root's forward start: no ``.compile()``d module, and no compiled wrapper
    but the ``regions`` seen when the model was managed."""
    for name, module in model.named_modules():
        if vars(module).get("_compiled_call_impl") is not None:
            raise StatesUsageError(
                f"tiermem: {name or 'the model'}.compile() compiled part of a model whose states rt.manage() "
                "manages; Module.compile() compiles the module's hooks too, so the manager's could not run around "
                f"the graph. Build the model without calling .compile(), and {_REGIONAL}."
            )
        if module is model or not _is_wrapper(module) or module in regions:
            continue
        if not any(module in region.modules() for region in regions):  # not one nested in a region
            raise StatesUsageError(
                f"tiermem: torch.compile({name}) was put into the model after rt.manage(); the manager's hooks "
                f"are already on the module it wraps, where dynamo would capture them. Compile before: {_REGIONAL}."
            )


def without_regions(planner: _Planner | None, regions: set[nn.Module]) -> _Planner | None:
    """Rule 4: no first-step planner for a model with compiled regions (a warning says so)."""
    if regions and planner is not None:
        log.warning(
            "tiermem manage: planning from the first step is skipped for a model with compiled blocks, the default "
            "placement stays (give rt.manage a plan=; NOTE [ Compiling a managed model ] rule 4)"
        )
        return None
    return planner
