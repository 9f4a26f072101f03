"""Checkpoints (issue 19, first step): ``rt.save`` / ``rt.load`` in DCP's filesystem format resume
training bitwise (states on NVMe, undeclared and declared loops, RNG, LR schedule), plain PyTorch
reads the weights and PyTorch's own DCP checkpoints load, damaged checkpoints are refused with a
clear error and failed saves leave the previous checkpoint and no temporary files.
(NOTE [ Checkpoint rules ], NOTE [ Checkpoint commit rules ])"""

from __future__ import annotations

import os
import pathlib
import re
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import tiermem
import tiermem.checkpoint
from tiermem.checkpoint import files
from tiermem.errors import CheckpointError
from tiermem.states import StatesUsageError

W = 64
#: both storage formats (NOTE [ Checkpoint rules ] rule 7)
FORMATS = pytest.mark.parametrize("fmt", ["dcp", "zarr"])
#: a data file of each format: DCP's one file, a chunk of a zarr array
DATA_FILE = {"dcp": "__0_0.distcp", "zarr": "model.layers.1.weight/c/0/0"}


class Net(nn.Module):
    """Dropout draws from the RNG (a resume must restore it); the tied head shares a chunk's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(W, 2 * W)
        self.layers = nn.ModuleList(nn.Linear(2 * W, 2 * W) for _ in range(4))
        self.norm = nn.LayerNorm(2 * W)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(2 * W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = x + self.drop(torch.relu(layer(x)))
        return self.head(self.norm(x))


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def config(tmp_path: pathlib.Path, host: str = "64MiB") -> dict[str, Any]:
    (tmp_path / "nvme").mkdir(exist_ok=True)
    return {
        "device": {"capacity": "1MiB", "device": "cpu"},
        "host": {"capacity": host},
        "nvme": {"paths": [str(tmp_path / "nvme")], "capacity": "64MiB", "block_size": "64KiB"},
        "scheduler": {"loop": "asyncio"},
    }


PLAN = {"state_home": "nvme", "chunk_size": "128KiB"}


def manage(rt: tiermem.Runtime, seed: int = 0, **kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    groups = lambda m: [  # noqa: E731
        {"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    model = make_model(seed)
    model, optimizer = rt.manage(model, torch.optim.AdamW(groups(model), lr=3e-3), plan=PLAN, **kwargs)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, schedule


def train(model: nn.Module, optimizer: Any, schedule: Any, steps: range, micro: int = 1) -> list[float]:
    losses = []
    for step in steps:
        for k in range(micro):
            g = torch.Generator().manual_seed(100 * step + k)
            x = torch.randn(4, W, generator=g)
            loss = (model(x) - x).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return losses


def snapshot(model: nn.Module, optimizer: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return {k: v.clone() for k, v in model.state_dict().items()}, optimizer.state_dict()


def assert_bitwise(a: tuple[dict[str, Any], dict[str, Any]], b: tuple[dict[str, Any], dict[str, Any]]) -> None:
    (params_a, opt_a), (params_b, opt_b) = a, b
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name
    assert opt_a["param_groups"] == opt_b["param_groups"]
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for i, state in opt_a["state"].items():
        assert state.keys() == opt_b["state"][i].keys()
        for key, value in state.items():
            assert torch.equal(value, opt_b["state"][i][key]), (i, key)


@FORMATS
@pytest.mark.parametrize("declared", [False, True], ids=["undeclared", "declared"])
def test_resume_is_exact_with_states_on_nvme(tmp_path, declared, fmt):
    """Train N, save, train M == train N, save, fresh runtime and model (other seed), load, train M."""
    kwargs = {"grad_accumulation_steps": 2} if declared else {}
    micro = 2 if declared else 1
    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path, host="1MiB")) as rt:
        model, optimizer, schedule = manage(rt, **kwargs)
        train(model, optimizer, schedule, range(3), micro)
        assert {c["home"] for c in model_homes(rt)} == {"nvme"}
        rt.save(path, extra={"schedule": schedule.state_dict(), "step": 3}, format=fmt)
        assert tiermem.checkpoint.storage_reader(path).read_metadata().planner_data  # either format
        expected_losses = train(model, optimizer, schedule, range(3, 6), micro)
        expected = snapshot(model, optimizer)
    with tiermem.Runtime(config(tmp_path, host="1MiB")) as rt:
        model, optimizer, schedule = manage(rt, seed=1, **kwargs)
        torch.manual_seed(1234)  # the load restores the RNG the dropout draws from
        extra = rt.load(path)
        assert extra["step"] == 3
        schedule.load_state_dict(extra["schedule"])
        losses = train(model, optimizer, schedule, range(3, 4), micro)
        if declared:
            # The position was restored: early steps (which a fresh loop starts only after its first
            # window, NOTE [ Declared steps ] rule 3) already run in the first window after the load.
            assert rt.stats().as_dict()["model_states"]["early_chunk_steps"] > 0
        losses += train(model, optimizer, schedule, range(4, 6), micro)
        assert losses == expected_losses
        assert_bitwise(snapshot(model, optimizer), expected)


def model_homes(rt: tiermem.Runtime) -> list[dict[str, Any]]:
    return [c for states in rt._model_states for c in states.describe()["chunks"] if not c["persistent"]]


@FORMATS
def test_plain_pytorch_loads_the_weights_bitwise(tmp_path, fmt):
    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        train(model, optimizer, schedule, range(2))
        rt.save(path, format=fmt)
        managed = {k: v.clone() for k, v in model.state_dict().items()}
    plain = make_model(seed=7)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        reader = tiermem.checkpoint.storage_reader(path)
        dcp.load({"model": plain.state_dict()}, checkpoint_id=path, storage_reader=reader)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, managed[name]), name


def test_a_checkpoint_pytorch_wrote_loads_into_a_managed_model(tmp_path):
    """The format is DCP's own: get_state_dict's FQN-keyed optimizer state loads with rt.load."""
    plain = make_model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    train(plain, optimizer, schedule, range(3))
    model_sd, optim_sd = get_state_dict(plain, optimizer)
    schedule_at_save = schedule.state_dict()
    path = tmp_path / "plain"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
    lr_at_save = optimizer.param_groups[0]["lr"]
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    expected_losses = train(plain, optimizer, schedule, range(3, 5))
    with tiermem.Runtime(config(tmp_path)) as rt:
        model = make_model(seed=1)
        model, managed_optimizer = rt.manage(model, torch.optim.AdamW(model.parameters(), lr=1.0), plan=PLAN)
        assert rt.load(path) is None  # no extra in a plain checkpoint
        assert managed_optimizer.param_groups[0]["lr"] == lr_at_save != 1.0  # the saved hyper-parameters
        managed_schedule = torch.optim.lr_scheduler.StepLR(managed_optimizer, step_size=2, gamma=0.5)
        managed_schedule.load_state_dict(schedule_at_save)
        torch.set_rng_state(rng)
        assert train(model, managed_optimizer, managed_schedule, range(3, 5)) == expected_losses
        for name, value in model.state_dict().items():
            assert torch.equal(value, plain.state_dict()[name]), name


@FORMATS
@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage, fmt):
    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        train(model, optimizer, schedule, range(1))
        rt.save(path, format=fmt)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        data = path / DATA_FILE[fmt]
        raw = bytearray(data.read_bytes())
        if damage == "corrupt":
            raw[len(raw) // 2] ^= 0x01
        else:
            del raw[-100:]
        data.write_bytes(bytes(raw))
        with pytest.raises(CheckpointError, match=re.escape(str(data))) as info:
            rt.load(path)
        assert ("truncated" if damage == "truncate" else "digest") in str(info.value)
        assert "load an earlier checkpoint" in str(info.value)
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), name  # nothing was loaded
        (path / files.MANIFEST).unlink()
        with pytest.raises(CheckpointError, match="missing"):
            rt.load(path)


def _leftovers(path: pathlib.Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def test_a_failed_save_keeps_the_previous_checkpoint_and_no_temporary_files(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        rt.save(path, extra="first")
        train(model, optimizer, schedule, range(1))

        def broken(*args: Any, **kwargs: Any) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(dcp, "save", broken)
        with pytest.raises(OSError, match="No space"):
            rt.save(path, extra="second")
        monkeypatch.undo()
        assert _leftovers(path) == []
        with pytest.raises(CheckpointError, match="cannot be pickled"):
            rt.save(path, extra=lambda: None)
        assert rt.load(path) == "first"


def test_commit_without_an_atomic_exchange_and_its_recovery(tmp_path, monkeypatch):
    """Rule 3's fallback: rename the old one aside, the new one in; a crash between the two
    renames leaves the old one aside, and the next load puts it back."""
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        manage(rt)
        rt.save(path, extra=1)
        rt.save(path, extra=2)
        assert _leftovers(path) == []
        os.rename(path, path.parent / f".{path.name}.tiermem-old-crashed")  # killed between the renames
        assert rt.load(path) == 2
        assert _leftovers(path) == []


def test_save_inside_a_declared_window_is_refused(tmp_path):
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, _, _ = manage(rt, grad_accumulation_steps=2)
        model(torch.randn(2, W)).sum().backward()
        with pytest.raises(StatesUsageError, match="accumulation window"):
            rt.save(tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists() and _leftovers(tmp_path / "ckpt") == []


def test_load_refuses_another_architecture(tmp_path):
    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        manage(rt)
        rt.save(path)
    with tiermem.Runtime(config(tmp_path)) as rt:
        torch.manual_seed(0)
        other = nn.Sequential(nn.Linear(W, W))
        rt.manage(other, torch.optim.AdamW, lr=1e-3)
        with pytest.raises(CheckpointError, match="model entries this model does not have"):
            rt.load(path)


def test_load_into_a_model_with_more_layers_names_the_model_not_the_optimizer(tmp_path):
    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        manage(rt)
        rt.save(path)
    with tiermem.Runtime(config(tmp_path)) as rt:
        model = make_model(seed=1)
        model.layers.append(nn.Linear(2 * W, 2 * W))
        model, optimizer = rt.manage(model, torch.optim.AdamW(model.parameters(), lr=3e-3), plan=PLAN)
        before = snapshot(model, optimizer)
        refused = r"lacks 2 of this model's entries \(\['model\.layers\.4\.weight', 'model\.layers\.4\.bias'\]\)"
        with pytest.raises(CheckpointError, match=refused + r".*another architecture; nothing was loaded"):
            rt.load(path)
        assert_bitwise(snapshot(model, optimizer), before)


def test_a_model_managed_without_an_optimizer_loads_a_training_checkpoints_weights(tmp_path):
    """The README's teacher or evaluation model: rt.manage(model) loads the model's entries of a
    checkpoint saved while training, and leaves its optimizer's."""
    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        train(model, optimizer, schedule, range(2))
        rt.save(path)
        want = {k: v.clone() for k, v in model.state_dict().items()}
    with tiermem.Runtime(config(tmp_path)) as rt:
        teacher = rt.manage(make_model(seed=1))
        rt.load(path)
        got = {k: v.clone() for k, v in teacher.state_dict().items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("what", ["directory", "file", "symlink", "broken_manifest"])
def test_save_refuses_a_path_that_is_not_a_checkpoint(tmp_path, what):
    """Rule 6 of NOTE [ Checkpoint commit rules ]: never swap out and remove a user's files."""
    path = tmp_path / "ckpt"
    if what == "directory":
        path.mkdir()
        (path / "notes.txt").write_text("keep me")
    elif what == "file":
        path.write_text("keep me")
    elif what == "symlink":
        (tmp_path / "target").mkdir()
        (tmp_path / "target" / "notes.txt").write_text("keep me")
        path.symlink_to(tmp_path / "target")
    else:
        path.mkdir()
        (path / files.MANIFEST).write_text('{"format": "something-else"}')
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "nvme" not in p.parts)
    with tiermem.Runtime(config(tmp_path)) as rt:
        manage(rt)
        with pytest.raises(CheckpointError, match="choose a new or empty directory") as info:
            rt.save(path)
        assert str(path) in str(info.value) and info.value.path == str(path)
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "nvme" not in p.parts)
    assert after == before and _leftovers(path) == []
    if what in ("directory", "file"):
        assert (path / "notes.txt" if what == "directory" else path).read_text() == "keep me"


def test_save_into_an_empty_directory_and_over_a_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    with tiermem.Runtime(config(tmp_path)) as rt:
        manage(rt)
        rt.save(path, extra=1)
        rt.save(path, extra=2)
        assert rt.load(path) == 2 and _leftovers(path) == []


def _foreign_checkpoint(path: pathlib.Path, edit: str) -> None:
    """A plain DCP checkpoint of Net + AdamW with one tensor changed (``edit``)."""
    plain = make_model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    train(plain, optimizer, schedule, range(1))
    model_sd, optim_sd = get_state_dict(plain, optimizer)
    state = optim_sd["state"]["layers.1.weight"]
    if edit == "shape":
        state["exp_avg"] = torch.ones(1, state["exp_avg"].shape[1])  # would broadcast
    elif edit == "dtype":
        state["exp_avg"] = state["exp_avg"].double()  # would cast
    elif edit == "model_dtype":
        model_sd["layers.1.weight"] = model_sd["layers.1.weight"].double()
    elif edit == "groups":
        optim_sd["param_groups"][0]["params"] = optim_sd["param_groups"][0]["params"][:-1]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)


@pytest.mark.parametrize("edit", ["shape", "dtype", "model_dtype"])
def test_load_refuses_other_shapes_and_dtypes_before_writing(tmp_path, edit):
    path = tmp_path / "plain"
    _foreign_checkpoint(path, edit)
    with tiermem.Runtime(config(tmp_path)) as rt:
        model = make_model(seed=1)
        model, optimizer = rt.manage(model, torch.optim.AdamW(model.parameters(), lr=1.0), plan=PLAN)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        train(model, optimizer, schedule, range(1))
        before = snapshot(model, optimizer)
        with pytest.raises(CheckpointError, match=r"layers\.1\.weight.*shape.*dtype") as info:
            rt.load(path)
        assert "nothing was loaded" in str(info.value)
        assert_bitwise(snapshot(model, optimizer), before)


def test_load_refuses_other_param_groups_before_writing(tmp_path):
    path = tmp_path / "plain"
    _foreign_checkpoint(path, "groups")
    with tiermem.Runtime(config(tmp_path)) as rt:
        model = make_model(seed=1)
        model, optimizer = rt.manage(model, torch.optim.AdamW(model.parameters(), lr=1.0), plan=PLAN)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        train(model, optimizer, schedule, range(1))
        before = snapshot(model, optimizer)
        with pytest.raises(CheckpointError, match=r"other optimizer parameter groups.*nothing was loaded"):
            rt.load(path)
        assert_bitwise(snapshot(model, optimizer), before)  # checked before the first write


@pytest.mark.parametrize(
    ("saved_with", "loaded_into", "foreign"),
    [
        ((torch.optim.AdamW, {}), (torch.optim.SGD, {"momentum": 0.9}), "exp_avg"),
        ((torch.optim.SGD, {"momentum": 0.9}), (torch.optim.AdamW, {}), "momentum_buffer"),
        ((torch.optim.AdamW, {"amsgrad": True}), (torch.optim.AdamW, {}), "max_exp_avg_sq"),
    ],
)
def test_load_refuses_another_optimizers_states_before_writing(tmp_path, saved_with, loaded_into, foreign):
    """A checkpoint of another optimizer (or of other settings) is refused, naming the state this
    one does not keep, before anything is written: loaded, its param groups would bring the other
    optimizer's hyper-parameters (AdamW's weight decay) into this one's step."""
    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        model = make_model(seed=0)
        model, optimizer = rt.manage(model, saved_with[0](model.parameters(), lr=0.1, **saved_with[1]), plan=PLAN)
        train(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2), range(1))
        rt.save(path)
    with tiermem.Runtime(config(tmp_path)) as rt:
        model = make_model(seed=1)
        model, optimizer = rt.manage(model, loaded_into[0](model.parameters(), lr=0.1, **loaded_into[1]), plan=PLAN)
        train(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2), range(1))
        before = snapshot(model, optimizer)
        with pytest.raises(
            CheckpointError, match=rf"optimizer state '{foreign}' of .*does not keep.*nothing was loaded"
        ):
            rt.load(path)
        assert_bitwise(snapshot(model, optimizer), before)


def test_a_load_failing_after_writes_began_says_so(tmp_path, monkeypatch):
    from tiermem.states.stateio import StateIO

    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        manage(rt)
        rt.save(path, extra="saved")

        def broken(*args: Any, **kwargs: Any) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(StateIO, "set_scalars", broken)
        with pytest.raises(CheckpointError, match=r"partly overwritten.*Load a checkpoint again") as info:
            rt.load(path)
        assert isinstance(info.value.__cause__, OSError)
        monkeypatch.undo()
        assert rt.load(path) == "saved"


def test_save_between_backward_and_step_is_refused(tmp_path):
    """Undeclared loop: gradients accumulated since the last step would be lost by a checkpoint."""
    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, _ = manage(rt)
        model(torch.randn(2, W)).sum().backward()
        with pytest.raises(StatesUsageError, match=r"since the last optimizer\.step\(\).*Save after"):
            rt.save(path)
        assert not path.exists() and _leftovers(path) == []
        optimizer.zero_grad()  # the gradients are gone: nothing to lose
        rt.save(path, extra=1)
        model(torch.randn(2, W)).sum().backward()
        with pytest.raises(StatesUsageError, match="optimizer"):
            rt.save(path, extra=2)
        optimizer.step()
        rt.save(path, extra=3)
        optimizer.zero_grad()
        rt.save(path, extra=4)
        assert rt.load(path) == 4


def _commit_copy_of(source: pathlib.Path, path: pathlib.Path) -> None:
    """Another save committing to ``path`` (as a second process would): ``source``'s files, staged
    beside ``path`` and committed by NOTE [ Checkpoint commit rules ]'s own steps."""
    staging = files.Staging(path)
    for file in source.iterdir():
        if file.name != files.MANIFEST:
            (staging.dir / file.name).write_bytes(file.read_bytes())
    staging.commit()


def test_a_load_reads_one_checkpoint_while_a_save_commits_to_its_path(tmp_path, monkeypatch):
    """NOTE [ Checkpoint commit rules ] rule 7: a save committing to the path between the load's
    verification and its reads waits for the load, which reads only the checkpoint it verified."""
    import threading

    path, other = tmp_path / "ckpt", tmp_path / "other"
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, optimizer, schedule = manage(rt)
        rt.save(path, extra="A")
        weights_a = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, optimizer, schedule, range(1))
        rt.save(other, extra="B")
        verify, committer = files.verify, threading.Thread(target=_commit_copy_of, args=(other, path))

        def verify_then_a_save_commits(directory: pathlib.Path) -> bool:
            verified = verify(directory)
            if directory == path and not committer.is_alive():
                committer.start()
                committer.join(timeout=1.0)  # before rule 7 it committed B here, under the load's feet
            return verified

        monkeypatch.setattr(files, "verify", verify_then_a_save_commits)
        assert rt.load(path) == "A"
        for name, value in model.state_dict().items():
            assert torch.equal(value, weights_a[name]), name
        committer.join(timeout=30)
        assert not committer.is_alive()
        monkeypatch.undo()
        assert rt.load(path) == "B" and _leftovers(path) == []


def test_a_copy_without_tiermems_files_is_refused_naming_them(tmp_path):
    """Rule 4: a tiermem checkpoint copied without its manifest and state file (its DCP files
    only) is refused, never loaded unverified; plain PyTorch still reads its weights."""
    path, copy = tmp_path / "ckpt", tmp_path / "copy"
    copy.mkdir()
    with tiermem.Runtime(config(tmp_path)) as rt:
        model, _, _ = manage(rt)
        rt.save(path)
        for name in (files.DCP_METADATA, DATA_FILE["dcp"]):
            (copy / name).write_bytes((path / name).read_bytes())
        with pytest.raises(CheckpointError) as info:
            rt.load(copy)
        message = str(info.value)
        assert f"{files.MANIFEST} and {files.STATE_FILE} are missing" in message
        assert "'tiermem' entry" in message and "Copy the whole checkpoint directory again" in message
        (copy / files.STATE_FILE).write_bytes((path / files.STATE_FILE).read_bytes())
        with pytest.raises(CheckpointError, match=f"{files.MANIFEST} is missing"):
            rt.load(copy)
    plain = make_model(seed=7)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": plain.state_dict()}, checkpoint_id=copy)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


@pytest.mark.parametrize("failure", ["locking the temporary directory", "the second rename of a fallback commit"])
def test_a_save_failing_anywhere_leaves_no_files_behind(tmp_path, monkeypatch, failure):
    """Rules 1, 3 and 5 with a failure injected: the temporary sibling is removed (also when
    locking it fails, right after it was made), and a fallback commit whose second rename fails
    puts the previous checkpoint back at the path."""
    import fcntl

    path = tmp_path / "ckpt"
    with tiermem.Runtime(config(tmp_path)) as rt:
        manage(rt)
        rt.save(path, extra="first")
        if failure == "locking the temporary directory":
            flock = fcntl.flock

            def broken_flock(fd: int, operation: int) -> None:
                if operation == fcntl.LOCK_EX and ".tiermem-tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
                    raise OSError(37, "No locks available")
                flock(fd, operation)

            monkeypatch.setattr(fcntl, "flock", broken_flock)
        else:
            rename = os.rename
            monkeypatch.setattr(files, "_exchange", lambda a, b: False)

            def broken_rename(src: Any, dst: Any) -> None:
                if ".tiermem-tmp-" in str(src) and pathlib.Path(dst) == path:
                    raise OSError(5, "Input/output error")
                rename(src, dst)

            monkeypatch.setattr(os, "rename", broken_rename)
        with pytest.raises(OSError):
            rt.save(path, extra="second")
        monkeypatch.undo()
        assert _leftovers(path) == []
        assert rt.load(path) == "first"
