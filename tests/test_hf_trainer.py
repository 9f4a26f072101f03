"""Hugging Face Trainer and Accelerate over a managed model (issue 22 item 2): a model and
optimizer from ``rt.manage`` train in Trainer's own loop (gradient accumulation, ``max_grad_norm``
clipping, its linear LR schedule) and through ``accelerator.prepare`` bitwise like plain
PyTorch with the same seed, with the activation policy in force (saved activations written to
NVMe), evaluation and ``generate`` working; Trainer's checkpoints go through ``rt.save`` or are
refused clearly. Models are built from configs (no downloads)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import tiermem
from tests.test_activations_hf import MODELS
from tiermem.states import StatesUsageError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, count: int, seed: int) -> None:
        self.ids = torch.randint(0, 128, (count, 12), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def runtime(tmp_path: Path) -> tiermem.Runtime:
    (tmp_path / "nvme").mkdir(parents=True, exist_ok=True)
    return tiermem.Runtime(
        {
            "device": {"capacity": "3MiB", "device": "cpu"},  # below the model's states: chunks stream
            "nvme": {"paths": [str(tmp_path / "nvme")], "capacity": "64MiB", "block_size": "64KiB"},
            "scheduler": {"loop": "asyncio"},
            "activations": {"min_bytes": "1KiB"},  # the tiny model's saved tensors are a few KiB
        }
    )


def arguments(out: Path, **overrides: Any) -> Any:
    values = {
        "output_dir": str(out),
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.5,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "linear",
        "max_steps": 3,
        "seed": 0,
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    return transformers.TrainingArguments(**(values | overrides))


def generate(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)


def trainer_run(tmp_path: Path, managed: bool) -> tuple[list[Any], dict[str, float], torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = MODELS["gpt2"]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data, held_out = Tokens(16, 0), Tokens(4, 1)

    def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[Any], dict[str, float]]:
        trainer = transformers.Trainer(
            model=model, args=arguments(tmp_path / "out"), train_dataset=data, eval_dataset=held_out,
            optimizers=(optimizer, None),
        )  # fmt: skip
        trainer.train()
        losses = [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]
        return losses, {"eval_loss": trainer.evaluate()["eval_loss"]}

    if not managed:
        losses, evaluation = run(model, optimizer)
        return losses, evaluation, generate(model), [p.detach().clone() for p in model.parameters()]
    with runtime(tmp_path) as rt:
        model, optimizer = rt.manage(model, optimizer, plan={"persistent_chunks": 0}, activations="nvme")
        losses, evaluation = run(model, optimizer)
        assert rt.stats().activations.bytes_written["nvme"] > 0  # the policy was in force in Trainer's loop
        tokens = generate(model)
    return losses, evaluation, tokens, [p.detach().clone() for p in model.parameters()]


def test_trainer_over_a_managed_model_is_bitwise_plain_trainer(tmp_path):
    want = trainer_run(tmp_path / "plain", managed=False)
    got = trainer_run(tmp_path / "managed", managed=True)
    assert len(got[0]) == 3 and got[0] == want[0]  # losses, clipped norms, the linear schedule's LRs
    assert got[1] == want[1]  # evaluation
    assert torch.equal(got[2], want[2])  # generate
    assert all(torch.equal(a, b) for a, b in zip(got[3], want[3], strict=True))
    assert list((tmp_path / "managed" / "nvme").iterdir()) == []  # no file left


def test_trainer_checkpoints_go_through_rt_save_or_are_refused(tmp_path):
    from tiermem.integrations.hf import RuntimeCheckpoints, check_trainer

    torch.manual_seed(0)
    model = MODELS["gpt2"]()
    with runtime(tmp_path) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW(model.parameters(), lr=1e-2), activations="nvme")
        args = arguments(tmp_path / "out", save_strategy="steps", save_steps=2)
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=Tokens(16, 0), optimizers=(optimizer, None),
            callbacks=[RuntimeCheckpoints(rt)],
        )  # fmt: skip
        check_trainer(trainer).train()
        saved = tmp_path / "out" / "checkpoint-2"
        assert (saved / "tiermem-manifest.json").exists()  # rt.save's, not Trainer's own files
        assert not any(p.name.endswith((".safetensors", ".pt", ".bin")) for p in saved.iterdir())
        refusing = check_trainer(
            transformers.Trainer(model=model, args=args, train_dataset=Tokens(16, 0), optimizers=(optimizer, None))
        )
        with pytest.raises(StatesUsageError, match=r"RuntimeCheckpoints\(rt\)"):
            refusing.train()


def test_accelerate_prepare_of_a_managed_model_is_bitwise_plain(tmp_path):
    from accelerate import Accelerator

    def run(managed: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = MODELS["gpt2"]()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.utils.data.DataLoader(Tokens(8, 0), batch_size=2)
        losses: list[torch.Tensor] = []

        def loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
            accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
            model, optimizer, loader = accelerator.prepare(model, optimizer, data)
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        losses.append(accelerator.clip_grad_norm_(model.parameters(), 0.5).detach())
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss.detach())

        if not managed:
            loop(model, optimizer)
        else:
            with runtime(tmp_path) as rt:
                loop(*rt.manage(model, optimizer, plan={"persistent_chunks": 0}, activations="nvme"))
                assert rt.stats().activations.bytes_written["nvme"] > 0
        return losses, [p.detach().clone() for p in model.parameters()]

    want_losses, want_params = run(managed=False)
    got_losses, got_params = run(managed=True)
    assert len(got_losses) == 6
    assert all(torch.equal(a, b) for a, b in zip(got_losses, want_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params, strict=True))


# -- NOTE [ Trainer loops declared ] in tiermem.integrations.hf ------------------------------------


def declared_trainer_run(
    tmp_path: Path, managed: bool, callbacks: list[Any] | None = None, declare_loop: bool = True, **overrides: Any
) -> tuple[list[Any], list[torch.Tensor], dict[str, Any]]:
    """Trainer's losses, logged norms and LRs and the final parameters; plain ``transformers.Trainer``
    or tiermem's over a managed model, with what the declared path did."""
    from tiermem.integrations.hf import Trainer

    torch.manual_seed(0)
    model = MODELS["gpt2"]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    args = arguments(tmp_path / "out", **overrides)
    evidence: dict[str, Any] = {}

    def logged(trainer: Any) -> list[Any]:
        return [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]

    if not managed:
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=Tokens(16, 0), optimizers=(optimizer, None), callbacks=callbacks
        )
        trainer.train()
        return logged(trainer), [p.detach().clone() for p in model.parameters()], evidence
    with runtime(tmp_path) as rt:
        model, optimizer = rt.manage(model, optimizer, plan={"persistent_chunks": 0}, activations="nvme")
        trainer = Trainer(
            model=model, args=args, train_dataset=Tokens(16, 0), optimizers=(optimizer, None), callbacks=callbacks,
            runtime=rt, declare_loop=declare_loop,
        )  # fmt: skip
        trainer.train()
        evidence["early_chunk_steps"] = rt.stats().model_states.early_chunk_steps
        declared = trainer.declared
        evidence["declared"] = None if declared is None else (declared.grad_accumulation_steps, declared.clip_grad_norm)
        evidence["runtime_norm"] = optimizer.grad_norm  # set where the runtime clipped (declared clip)
        params = [p.detach().clone() for p in model.parameters()]
    return logged(trainer), params, evidence


@pytest.mark.parametrize(("accumulation", "max_norm"), [(1, 0.0), (1, 0.5), (2, 0.0), (2, 0.5)])
def test_trainer_declares_its_loop_and_stays_bitwise_plain_trainer(tmp_path, accumulation, max_norm):
    overrides = {"gradient_accumulation_steps": accumulation, "max_grad_norm": max_norm}
    want_log, want_params, _ = declared_trainer_run(tmp_path / "plain", managed=False, **overrides)
    got_log, got_params, evidence = declared_trainer_run(tmp_path / "managed", managed=True, **overrides)
    assert len(got_log) == 3 and got_log == want_log  # losses, logged norms, the schedule's LRs
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params, strict=True))
    assert evidence["declared"] == (accumulation, max_norm or None)  # what Trainer's args say
    if max_norm:  # the runtime clipped at Trainer's clip call, once (no chunk steps early under clipping)
        assert evidence["early_chunk_steps"] == 0
        assert evidence["runtime_norm"].item() == got_log[-1][1]
    else:  # offloaded chunks stepped during the last backward of the windows after the first
        assert evidence["early_chunk_steps"] > 0
        assert evidence["runtime_norm"] is None


def test_trainer_resumes_from_its_rt_save_checkpoint_bitwise(tmp_path):
    """train(resume_from_checkpoint=) over a managed model: a fresh process-like run (new runtime,
    another model's weights) resumed from the step-2 checkpoint ends as the uninterrupted run
    does: the same logged losses, norms and LRs, the same parameters (dropout draws included)."""
    from tiermem.integrations.hf import Trainer

    def run(out: Path, seed: int, resume: Any) -> tuple[list[Any], list[torch.Tensor]]:
        torch.manual_seed(seed)
        model = MODELS["gpt2"]()
        with runtime(tmp_path / "rt") as rt:
            model, optimizer = rt.manage(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
            args = arguments(out, max_steps=4, save_strategy="steps", save_steps=2, gradient_accumulation_steps=1)
            trainer = Trainer(
                model=model, args=args, train_dataset=Tokens(16, 0), optimizers=(optimizer, None), runtime=rt
            )
            trainer.train(resume_from_checkpoint=resume)
            log = [
                (h["step"], h["loss"], h["grad_norm"], h["learning_rate"])
                for h in trainer.state.log_history
                if "loss" in h
            ]
            return log, [p.detach().clone() for p in model.parameters()]

    want_log, want_params = run(tmp_path / "whole", 0, None)
    assert (tmp_path / "whole" / "checkpoint-2" / "trainer_state.json").exists()
    got_log, got_params = run(tmp_path / "resumed", 1, str(tmp_path / "whole" / "checkpoint-2"))
    assert [entry[0] for entry in want_log] == [1, 2, 3, 4]
    assert got_log == want_log
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params, strict=True))
    shutil.rmtree(tmp_path / "whole" / "checkpoint-4")
    again_log, again_params = run(tmp_path / "whole", 1, True)  # the last checkpoint, as Trainer finds it
    assert again_log == want_log
    assert all(torch.equal(a, b) for a, b in zip(again_params, want_params, strict=True))


def test_trainer_without_the_managed_optimizer_is_refused_naming_the_fix(tmp_path):
    """tiermem's Trainer given no optimizer would build one over the managed parameters, outside
    the tiers and stepped apart from them: refused at train(), naming ``optimizers=``."""
    from tiermem.integrations.hf import Trainer

    torch.manual_seed(0)
    model = MODELS["gpt2"]()
    with runtime(tmp_path) as rt:
        model, _ = rt.manage(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        trainer = Trainer(model=model, args=arguments(tmp_path / "out"), train_dataset=Tokens(16, 0), runtime=rt)
        with pytest.raises(StatesUsageError, match=r"given no optimizer.*optimizers=\(optimizer, None\)"):
            trainer.train()
        assert all(p.grad is None for p in model.parameters())  # refused before any step


class HalveGradientsFromStep(transformers.TrainerCallback):  # type: ignore[misc]
    """Edits gradients in ``on_pre_optimizer_step`` from the given optimizer step on."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.step:
            with torch.no_grad():
                for p in kwargs["model"].parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)
        return control


def test_a_callback_editing_gradients_breaks_the_declared_trainer_loop_loudly(tmp_path):
    from tiermem.integrations.hf import Trainer

    overrides = {"gradient_accumulation_steps": 1, "max_grad_norm": 0.0}
    torch.manual_seed(0)
    model = MODELS["gpt2"]()
    with runtime(tmp_path / "declared") as rt:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = rt.manage(model, optimizer, plan={"persistent_chunks": 0})
        trainer = Trainer(
            model=model, args=arguments(tmp_path / "out", **overrides), train_dataset=Tokens(16, 0),
            optimizers=(optimizer, None), callbacks=[HalveGradientsFromStep(1)], runtime=rt,
        )  # fmt: skip
        # the edit comes after chunks stepped early with the unedited gradients (the second window)
        with pytest.raises(StatesUsageError, match=r"gradients changed between backward and optimizer.step\(\)"):
            trainer.train()
    # opted out, the same callback trains as under plain Trainer
    want_log, want_params, _ = declared_trainer_run(
        tmp_path / "plain", managed=False, callbacks=[HalveGradientsFromStep(1)], **overrides
    )
    got_log, got_params, evidence = declared_trainer_run(
        tmp_path / "undeclared", managed=True, callbacks=[HalveGradientsFromStep(1)], declare_loop=False, **overrides
    )
    assert got_log == want_log and evidence["early_chunk_steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params, strict=True))


@pytest.mark.parametrize("max_norm", [math.inf, 0.5])
def test_accelerator_declares_its_loop_and_stays_bitwise_plain(tmp_path, max_norm):
    import accelerate

    from tiermem.integrations.hf import Accelerator

    def run(managed: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, Any]]:
        torch.manual_seed(0)
        model = MODELS["gpt2"]()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.utils.data.DataLoader(Tokens(8, 0), batch_size=2)
        logged: list[torch.Tensor] = []

        def loop(accelerator: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
            model, optimizer, loader = accelerator.prepare(model, optimizer, data)
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:  # the norm, clipped or (inf) only read
                        logged.append(accelerator.clip_grad_norm_(model.parameters(), max_norm).detach())
                    optimizer.step()
                    optimizer.zero_grad()
                logged.append(loss.detach())

        evidence: dict[str, Any] = {}
        if not managed:
            loop(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2), model, optimizer)
        else:
            with runtime(tmp_path) as rt:
                model, optimizer = rt.manage(model, optimizer, plan={"persistent_chunks": 0})
                accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, runtime=rt)
                loop(accelerator, model, optimizer)
                evidence["early_chunk_steps"] = rt.stats().model_states.early_chunk_steps
                evidence["declared"] = [(d.grad_accumulation_steps, d.clip_grad_norm) for d in accelerator.declared]
        return logged, [p.detach().clone() for p in model.parameters()], evidence

    want_logged, want_params, _ = run(managed=False)
    got_logged, got_params, evidence = run(managed=True)
    assert len(got_logged) == 6
    assert all(torch.equal(a, b) for a, b in zip(got_logged, want_logged, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params, strict=True))
    if math.isinf(max_norm):  # declared at prepare; chunks stepped in the second window's last backward
        assert evidence["declared"] == [(2, None)] and evidence["early_chunk_steps"] > 0
    else:  # a loop that clips runs undeclared from its first clip call (rule 4 of the NOTE)
        assert evidence["declared"] == [] and evidence["early_chunk_steps"] == 0
