"""``torch.compile`` and a managed model: refused clearly, whole or by regions (NOTE
[ Compiling a managed model ]). Owns nothing; reads the model's modules and dynamo's state.

# NOTE [ Compiling a managed model ]
1. Not supported yet, whole model or regions (``block.compile()``, ``torch.compile(block)``
   as torchtitan does): the manager's per-module hooks fetch, release and refill chunk storage
   through the registry (Python side effects, other threads), which dynamo must not trace into
   a graph. Breaking the graph at every hook would compile other graphs than compiled plain
   PyTorch, whose results are not eager's bitwise (measured on the test GPT, 2 blocks compiled
   by inductor: step 2's loss 18.960037 compiled, 18.960026 eager), so it could not match
   compiled plain PyTorch either. Making it work needs the hooks at block granularity outside
   the compiled region (docs/TRAPS.md, TRAPS 34 says what to watch).
2. The refusal must not depend on dynamo tracing the hooks: dynamo does not guard on module
   hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``), so a graph compiled for an
   unmanaged instance of the same block class runs for the managed one without its hooks
   (measured: ``setStorage: ... out of bounds for storage of size 0`` reading a released chunk;
   a resident stale chunk would be read silently). So the root's forward pre-hook, which runs
   eagerly unless the whole model is compiled, refuses a model with compiled submodules; and
   the hooks refuse while dynamo traces or runs them (a whole-model compile: a graph compiled
   for the same model before ``rt.manage`` is not reused, dynamo guards the root's own hooks;
   checked by tests/test_compile.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tiermem.states.errors import StatesUsageError

__all__ = ["refuse_compile", "refuse_compiled_modules"]

_WHY = (
    "rt.manage()'s hooks fetch, release and refill chunk storage around every module, which compiled graphs must "
    "not capture (README, 'Your training loop'; NOTE [ Compiling a managed model ] in tiermem/states/compile.py)"
)


def refuse_compile() -> None:
    """Rule 2: a hook of the manager traced or run by dynamo (whole-model compilation)."""
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    callback = getattr(eval_frame, "get_eval_frame_callback", None)
    # A hook dynamo cannot trace runs eagerly inside the compiled call, where is_compiling() is
    # False but dynamo's frame callback is set.
    if torch.compiler.is_compiling() or (callback is not None and callback() not in (None, False)):
        raise StatesUsageError(
            "tiermem: torch.compile of a model whose states rt.manage() manages is not supported yet, neither of "
            f"the whole model nor of its blocks (regional compilation): {_WHY}. Run the managed model eagerly."
        )


def refuse_compiled_modules(model: nn.Module) -> None:
    """Rule 2, at the root's forward start: no submodule may be compiled."""
    for name, module in model.named_modules():
        compiled = vars(module).get("_compiled_call_impl") is not None
        if compiled or type(module).__name__ == "OptimizedModule":
            how = f"{name or 'the model'}.compile()" if compiled else f"torch.compile({name})"
            raise StatesUsageError(
                f"tiermem: {how} compiled part of a model whose states rt.manage() manages; regional compilation is "
                f"not supported yet: {_WHY}. Build the model without compiling its modules, and run it eagerly."
            )
