"""Hugging Face Trainer over a managed model: ``rt.manage`` applies the plan to model states and
activations (NOTE [ Managed activations ]), so Trainer's own loop needs nothing else; this module
only routes Trainer's checkpoints through ``rt.save``.

::

    model, optimizer = rt.manage(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    trainer = Trainer(model=model, args=args, optimizers=(optimizer, None),
                      callbacks=[tiermem.integrations.hf.RuntimeCheckpoints(rt)], ...)

Trainer's own checkpoint (``save_strategy``) writes ``model.state_dict()`` and
``optimizer.state_dict()`` whole, in memory, and its ``resume_from_checkpoint`` loads them back
over the chunks; a managed model's states are saved streamed and atomically by ``rt.save``
instead (NOTE [ Checkpoint rules ] in ``tiermem.checkpoint``). :class:`RuntimeCheckpoints` turns
every save Trainer decides on into ``rt.save(<output_dir>/checkpoint-<step>, extra=...)``, with
Trainer's state and the LR scheduler's in ``extra``; without it a managed model's Trainer refuses
to save with an error that says so (``check_trainer``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from transformers import TrainerCallback

from tiermem.states.errors import StatesUsageError

__all__ = ["RuntimeCheckpoints", "check_trainer"]


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
        extra = {
            "trainer_state": dataclasses.asdict(state),
            "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
        }
        self.rt.save(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), extra=extra)
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
