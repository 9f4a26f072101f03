"""Hugging Face Trainer and Accelerate over a managed model: ``rt.manage`` applies the plan to model
states and activations (NOTE [ Managed activations ]), so their own loops need nothing else; this
module declares those loops (NOTE [ Trainer loops declared ] below) and routes Trainer's
checkpoints through ``rt.save``.

::

    model, optimizer = rt.manage(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    trainer = tiermem.integrations.hf.Trainer(model=model, args=args, optimizers=(optimizer, None), runtime=rt, ...)
    accelerator = tiermem.integrations.hf.Accelerator(gradient_accumulation_steps=4, runtime=rt)

Trainer's own checkpoint (``save_strategy``) writes ``model.state_dict()`` and
``optimizer.state_dict()`` whole, in memory, and its ``resume_from_checkpoint`` loads them back
over the chunks; a managed model's states are saved streamed and atomically by ``rt.save``
instead (NOTE [ Checkpoint rules ] in ``tiermem.checkpoint``). :class:`Trainer` saves where
Trainer saves (after the step's log and evaluation): its model and optimizer through
``rt.save(<output_dir>/checkpoint-<step>, extra=...)``, with Trainer's state and the LR
scheduler's in ``extra``, then Trainer's own ``trainer_state.json`` and ``rng_state.pth`` beside
them; and it resumes from such a checkpoint (``train(resume_from_checkpoint=path or True)``)
with ``rt.load``. A plain ``transformers.Trainer`` saves so given :class:`RuntimeCheckpoints` (at
the step's end, before its log); without it a managed model's Trainer refuses to save with an
error that says so (``check_trainer``).

# NOTE [ Trainer loops declared ]
1. :class:`Trainer` (``transformers.Trainer`` given ``runtime=rt``) and :class:`Accelerator`
   (``accelerate.Accelerator`` given ``runtime=rt``) know the loop they run, so they declare it
   (``rt.declare``, NOTE [ Declared steps ] rule 10 in ``tiermem.states.stepping``): Trainer at
   each ``train()`` from ``args.gradient_accumulation_steps`` and ``args.max_grad_norm``, the
   Accelerator at ``prepare`` from its ``gradient_accumulation_steps``. Only for a plain
   single-process loop: with fp16 ``GradScaler`` (its ``unscale_`` edits gradients after
   backward), DeepSpeed, FSDP or several processes, nothing is declared; nor under a
   ``transformers`` whose Trainer clips inline rather than through ``_clip_grad_norm`` and
   ``_get_grad_norm`` (the two methods :class:`Trainer` overrides). ``declare_loop=False`` opts
   out (callbacks that edit gradients by hand need it).
2. Without clipping, offloaded chunks then step during the last backward of each window. The
   norm Trainer logs every step (``clip_grad_norm_(params, inf)``, after that backward) is read
   without the in-place multiply by 1.0 that call ends with (``DeclaredLoop.grad_norm``):
   bitwise the same number, and gradients the early steps used stay untouched.
3. With ``max_grad_norm > 0`` the declaration carries the clip and the runtime clips at
   Trainer's own clip call, once (``DeclaredLoop.clip_grad_norm_``, ``torch.nn.utils.clip_grad_norm_``
   over ``model.parameters()``, the call Trainer makes: the same norm and the same scaled
   gradients); ``optimizer.step()`` does not clip again. No chunk steps early then (the norm needs
   every gradient), as in any clipping loop.
4. An Accelerate loop clips when it chooses: a call with a finite ``max_norm`` makes the loop
   undeclared again (where no chunk stepped early in this window; refused with the reason
   otherwise) and clips as ``accelerate`` does, so a loop that clips runs the plain path (which
   overlaps as much as a declared clip would: none); ``max_norm=inf`` reads the norm as in 2.
5. Anything else that edits gradients between backward and ``optimizer.step()`` (a callback's
   ``on_pre_optimizer_step``, a hand-made clip through another call) after chunks stepped early
   is caught by NOTE [ Declared steps ] rule 4: ``StatesUsageError`` at ``optimizer.step()``,
   never a different step.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import accelerate
import torch
import transformers
from accelerate.utils import DistributedType
from transformers import TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME

from tiermem.checkpoint.content import rng_state, set_rng_state
from tiermem.errors import CheckpointError
from tiermem.states.errors import StatesUsageError
from tiermem.states.manager import DeclaredLoop

__all__ = ["Accelerator", "RuntimeCheckpoints", "Trainer", "check_trainer"]


def _checkpoint_extra(state: Any, scheduler: Any) -> dict[str, Any]:
    """The ``extra`` of a Trainer's ``rt.save``: Trainer's state and the LR scheduler's."""
    return {
        "trainer_state": dataclasses.asdict(state),
        "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
    }


class RuntimeCheckpoints(TrainerCallback):  # type: ignore[misc]
    """Trainer's saves as ``rt.save`` checkpoints (the Trainer skips its own)."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._save_instead(args, state, control, kwargs.get("lr_scheduler"))

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._save_instead(args, state, control, kwargs.get("lr_scheduler"))

    def _save_instead(self, args: Any, state: Any, control: Any, scheduler: Any) -> Any:
        if not control.should_save:
            return control
        control.should_save = False  # Trainer's own save would write the whole states in memory
        # the generators too: what Trainer's own save keeps in rng_state.pth
        extra = {**_checkpoint_extra(state, scheduler), "rng_state": rng_state()}
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.rt.save(path, extra=extra)
        # Where Trainer's resume reads its state, before it loads anything (Trainer.train).
        state.save_to_json(os.path.join(path, TRAINER_STATE_NAME))
        return control


class _RefuseTrainerSaves(TrainerCallback):  # type: ignore[misc]
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._refuse(control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._refuse(control)

    @staticmethod
    def _refuse(control: Any) -> Any:
        if control.should_save:
            raise StatesUsageError(
                "tiermem + Hugging Face Trainer: Trainer is about to save a checkpoint of a managed model with its own "
                "writer (model and optimizer state dicts whole, in memory; its resume would not restore the chunks). "
                "Add callbacks=[tiermem.integrations.hf.RuntimeCheckpoints(rt)] to save through rt.save instead, "
                "or set save_strategy='no'"
            )
        return control


def check_trainer(trainer: Any) -> Any:
    """Make ``trainer`` refuse its own checkpoints of a managed model unless
    :class:`RuntimeCheckpoints` routes them through ``rt.save``; returns ``trainer``."""
    callbacks = trainer.callback_handler.callbacks
    if not any(isinstance(c, RuntimeCheckpoints) for c in callbacks):
        trainer.add_callback(_RefuseTrainerSaves())
    return trainer


def _plain_loop(accelerator: accelerate.Accelerator) -> bool:
    """Rule 1: a single-process loop without a gradient scaler, whose gradients nobody edits
    between backward and the step but its clip."""
    return accelerator.distributed_type == DistributedType.NO and getattr(accelerator, "scaler", None) is None


#: rule 1: this transformers' Trainer clips and reads the norm through the two methods
#: :class:`Trainer` overrides (older ones clip inline, where a declared clip would clip twice)
_CLIPS_THROUGH_METHODS = all(hasattr(transformers.Trainer, name) for name in ("_clip_grad_norm", "_get_grad_norm"))


class Trainer(transformers.Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` over a model ``rt.manage`` manages (``runtime=rt``): its loop
    declared (NOTE [ Trainer loops declared ]), its checkpoints through ``rt.save`` and its
    resume through ``rt.load``."""

    def __init__(self, *args: Any, runtime: Any, declare_loop: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runtime = runtime
        self.declare_loop = declare_loop
        #: the loop declared at train(); None when undeclared (rule 1)
        self.declared: DeclaredLoop | None = None
        #: the ``extra`` of the checkpoint train(resume_from_checkpoint=) loaded
        self._resumed: dict[str, Any] | None = None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self.declared = None
        if self.declare_loop and _plain_loop(self.accelerator) and _CLIPS_THROUGH_METHODS:
            max_norm = self.args.max_grad_norm
            self.declared = self.runtime.declare(
                self.model,
                grad_accumulation_steps=self.args.gradient_accumulation_steps,
                clip_grad_norm=float(max_norm) if max_norm is not None and max_norm > 0 else None,
            )
        return super().train(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A checkpoint's model (Trainer's ``_save_checkpoint`` calls this first) goes through
        ``rt.save``, the optimizer with it; a save the user asks for is Trainer's export."""
        if not _internal_call or output_dir is None:
            return super().save_model(output_dir, _internal_call)
        self.runtime.save(output_dir, extra=_checkpoint_extra(self.state, self.lr_scheduler))
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Saved with the model by ``rt.save`` (:meth:`save_model`)."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Nothing yet: the states are loaded with the optimizer's (:meth:`_load_optimizer_and_scheduler`)."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Resuming: ``rt.load`` restores the managed model's and optimizer's states (param groups
        included), where Trainer would read its own files over the chunks, once its LR scheduler
        exists (making one sets the groups' learning rate to the schedule's first), then the
        schedule's own state from ``extra``."""
        if checkpoint is None:
            return
        try:
            self._resumed = self.runtime.load(checkpoint)
        except CheckpointError as exc:
            raise CheckpointError(
                f"tiermem + Hugging Face Trainer: cannot resume from {checkpoint}: {exc} (a managed model resumes "
                "from the rt.save checkpoints this Trainer, or RuntimeCheckpoints, writes)",
                checkpoint,
            ) from exc
        saved = (self._resumed or {}).get("lr_scheduler")
        if saved is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(saved)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Trainer's own ``rng_state.pth`` where it saved one; else (a checkpoint
        :class:`RuntimeCheckpoints` made) the generators ``rt.save`` kept at the step's end."""
        saved = None if checkpoint is None else (self._resumed or {}).get("rng_state")
        if checkpoint is None or os.path.isfile(os.path.join(checkpoint, "rng_state.pth")) or saved is None:
            return super()._load_rng_state(checkpoint)
        set_rng_state(saved)
        return None

    def create_optimizer(self, model: Any = None) -> Any:
        if self.optimizer is None and self.runtime.manages(self.model if model is None else model):
            raise StatesUsageError(
                "tiermem + Hugging Face Trainer: the model is managed by rt.manage, but Trainer was given no "
                "optimizer, so it would build its own over the managed parameters: one tiermem does not manage, whose "
                "states would sit in RAM beside the tiers and step apart from them. Pass the optimizer rt.manage "
                "returned: Trainer(..., optimizers=(optimizer, None), runtime=rt)"
            )
        return super().create_optimizer(model)

    def _clip_grad_norm(self, model: Any) -> Any:
        if self.declared is not None and self.declared.clip_grad_norm is not None:
            return self.declared.clip_grad_norm_()  # rule 3: the runtime clips, once
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if grad_norm is None and self.declared is not None:
            grad_norm = self.declared.grad_norm()  # rule 2: read, not scaled by 1.0
        return super()._get_grad_norm(model, grad_norm=grad_norm)


class Accelerator(accelerate.Accelerator):  # type: ignore[misc]
    """``accelerate.Accelerator`` whose ``prepare`` declares the loop of every model ``runtime``
    manages (NOTE [ Trainer loops declared ])."""

    def __init__(self, *args: Any, runtime: Any, declare_loop: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runtime = runtime
        self.declare_loop = declare_loop
        #: the loops declared at prepare (rule 1)
        self.declared: list[DeclaredLoop] = []

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        prepared = super().prepare(*args, **kwargs)
        if self.declare_loop and _plain_loop(self):
            for model in args:
                if isinstance(model, torch.nn.Module) and self.runtime.manages(model):
                    steps = self.gradient_accumulation_steps
                    self.declared.append(self.runtime.declare(model, grad_accumulation_steps=steps))
        return prepared

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        params = list(parameters)
        loop = next((d for d in self.declared if d.owns(params)), None)
        if loop is None or float(norm_type) != 2.0:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        if math.isinf(float(max_norm)) and max_norm > 0:
            return loop.grad_norm()  # the norm only: read, not scaled by 1.0 (rule 2 of the NOTE)
        # the loop clips by itself, which early steps cannot precede: undeclared from now on (rule 4)
        self.runtime.declare(loop.states.model)
        self.declared.remove(loop)
        return super().clip_grad_norm_(params, max_norm, norm_type)
