"""Checkpoints of a ``tiermem train`` run: save every N steps, and resume on the exact loss curve.

::

    train(rt, config, steps=60, ..., checkpoints=TrainCheckpoints(path="ckpt", save_every=10))
    train(rt, config, steps=60, ..., checkpoints=TrainCheckpoints(resume="ckpt"))   # steps 11..60

# NOTE [ Resuming a train run ]
1. A save is ``rt.save(path, extra=...)`` between two steps (after ``optimizer.step()`` and
   ``zero_grad``), so the checkpoint holds the parameters, AdamW states and every RNG
   (NOTE [ Checkpoint rules ] rule 4); ``extra`` adds what the loop itself needs:
   the steps done, the data stream's position (its generator's state, so no batch is drawn
   twice or skipped), the losses so far and the run's settings. The loop has no LR scheduler
   (``lr`` is constant, and the param groups' ``lr`` is in the checkpoint anyway).
2. A resume builds the model and optimizer exactly as a fresh run (same seed), lets
   ``rt.manage`` place them (the plan may differ: placement never changes a value), then
   ``rt.load`` overwrites every value and RNG, and the loop continues at the saved step. The
   losses from there on and the final parameters are bitwise the uninterrupted run's.
3. What can be checked before the (seconds-long) planning is: the checkpoint exists and its
   DCP metadata reads, and the model's parameter names and shapes are the checkpoint's.
   After the load (the run's settings live in ``extra``): it is a ``tiermem train``
   checkpoint, with this run's batch size, learning rate, seed and model, and ``steps`` is
   beyond its step. Each failure is a :class:`~tiermem.errors.CheckpointError` naming both
   values and what to do.
4. On several ranks (torchrun, NOTE [ Training on ranks ] rule 5) every rank saves and loads
   together; each rank's ``extra`` is its own (``rt.save`` keeps every rank's, ``rt.load``
   returns the rank's own, NOTE [ Checkpoints on ranks ] rule 5), so each rank's data stream
   continues where it stood; the losses are the mean over ranks, the same on every rank. The
   world size is one of the run's settings: the per-rank streams and the mean loss are another
   curve on another world size, so a resume on another one is refused (the weights themselves
   load on any world size with ``rt.load``).
5. ``--checkpoint DIR`` is checked before step 1: DIR must be able to take a save (missing, empty,
   or a tiermem checkpoint), and a run that does not resume from DIR refuses to replace a
   checkpoint already there (a forgotten ``--resume`` would lose it).
6. Before the run prints, measures or plans anything (``tiermem train``'s first output is then
   the error, alone): :meth:`TrainCheckpoints.check_before_start` makes every check of rules 3
   and 5 that needs no load: the destination, the architecture (a model built on the meta
   device), and the saved ``extra`` (format, settings, step), read from the state file once
   that file matches its digest (the load verifies every file again, NOTE [ Checkpoint commit
   rules ] rule 4). On several ranks each check is agreed (NOTE [ Checkpoints on ranks ] rule
   4): every rank raises the same error, so one of them can print it (NOTE [ Training on ranks ]
   rule 7).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiermem import distributed
from tiermem.app.models.data import MarkovChainData
from tiermem.app.models.gpt import GPT
from tiermem.errors import CheckpointError

__all__ = ["EXTRA_FORMAT", "ResumePoint", "TrainCheckpoints", "run_settings"]

EXTRA_FORMAT = "tiermem-train"
"""``extra["format"]`` of a checkpoint ``tiermem train`` wrote (version 1)."""
_VERSION = 1


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run starts: the steps already done and their losses."""

    step: int
    losses: list[float]


@dataclass(frozen=True)
class TrainCheckpoints:
    """Where a train run saves (``path``, every ``save_every`` steps and at the end) and what
    it resumes from (``resume``); all None: no checkpoints."""

    path: str | os.PathLike[str] | None = None
    save_every: int | None = None
    resume: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.save_every is not None and self.path is None:
            raise ValueError(
                f"tiermem train: save_every={self.save_every} needs a checkpoint path to save to (--checkpoint DIR)"
            )
        if self.save_every is not None and self.save_every < 1:
            raise ValueError(f"tiermem train: save_every must be at least 1, got {self.save_every}")

    @property
    def active(self) -> bool:
        return self.path is not None or self.resume is not None

    def _check_destination(self) -> None:
        """Rule 5: before step 1, not after the steps up to the first save."""
        if self.path is None:
            return
        where = Path(os.path.abspath(os.fspath(self.path)))
        problem = _destination_problem(where, self.resume)
        if problem is not None:
            raise CheckpointError(problem, str(where))

    def saves_after(self, done: int, steps: int) -> bool:
        """Rule 1: whether to save once ``done`` steps (of ``steps``) are done."""
        if self.path is None:
            return False
        return done == steps or (self.save_every is not None and done % self.save_every == 0)

    def save(self, rt: Any, settings: dict[str, Any], done: int, data: MarkovChainData, losses: list[float]) -> None:
        """Rule 1: the checkpoint after ``done`` steps, committed atomically at ``path``."""
        assert self.path is not None
        extra = {
            "format": EXTRA_FORMAT,
            "version": _VERSION,
            "step": done,
            # The generator is the stream's whole position (MarkovChainData draws only from it).
            "data": {"batches": done, "generator": data.stream_state()},
            "losses": list(losses),
            "run": settings,
        }
        rt.save(self.path, extra=extra)

    def check_before_start(self, model_config: Any, settings: dict[str, Any], steps: int) -> None:
        """Rule 6: everything a resume (or the destination) can be refused for without a load."""

        def check() -> None:
            with torch.device("meta"):  # shapes only: no memory, no RNG drawn
                model = GPT(model_config)
            self._check_before_planning(model)
            if self.resume is not None:
                where = os.path.abspath(os.fspath(self.resume))
                _check_extra(where, _saved_extra(Path(where)), settings, steps)

        _agreed(check)

    def check_before_planning(self, model: torch.nn.Module) -> None:
        """Rule 3, first half: ``path`` can take a save (rule 5), and ``resume`` is a readable
        checkpoint of this model's parameters; agreed over the ranks (rule 6)."""
        _agreed(lambda: self._check_before_planning(model))

    def _check_before_planning(self, model: torch.nn.Module) -> None:
        self._check_destination()
        if self.resume is None:
            return
        from tiermem.checkpoint import storage_reader  # DCP only when asked

        where = Path(os.path.abspath(os.fspath(self.resume)))
        if not where.is_dir():
            beside = (
                sorted(p.name for p in where.parent.glob(f".{where.name}.tiermem-*")) if where.parent.is_dir() else []
            )
            hint = f"; beside it: {', '.join(beside)} (a save that did not finish)" if beside else ""
            raise CheckpointError(
                f"tiermem train: --resume {where}: no checkpoint there{hint}. Give the --checkpoint "
                "directory of an earlier run (tiermem checkpoint inspect DIR shows what one holds).",
                str(where),
            )
        try:
            metadata = storage_reader(where).read_metadata()
        except Exception as exc:  # whatever the format's reader raises for a damaged file
            raise CheckpointError(
                f"tiermem train: --resume {where}: its metadata cannot be read ({exc!r}); the checkpoint is damaged "
                "or incomplete. Resume from an earlier one (tiermem checkpoint inspect DIR checks one).",
                str(where),
            ) from exc
        _check_architecture(where, metadata, model)

    def resume_from(self, rt: Any, settings: dict[str, Any], data: MarkovChainData, steps: int) -> ResumePoint:
        """Rules 2 and 3: load ``resume`` into the managed model, check it is this run's, put the
        data stream where it was; the step to continue from."""
        if self.resume is None:
            return ResumePoint(0, [])
        where = os.path.abspath(os.fspath(self.resume))
        extra = rt.load(where)
        _agreed(lambda: _check_extra(where, extra, settings, steps))  # what was loaded, too
        step = int(extra["step"])
        data.set_stream_state(extra["data"]["generator"])
        return ResumePoint(step, [float(x) for x in extra["losses"]])


#: settings a checkpoint saved before they were recorded had these values
_SETTING_DEFAULTS = {"world_size": 1}


def run_settings(model_config: Any, batch_size: int, lr: float, seed: int) -> dict[str, Any]:
    """What a resumed run must share with the saved one for its curve to be the same (rule 4:
    the world size too)."""
    return {
        "model": dataclasses.asdict(model_config),
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "world_size": distributed.detect().world_size,
    }


def _destination_problem(path: Path, resume: str | os.PathLike[str] | None) -> str | None:
    """Rule 5: why a fresh run must not save to ``path``, or None."""
    from tiermem.checkpoint import files

    try:
        files.check_replaceable(path)
    except CheckpointError as exc:
        return str(exc)
    same = resume is not None and Path(os.path.abspath(os.fspath(resume))) == path
    if not same and (path / files.MANIFEST).exists():
        return (
            f"tiermem train: --checkpoint {path} holds a checkpoint already, which this new run would replace; "
            f"continue it with --resume {path}, or choose another directory (or remove it)"
        )
    return None


def _check_architecture(where: Path, metadata: Any, model: torch.nn.Module) -> None:
    """The model's parameter names and shapes against the checkpoint's ``model`` entries."""
    saved = {
        key.removeprefix("model."): tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(entry, "size")
    }
    ours = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    if saved == ours:
        return
    missing, unknown = sorted(ours.keys() - saved.keys()), sorted(saved.keys() - ours.keys())
    shapes = [f"{n} {saved[n]} vs {ours[n]}" for n in sorted(saved.keys() & ours.keys()) if saved[n] != ours[n]]
    what = [
        f"{label} {items[:3]}{' ...' if len(items) > 3 else ''}"
        for label, items in (
            ("it lacks this model's", missing),
            ("it has, not in this model,", unknown),
            ("other shapes (checkpoint vs this run):", shapes),
        )
        if items
    ]
    raise CheckpointError(
        f"tiermem train: --resume {where} holds another model: {'; '.join(what)}. Give the same model flags "
        "(--layers, --d-model, --heads, --vocab, --seq-len) as the run that saved it.",
        str(where),
    )


def _agreed(check: Callable[[], None]) -> None:
    """Rule 6: ``check`` on every rank, every rank raising the first failing rank's error
    (NOTE [ Checkpoints on ranks ] rule 4); as it is in one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        check()
        return
    from tiermem.checkpoint.ranks import Group

    Group().agreed(check)


def _saved_extra(where: Path) -> Any:
    """Rule 6: the ``extra`` this rank saved in the checkpoint at ``where``, from its state file
    once that matches its digest; None for a plain DCP checkpoint (which has none)."""
    from tiermem.checkpoint import read_extra

    return read_extra(where, rank=distributed.detect().rank)


def _check_extra(where: str, extra: Any, settings: dict[str, Any], steps: int) -> None:
    """Rule 3: ``extra`` is a ``tiermem train`` checkpoint's, saved with ``settings``, before ``steps``."""
    if not isinstance(extra, dict) or extra.get("format") != EXTRA_FORMAT:
        raise CheckpointError(
            f"tiermem train: --resume {where} is not a checkpoint of tiermem train (its extra is "
            f"{type(extra).__name__}, not format {EXTRA_FORMAT!r}); it has no step or data position to continue "
            "from. Resume from a --checkpoint directory tiermem train wrote.",
            where,
        )
    _check_settings(where, extra["run"], settings)
    step = int(extra["step"])
    if step >= steps:
        raise CheckpointError(
            f"tiermem train: --resume {where} is at step {step} and --steps {steps} asks for no more; give "
            f"--steps above {step} (the total, not the steps to add).",
            where,
        )


def _check_settings(where: str, saved: dict[str, Any], ours: dict[str, Any]) -> None:
    """Rule 3: the same batch size, learning rate, seed and model, or a curve that is not the saved run's."""
    saved = {**_SETTING_DEFAULTS, **saved}
    differ = [f"{key} {saved.get(key)!r} (this run: {ours[key]!r})" for key in ours if saved.get(key) != ours[key]]
    if differ:
        raise CheckpointError(
            f"tiermem train: --resume {where} was saved by a run with other settings: {'; '.join(differ)}. Resume "
            "with the settings it was saved with, or its loss curve would not continue.",
            where,
        )
