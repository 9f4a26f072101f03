"""``tiermem train`` and :func:`tiermem.app.train.train`: the JSON summary, real NVMe traffic under
the ``nvme`` policy, losses bitwise equal to plain PyTorch, and one-line errors.

Tests that need ``Runtime.offload_activations`` skip while it is not there; the loop's own
mechanics are checked with a stand-in context manager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tiermem
from tiermem.app.models import GPT, GPTConfig, MarkovChainData
from tiermem.app.models.gpt import ActivationBytes, measure_activations
from tiermem.app.train import drive_capacity, train
from tiermem.cli import main
from tiermem.cli.train_cmd import _budget

needs_offload = pytest.mark.skipif(
    not hasattr(tiermem.Runtime, "offload_activations"),
    reason="Runtime.offload_activations (tiermem/activations, issue 4) is not there yet",
)

TINY = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=64, seq_len=32)
TINY_ARGS = ["--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "64", "--seq-len", "32"]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No stray TIERMEM_* settings from the developer's shell; the planner's profiles cached
    under tmp_path, not in the user's cache."""
    for name in list(os.environ):
        if name.upper().startswith("TIERMEM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _config_file(tmp_path: Path) -> str:
    """Run files under tmp_path; ``min_bytes = 0`` because the tiny model's tensors are all
    far below the 1MiB default, which would keep every one of them resident."""
    (tmp_path / "nvme").mkdir(exist_ok=True)
    path = tmp_path / "tiers.toml"
    path.write_text(
        f'[device]\ndevice = "cpu"\n[nvme]\npaths = ["{tmp_path / "nvme"}"]\n'
        f'[scheduler]\nloop = "asyncio"\n[activations]\nmin_bytes = 0\n'
    )
    return str(path)


def _train_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["train", *TINY_ARGS, "--steps", "5", "--json", *args]) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # one JSON object and nothing else on stdout


def _plain_losses(config: GPTConfig, *, steps: int, batch_size: int, lr: float, seed: int) -> list[float]:
    """The same training without tiermem, seeded as tiermem.app.train documents."""
    torch.manual_seed(seed)
    model = GPT(config)
    data = MarkovChainData(config.vocab_size, config.seq_len, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        x, y = data.batch(batch_size)
        _, loss = model(x, y)
        assert loss is not None
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@needs_offload
def test_train_json_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = _train_json(capsys, "--config", _config_file(tmp_path))
    assert len(result["losses"]) == result["steps"] == 5
    assert all(isinstance(x, float) and math.isfinite(x) for x in result["losses"])
    assert result["loss_first"] == result["losses"][0] and result["loss_last"] == result["losses"][-1]
    assert len(result["step_seconds"]) == 5 and result["median_step_s"] > 0 and result["tokens_per_s"] > 0
    assert result["tokens_per_step"] == 8 * 32
    assert result["policy"] == "auto"  # the configuration's default
    assert set(result["tiers"]) == {"device", "host", "nvme"}
    for tier in result["tiers"].values():
        assert set(tier) == {"capacity", "peak_bytes", "bytes_written", "bytes_read"}
        assert all(isinstance(v, int) for v in tier.values())
    assert isinstance(result["activations"], dict) and "peak_resident_bytes" in result["activations"]
    # The default budget is below what the model's activations need (measured), but not below
    # what the offloader needs: outside-of-block bytes plus 1.25 blocks (2 blocks: 66%); plus a
    # quarter of the model-state bytes, through which the chunks stream.
    budget = result["device_budget"]
    measured = measure_activations(TINY, 8)
    for_activations = max(measured.total // 2, measured.outside + int(1.25 * max(measured.blocks)))
    state_bytes = 16 * GPT(TINY).num_parameters()
    expected = for_activations + state_bytes // 4
    assert budget["source"] == "default" and budget["activation_bytes_per_step"] == measured.total
    assert budget["model_state_bytes"] == state_bytes
    assert result["tiers"]["device"]["capacity"] == budget["bytes"] == expected
    assert for_activations < measured.total
    assert budget["fraction_of_activations"] == pytest.approx(expected / measured.total)
    states = result["model_states"]
    assert states["parameters"] == GPT(TINY).num_parameters()
    assert states["persistent_chunks"] + sum(states["homes"].values()) == states["chunks"]
    assert 0 < states["peak_device_chunk_bytes"] <= result["tiers"]["device"]["capacity"]
    # The planner decided (NOTE [ Predicted and measured ]): predicted next to measured.
    plan = result["plan"]
    assert plan["source"] == "planner" and plan["reasons"] and plan["activations_as_planned"]
    assert plan["chunk_size"] == states["chunk_size"] and plan["persistent_chunks"] == states["persistent_chunks"]
    assert len(plan["block_policy"]) == TINY.n_layer and len(plan["state_home"]) == states["chunks"]
    assert plan["capacities"]["device"] == result["tiers"]["device"]["capacity"]
    assert plan["measured"]["step_s"] == result["median_step_s"]
    for tier in ("device", "host", "nvme"):
        # The steps' peak (NOTE [ Predicted and measured ] rule 2); the tiers' own cover the
        # Runtime's life, the planner's probes included.
        assert 0 <= plan["measured"]["peak_bytes"][tier] <= result["tiers"][tier]["peak_bytes"]
        predicted = plan["predicted"]["peak_bytes"][tier]
        assert isinstance(predicted, int) and predicted <= plan["capacities"][tier]
    assert plan["predicted"]["step_s"] > 0
    assert plan["ratios"]["step_s"] == pytest.approx(plan["predicted"]["step_s"] / plan["measured"]["step_s"])
    device_peak = plan["measured"]["peak_bytes"]["device"]
    assert 0 < device_peak <= plan["capacities"]["device"]  # the capacity is a promise
    predicted_device = plan["predicted"]["peak_bytes"]["device"]
    assert plan["ratios"]["peak_bytes"]["device"] == pytest.approx(predicted_device / device_peak)
    # Below the need: something left the device (streamed chunks, or activations not kept).
    assert states["persistent_chunks"] < states["chunks"] or set(plan["block_policy"]) != {"keep"}
    nvme = result["nvme"]
    assert set(nvme) >= {"bytes_written_per_step", "drive_bytes", "drive_writes_per_day", "assumption"}
    assert nvme["drive_bytes"] == drive_capacity(nvme["paths"]) > 0
    assert nvme["drive_writes_per_day"] == pytest.approx(nvme["bytes_written_per_s"] * 86400 / nvme["drive_bytes"])
    assert os.listdir(tmp_path / "nvme") == []  # the run's files are gone


@needs_offload
def test_nvme_policy_writes_to_nvme(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = _train_json(capsys, "--config", _config_file(tmp_path), "--policy", "nvme")
    assert result["policy"] == "nvme"
    # The planner planned the model states around the fixed activation policy, or (when none fits
    # the budget) freely, and says the run's policy is not the plan's.
    plan = result["plan"]
    assert plan["source"] == "planner"
    assert plan["block_policy"] == ["nvme"] * TINY.n_layer or not plan["activations_as_planned"]
    assert all(math.isfinite(x) for x in result["losses"])
    assert result["tiers"]["nvme"]["bytes_written"] > 0
    assert result["nvme"]["bytes_written_per_step"] == result["nvme"]["bytes_written"] / 5 > 0
    assert result["nvme"]["drive_writes_per_day"] > 0


@needs_offload
def test_measured_peaks_leave_out_the_planners_probes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Room for everything on the device: the plan puts nothing on the host or NVMe, while the
    # planner's link probes (a quarter of the least free tier, 16MiB here) went through all three.
    config = tmp_path / "roomy.toml"
    config.write_text(Path(_config_file(tmp_path)).read_text().replace("[device]\n", '[device]\ncapacity = "64MiB"\n'))
    result = _train_json(capsys, "--config", str(config), "--steps", "2")
    plan = result["plan"]
    assert plan["source"] == "planner"
    assert plan["predicted"]["peak_bytes"]["host"] == plan["predicted"]["peak_bytes"]["nvme"] == 0
    assert result["tiers"]["host"]["peak_bytes"] > 0 and result["tiers"]["nvme"]["peak_bytes"] > 0  # the probes
    measured = plan["measured"]["peak_bytes"]
    assert measured["host"] == measured["nvme"] == 0  # the steps put nothing there
    assert plan["ratios"]["peak_bytes"]["host"] is None and plan["ratios"]["peak_bytes"]["nvme"] is None
    # The device's peak is the steps' too: below the 16MiB probe, and close to the prediction.
    assert 0 < measured["device"] < result["tiers"]["device"]["peak_bytes"]
    assert plan["ratios"]["peak_bytes"]["device"] == pytest.approx(
        plan["predicted"]["peak_bytes"]["device"] / measured["device"]
    )
    assert 0.5 < plan["ratios"]["peak_bytes"]["device"] < 2


def test_reset_peak_starts_a_tiers_peak_over_from_what_it_holds(tmp_path: Path) -> None:
    with tiermem.Runtime(_config_file(tmp_path)) as rt:
        host = rt.tiers["host"]
        host.free(host.allocate(8 << 20))  # a probe, before the steps
        kept = host.allocate(1 << 20)  # held when the steps begin (a chunk's home)
        assert host.statistics().peak_bytes == 8 << 20
        host.reset_peak()
        assert host.statistics().peak_bytes == 1 << 20
        first = host.allocate(2 << 20)
        host.free(first)
        assert host.statistics().peak_bytes == 3 << 20
        host.free(kept)


def test_configured_device_capacity_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tiermem.Runtime, "offload_activations", _stand_in_offload, raising=False)
    result = _train_json(capsys, "--config", _config_file(tmp_path), "--steps", "1")
    assert result["device_budget"]["source"] == "default"  # [device] without a capacity
    path = tmp_path / "explicit.toml"
    path.write_text(f'[device]\ncapacity = "3MiB"\n[nvme]\npaths = ["{tmp_path / "nvme"}"]\n')
    result = _train_json(capsys, "--config", str(path), "--steps", "1")
    assert result["device_budget"]["source"] == "config"
    assert result["tiers"]["device"]["capacity"] == 3 << 20


@needs_offload
def test_state_home_gives_a_hand_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A roomier device than the default budget: this is about the plan's plumbing.
    config = tmp_path / "roomy.toml"
    config.write_text(Path(_config_file(tmp_path)).read_text().replace("[device]\n", '[device]\ncapacity = "8MiB"\n'))
    result = _train_json(capsys, "--config", str(config), "--state-home", "nvme", "--steps", "2")
    plan = result["plan"]
    assert plan["source"] == "hand" and plan["predicted"]["step_s"] is None and plan["ratios"]["step_s"] is None
    assert "host" not in result["model_states"]["homes"]
    saved = tmp_path / "plan.json"
    saved.write_text(json.dumps({"persistent_chunks": 0, "state_home": "nvme"}))
    result = _train_json(capsys, "--config", str(config), "--plan", str(saved), "--steps", "2")
    states = result["model_states"]
    assert result["plan"]["source"] == "hand" and states["persistent_chunks"] == 0
    assert states["homes"] == {"nvme": states["chunks"]} and result["tiers"]["nvme"]["peak_bytes"] > 0


def test_default_budget_is_below_the_need_unless_it_cannot_be() -> None:
    config = tiermem.Config()
    four = ActivationBytes(total=1000, blocks=(240, 240, 240, 240), outside=40)
    assert _budget(config, four, "auto")["bytes"] == 500  # half: above 40 + 1.25 x 240
    assert _budget(config, four, "nvme")["source"] == "default"
    # keep holds every activation: a lower budget could only fail, so it stays auto.
    assert _budget(config, four, "keep") == {**_budget(config, four, "keep"), "bytes": None, "source": "auto"}
    one = ActivationBytes(total=1000, blocks=(840,), outside=160)  # no room below the need
    assert _budget(config, one, "nvme")["source"] == "auto"
    explicit = dataclasses.replace(config, device=dataclasses.replace(config.device, capacity=123))
    assert _budget(explicit, four, "keep") == {**_budget(explicit, four, "keep"), "bytes": 123, "source": "config"}


@needs_offload
@pytest.mark.parametrize("policy", ["keep", "recompute", "host", "nvme"])
def test_losses_are_bitwise_those_of_plain_pytorch(tmp_path: Path, policy: str) -> None:
    expected = _plain_losses(TINY, steps=4, batch_size=4, lr=3e-3, seed=7)
    config = tiermem.Config.coerce(_config_file(tmp_path))
    with tiermem.Runtime(config) as rt:
        summary = train(rt, TINY, steps=4, batch_size=4, lr=3e-3, policy=policy, seed=7, progress=False)
    assert summary.losses == expected  # exact float equality, not approx


@contextlib.contextmanager
def _stand_in_offload(
    self: tiermem.Runtime, model: torch.nn.Module, policy: Any = None, blocks: Any = None
) -> Iterator[None]:
    """Counts saved tensors, the way the real one captures them, and does nothing else."""
    calls = getattr(self, "_test_calls", [])
    self._test_calls = calls  # type: ignore[attr-defined]
    record = {"model": model, "policy": policy, "saved": 0}
    calls.append(record)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        record["saved"] += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def test_loop_runs_forward_and_backward_inside_offload_activations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tiermem.Runtime, "offload_activations", _stand_in_offload, raising=False)
    steps: list[tuple[int, float]] = []
    torch.manual_seed(123)
    before = torch.rand(2)
    torch.manual_seed(123)
    with tiermem.Runtime(_config_file(tmp_path)) as rt:
        summary = train(
            rt,
            TINY,
            steps=3,
            batch_size=2,
            lr=1e-3,
            policy={0: "keep", "blocks.1": "nvme"},
            seed=1,
            progress=False,
            on_step=lambda step, loss, seconds: steps.append((step, loss)),
        )
        calls = rt._test_calls  # type: ignore[attr-defined]
    assert torch.equal(torch.rand(2), before)  # the caller's RNG is left as it was
    assert len(calls) == 3 and all(isinstance(c["model"], GPT) and c["saved"] > 0 for c in calls)
    assert calls[0]["policy"] == {0: "keep", "blocks.1": "nvme"}
    assert summary.policy == {"0": "keep", "blocks.1": "nvme"}  # JSON-able keys
    assert [s for s, _ in steps] == [0, 1, 2] and [loss for _, loss in steps] == summary.losses
    assert summary.losses == _plain_losses(TINY, steps=3, batch_size=2, lr=1e-3, seed=1)
    assert summary.nvme["bytes_written"] == 0 and summary.nvme["drive_writes_per_day"] == 0


def test_a_fixed_policy_that_fits_no_plan_is_planned_around_its_fallbacks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NOTE [ Predicted and measured ] rule 3: rt.manage's NoPlanFitsError for a fixed policy
    leads to a plan around the offloader's fallbacks (and ``activations_as_planned`` false);
    under ``auto`` it is the run's error."""
    import tiermem.app.train as train_module
    from tiermem.planner.errors import NoPlanFitsError

    no_fit = NoPlanFitsError({"device": 1}, {"device": 1}, {"device": 2}, ["raise device"])
    plans: list[Any] = []

    def manage(model: Any, optimizer: Any, *, plan: Any, sample: Any, grad_accumulation_steps: int) -> Any:
        plans.append(plan)
        raise no_fit

    rt: Any = type("FakeRuntime", (), {})()
    rt.manage = manage
    rt.config = tiermem.Config()  # [activations] policy "auto"
    around = []
    monkeypatch.setattr(
        train_module, "_manage_around_fallbacks", lambda *args: around.append(args) or ("model", "optimizer")
    )
    with caplog.at_level("WARNING", logger="tiermem.app.train"):
        assert train_module._manage_planned(rt, "m", "o", "nvme", "sample") == ("model", "optimizer", False)
    assert plans == [{"block_policy": "nvme"}] and around == [(rt, "m", "o", "nvme", "sample")]
    assert "no plan fits policy 'nvme'" in caplog.text
    with pytest.raises(NoPlanFitsError):
        train_module._manage_planned(rt, "m", "o", None, "sample")  # auto: nothing to plan around
    assert plans[-1] == "auto" and len(around) == 1


def test_human_output_has_the_summary_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tiermem.Runtime, "offload_activations", _stand_in_offload, raising=False)
    assert main(["train", *TINY_ARGS, "--steps", "2", "--config", _config_file(tmp_path)]) == 0
    out = capsys.readouterr().out
    for text in ("device budget", "[device]", "nvme", "policy", "loss", "tokens/s", "drive writes per day"):
        assert text in out, text


def test_bad_model_sizes_are_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--d-model", "100", "--heads", "3", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "divisible" in captured.err and "Traceback" not in captured.err


def test_bad_config_is_reported_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[device]\ncapacity = 'lots'\n")
    assert main(["train", "--config", str(path), "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "device.capacity" in captured.err and "Traceback" not in captured.err


def test_drive_capacity_counts_each_filesystem_once(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    one = drive_capacity([str(tmp_path)])
    assert one > 0
    assert drive_capacity([str(tmp_path), str(tmp_path / "a")]) == one  # one filesystem
    assert drive_capacity([str(tmp_path / "not" / "yet")]) == one  # measured where it would live


def _default_signals() -> None:
    """In the child, before it runs: the dispositions a process started from a terminal has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_training_stops_after_the_step_and_leaves_no_files(tmp_path, sig):
    """One Ctrl-C (or SIGTERM) stops the run between steps, exit status 130, no files left:
    a KeyboardInterrupt raised wherever the signal lands could be lost in a __del__."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "TIERMEM_ACTIVATIONS_MIN_BYTES": "4KiB"}
    argv = [
        sys.executable,
        "-m",
        "tiermem",
        "train",
        "--steps",
        "100000",
        "--layers",
        "2",
        "--d-model",
        "64",
        "--heads",
        "2",
        "--seq-len",
        "64",
        "--vocab",
        "64",
        "--policy",
        "nvme",
        "--json",
    ]
    # SIGINT (and SIGTERM) reset to default: a shell runs background jobs (and so this suite)
    # with SIGINT ignored, the child inherits that, and tiermem leaves an ignored signal ignored.
    child = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_signals,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(
            tmp_path.glob(f"tiermem-nvme-{os.geteuid()}/tiermem-run-*/data")
        ):
            time.sleep(0.05)
        time.sleep(1.0)  # planning or the steps, depending on the machine: either must stop
        child.send_signal(sig)
        _out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    # 130, or (seen about 1 run in 6, for SIGTERM too) the process ends by SIGINT after tiermem's cleanup ran
    # and printed its message: CPython can exit via SIGINT once an interrupt passed through
    # it (exit_sigint), even though tiermem caught it. A shell reports both as status 130.
    assert child.returncode in (130, -signal.SIGINT), err
    assert "tiermem: interrupted" in err
    assert "Traceback" not in err
    # The planner's profile cache (XDG_CACHE_HOME, under tmp_path here) is kept on purpose.
    assert [p for p in tmp_path.rglob("*") if p.is_file() and "cache" not in p.relative_to(tmp_path).parts] == []


@needs_offload
@pytest.mark.usefixtures("interrupt_signals")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_planning_stops_before_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: signal.Signals
) -> None:
    """A signal that lands while the planner profiles (saved activations released in __del__,
    where a raised KeyboardInterrupt is only printed) still stops the run: before the first
    step, with every run file removed and the caller's signal handlers back in place."""
    manage = tiermem.Runtime.manage

    class SignalledInDel:
        def __del__(self) -> None:
            os.kill(os.getpid(), sig)  # its handler runs here, inside __del__, in the main thread

    def manage_then_signal(self: tiermem.Runtime, *args: Any, **kwargs: Any) -> Any:
        result = manage(self, *args, **kwargs)
        SignalledInDel()  # released at once, as autograd releases a saved activation
        return result

    monkeypatch.setattr(tiermem.Runtime, "manage", manage_then_signal)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    steps: list[int] = []
    config = tiermem.Config.coerce(_config_file(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        train(
            tiermem.Runtime(config),
            TINY,
            steps=5,
            batch_size=2,
            lr=1e-3,
            policy="nvme",
            progress=False,
            on_step=lambda step, _loss, _seconds: steps.append(step),
        )
    assert steps == []
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert [p for p in (tmp_path / "nvme").rglob("*") if p.is_file()] == []


@needs_offload
@pytest.mark.usefixtures("interrupt_signals")
def test_a_signal_during_a_step_stops_after_that_step(tmp_path: Path) -> None:
    """The first signal lets the step it lands in finish (its loss is reported), then stops."""
    steps: list[int] = []

    def on_step(step: int, _loss: float, _seconds: float) -> None:
        steps.append(step)
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)

    config = tiermem.Config.coerce(_config_file(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        rt = tiermem.Runtime(config)
        train(rt, TINY, steps=5, batch_size=2, lr=1e-3, policy="nvme", progress=False, on_step=on_step)
    assert steps == [0, 1]
    assert [p for p in (tmp_path / "nvme").rglob("*") if p.is_file()] == []
