"""bench/deepspeed.py without DeepSpeed: its arguments, the configurations it generates, its
summary's loss checks, and one tiny run with the DeepSpeed venv absent. Nothing is installed and
no timing is asserted (speed goals live in bench/, never in timed tests)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.bench_modules import bench_on_path
from tiermem.app.models.gpt import GPT, GPTConfig

BENCH = Path(__file__).resolve().parent.parent / "bench" / "deepspeed.py"


def _bench() -> ModuleType:
    # Loaded under another name: as `deepspeed` it would shadow the real package for anything after.
    spec = importlib.util.spec_from_file_location("bench_deepspeed", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # It imports its neighbours (bench/arguments.py) at import: they must be found whether or not
    # another test imported them into this process first.
    with bench_on_path():
        spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("size", ["tiny", "34M"])
def test_model_shape_counts_the_gpts_parameters(size: str) -> None:
    bench = _bench()
    fields = {k: v for k, v in bench.SIZES[size].items() if k != "batch"}
    with torch.device("meta"):
        model = GPT(GPTConfig(**fields))
    shape = bench.model_shape(size)
    assert shape["params"] == model.num_parameters()
    assert shape["largest"] == max(p.numel() for p in model.parameters())
    assert shape["state_bytes"] == 16 * model.num_parameters()


def test_dry_run_sizes_both_libraries_to_the_same_capacities(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bench = _bench()
    absent = tmp_path / "no-venv"
    assert bench.main(["--dry-run", f"--nvme-path={tmp_path}", f"--venv={absent}"]) == 0
    report = json.loads(capsys.readouterr().out)
    shape = report["model"]
    assert shape["params"] == 33_739_776 and report["configs"] == list(bench.CONFIGS)
    tiers = report["tiermem"]
    assert tiers["device"]["capacity"] == int(0.15 * shape["state_bytes"])
    assert tiers["host"]["capacity"] == int(0.25 * shape["state_bytes"])
    zero = report["deepspeed"]["zero_optimization"]
    assert zero["stage"] == 3
    param, optim = zero["offload_param"], zero["offload_optimizer"]
    assert param["device"] == optim["device"] == "nvme"
    assert param["nvme_path"] == optim["nvme_path"] == tiers["nvme"]["paths"][0]
    # each parameter swap buffer holds the largest parameter; the optimizer's buffers fit the host
    assert param["buffer_size"] == shape["largest"] and param["max_in_cpu"] == 0
    assert optim["buffer_count"] * zero["sub_group_size"] * 4 <= tiers["host"]["capacity"]
    assert zero["stage3_max_live_parameters"] * 4 <= max(tiers["device"]["capacity"], 4 * shape["largest"])
    adamw = report["deepspeed"]["optimizer"]
    assert adamw["type"] == "AdamW" and adamw["params"]["lr"] == bench.LR
    assert adamw["params"]["weight_decay"] == torch.optim.AdamW([torch.zeros(1)]).defaults["weight_decay"]
    assert not absent.exists(), "a dry run must install nothing"
    cpu = bench.deepspeed_config("tiny", 0.15, 0.25, str(tmp_path), offload="cpu")["zero_optimization"]
    assert cpu["offload_param"]["device"] == cpu["offload_optimizer"]["device"] == "cpu"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--configs", "pytorch,megatron"], "unknown ['megatron']"),
        (["--device-fraction", "0.6", "--host-fraction", "0.5"], "add up to less than 1"),
        (["--steps", "0"], "must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_with_the_reason(argv: list[str], words: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _bench().parse_args(argv)
    assert words in capsys.readouterr().err


def test_summary_checks_losses_bitwise_for_tiermem_and_within_the_tolerance_for_deepspeed() -> None:
    bench = _bench()

    def run(config: str, losses: list[float], step: float, rss: int) -> dict[str, object]:
        return {"config": config, "params": 1, "losses": losses, "step_s": [step], "cpu_s": [step],
                "first_step_s": step, "ru_maxrss": rss}  # fmt: skip

    reference = [4.0, 3.5, 3.25]
    near = [x * (1 + bench.LOSS_RTOL / 2) for x in reference]
    summary = bench.summarize(
        {
            "pytorch": [run("pytorch", reference, 1.0, 400)],
            "declared": [run("declared", list(reference), 0.5, 100)],
            "plain": [run("plain", [4.0, 3.5, 3.2500001], 0.8, 100)],
            "deepspeed": [run("deepspeed", near, 2.0, 200)],
        }
    )
    assert summary["declared"]["losses_vs_pytorch"] == {"bitwise": True}
    assert summary["plain"]["losses_vs_pytorch"] == {"bitwise": False}
    assert summary["deepspeed"]["losses_vs_pytorch"]["agree"] is True
    assert summary["declared"]["vs_deepspeed"] == {"step": 0.25, "cpu": 0.25, "ru_maxrss": 0.5}
    far = bench.summarize(
        {"pytorch": [run("pytorch", reference, 1, 1)], "deepspeed": [run("deepspeed", [4.0, 3.6, 3.3], 1, 1)]}
    )
    assert far["deepspeed"]["losses_vs_pytorch"]["agree"] is False


def test_tiny_run_without_the_venv_skips_deepspeed_and_trains_bitwise(tmp_path: Path) -> None:
    command = [
        sys.executable, str(BENCH), "--size=tiny", "--rounds=1", "--steps=1", "--warmup=1",
        "--configs=pytorch,plain,deepspeed", f"--venv={tmp_path / 'no-venv'}", f"--nvme-path={tmp_path}", "--json",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert any("deepspeed skipped" in note for note in report["notes"])
    assert set(report["configs"]) == {"pytorch", "plain"}
    plain = report["configs"]["plain"]
    assert plain["losses_vs_pytorch"] == {"bitwise": True} and plain["median_step_s"] > 0 and plain["ru_maxrss"] > 0
    for tier in ("device", "host"):
        assert 0 < plain["tiers"][tier]["peak_bytes"] <= plain["tiers"][tier]["capacity"]
    assert report["left_behind"] == [] and [p.name for p in tmp_path.iterdir()] == []
