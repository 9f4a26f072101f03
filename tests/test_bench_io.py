"""``tiermem bench io``: every mode at a tiny size, verification, Ctrl-C cleanup, bad input.

Runs go through ``tiermem.cli.main`` in-process (torch is imported once) with ``--path``
pointing at a test directory that must be empty again afterwards. Only the interrupt tests
start a real ``tiermem`` process. No timing is asserted anywhere: numbers only have to be
positive and the JSON shaped as scripts expect.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tiermem.cli import main
from tiermem.tiers.backends import aio, kvikio_backend, select_backend
from tiermem.tiers.backends.aio import AioBackend
from tiermem.tiers.backends.faulty import FaultyBackend
from tiermem.tiers.backends.posix import PosixBackend
from tiermem.units import parse_size

RESULT_KEYS = {
    "tier",
    "backend",
    "op",
    "size",
    "block_size",
    "queue_depth",
    "repeats",
    "bytes_per_s",
    "requests_per_s",
    "latency_s",
}
TINY = ["--size", "2MiB", "--block-size", "256KiB", "--queue-depth", "4", "--repeats", "2"]


def auto_backend(path: Path) -> str:
    """What ``--backend auto`` picks for ``path`` here (aio where Linux AIO works, else posix)."""
    return select_backend("auto", path)[0].name


def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["bench", "io", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def bench_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    status, out, err = bench(capsys, *argv, "--json")
    assert status == 0, err
    return json.loads(out)


def check_shape(report: dict[str, Any]) -> None:
    assert set(report) == {"machine", "results"}
    assert report["machine"]["cpu_count"] >= 1
    assert report["results"]
    for result in report["results"]:
        assert set(result) == RESULT_KEYS
        for key in ("size", "block_size", "queue_depth", "repeats"):
            assert type(result[key]) is int and result[key] > 0
        assert set(result["bytes_per_s"]) == {"median", "min", "max"}
        rates = result["bytes_per_s"]
        assert 0 < rates["min"] <= rates["median"] <= rates["max"]
        assert result["requests_per_s"] > 0
        assert set(result["latency_s"]) == {"p50", "p99"}
        assert 0 < result["latency_s"]["p50"] <= result["latency_s"]["p99"]


@pytest.mark.parametrize("through", ["raw", "scheduler"])
@pytest.mark.parametrize("tier", ["nvme", "host", "device"])
def test_every_mode_reports_well_formed_json(
    tier: str, through: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = ["--path", str(tmp_path)] if tier == "nvme" else []
    report = bench_json(capsys, "--tier", tier, "--through", through, *path, *TINY, "--verify")
    check_shape(report)
    assert [(r["tier"], r["op"]) for r in report["results"]] == [(tier, "write"), (tier, "read")]
    assert report["results"][0]["size"] == 2 << 20 and report["results"][0]["repeats"] == 2
    assert report["machine"]["through"] == through and report["machine"]["verify"] is True
    if tier == "nvme":
        assert report["machine"]["backend"] == report["results"][0]["backend"] == auto_backend(tmp_path)
        assert report["machine"]["direct"] in (True, False)
        assert report["machine"]["filesystems"][0]["path"] == str(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_sweep_over_given_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = bench_json(
        capsys, "--path", str(tmp_path), "--size", "1MiB", "--sweep", "--block-size", "64KiB,256KiB",
        "--queue-depth", "1,4", "--op", "read", "--repeats", "1",
    )  # fmt: skip
    check_shape(report)
    cases = [(r["op"], r["block_size"], r["queue_depth"]) for r in report["results"]]
    assert cases == [("read", 64 << 10, 1), ("read", 64 << 10, 4), ("read", 256 << 10, 1), ("read", 256 << 10, 4)]
    assert list(tmp_path.iterdir()) == []


def test_default_sweep_grid_stops_at_the_size() -> None:
    from tiermem.cli import build_parser
    from tiermem.cli.bench_cmd import build_spec

    argv = ["bench", "io", "--sweep", "--size", "1GiB"]
    spec = build_spec(build_parser(argv).parse_args(argv))
    assert spec.block_sizes == tuple(parse_size(f"{k}KiB") for k in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
    assert spec.queue_depths == (1, 2, 4, 8, 16, 32, 64)
    argv = ["bench", "io", "--sweep", "--size", "256KiB"]
    assert build_spec(build_parser(argv).parse_args(argv)).block_sizes == (64 << 10, 128 << 10, 256 << 10)


def test_table_for_people_has_the_machine_facts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = bench(capsys, "--path", str(tmp_path), *TINY, "--op", "write")
    assert status == 0, err
    backend = f"backend: {auto_backend(tmp_path)}"
    for fact in ("machine:", "CPUs", f"path {tmp_path}:", backend, "O_DIRECT:", "page cache:", "MiB/s"):
        assert fact in out
    assert "write" in out and "read " not in out
    assert list(tmp_path.iterdir()) == []


def _with_backend(monkeypatch: pytest.MonkeyPatch, backend: FaultyBackend) -> None:
    """Make the NVMe tier use ``backend`` whatever --backend says."""
    monkeypatch.setattr("tiermem.tiers.nvme.select_backend", lambda name, probe_dir: (backend, "injected by test"))


@pytest.mark.parametrize("inner", ["posix", "aio"])
@pytest.mark.parametrize("through", ["raw", "scheduler"])
def test_verify_catches_a_corrupted_read(
    through: str, inner: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checksums are off in the benchmark's tier: only --verify can notice the flipped bit.
    # With aio the flip comes through its kernel queue's completions.
    if inner == "aio" and not aio.probe(tmp_path)[0]:
        pytest.skip(f"aio unusable here: {aio.probe(tmp_path)[1]}")
    _with_backend(monkeypatch, FaultyBackend(AioBackend() if inner == "aio" else PosixBackend(), flip_all_reads=True))
    status, _out, err = bench(capsys, "--path", str(tmp_path), "--through", through, *TINY, "--verify")
    assert status == 1
    assert "verification failed" in err and "differ" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_verify_catches_corruption_when_only_writes_are_timed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _with_backend(monkeypatch, FaultyBackend(PosixBackend(), flip_all_reads=True))
    status, _out, err = bench(capsys, "--path", str(tmp_path), *TINY, "--op", "write", "--verify")
    assert status == 1 and "read back" in err


def test_buffered_fallback_is_said_and_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _with_backend(monkeypatch, FaultyBackend(PosixBackend(), refuse_direct=True))
    report = bench_json(capsys, "--path", str(tmp_path), *TINY, "--verify")
    check_shape(report)
    assert report["machine"]["direct"] is False
    assert "NOT bypassed" in report["machine"]["page_cache"]
    assert list(tmp_path.iterdir()) == []


# -- runs (raw calls of several blocks, as the scheduler issues them) ------------------------------
@pytest.mark.parametrize(("run_blocks", "longest"), [("auto", 2), ("1", 1), ("3", 3)])
def test_raw_runs_move_every_byte_and_count_blocks(
    run_blocks: str, longest: int, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At QD 8, auto runs are 2 blocks (a quarter of the queue depth); 3 does not divide 8, so
    some calls are shorter (only free slots are filled). Every byte is verified, and the
    requests counted are blocks whatever the calls."""
    from tiermem.tiers.nvme import NvmeTier

    calls: list[int] = []
    original = NvmeTier.write

    def logged(self: NvmeTier, allocation: Any, offset: int, src: Any) -> Any:
        calls.append(src.numel())
        return original(self, allocation, offset, src)

    monkeypatch.setattr(NvmeTier, "write", logged)
    report = bench_json(
        capsys, "--path", str(tmp_path), "--size", "2MiB", "--block-size", "64KiB", "--queue-depth", "8",
        "--repeats", "2", "--run-blocks", run_blocks, "--verify",
    )  # fmt: skip
    check_shape(report)
    assert report["machine"]["run_blocks"] == (run_blocks if run_blocks == "auto" else int(run_blocks))
    block = 64 << 10
    assert max(calls) == longest * block and all(c % block == 0 for c in calls)
    assert sum(calls) == 3 * (2 << 20)  # the untimed prepare pass and two timed writes
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("run_blocks", "calls_per_pass"), [(None, 16), (1, 32)])
def test_latency_is_per_call_and_requests_are_blocks(
    run_blocks: int | None, calls_per_pass: int, tmp_path: Path
) -> None:
    """What the docs say is measured (tiermem.app.benchio, bench/README.md): one latency per call
    to the tier, requests counted in blocks. At QD 8 an auto run is 2 blocks, so a pass of 32
    blocks is 16 calls; with run_blocks=1 a call is one request."""
    from tiermem.app.benchio import BenchSpec, run_benchmark

    spec = BenchSpec(
        paths=(str(tmp_path),),
        size=2 << 20,
        block_sizes=(64 << 10,),
        queue_depths=(8,),
        repeats=2,
        run_blocks=run_blocks,
    )
    report = run_benchmark(spec)
    for result in report.results:
        assert result.requests == [32, 32]
        assert len(result.latencies) == 2 * calls_per_pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("inner", ["posix", "aio"])
def test_an_io_error_inside_a_raw_run_fails_the_bench_cleanly(
    inner: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if inner == "aio" and not aio.probe(tmp_path)[0]:
        pytest.skip(f"aio unusable here: {aio.probe(tmp_path)[1]}")
    backend = FaultyBackend(AioBackend() if inner == "aio" else PosixBackend(), eio_on_write=6)
    _with_backend(monkeypatch, backend)
    status, _out, err = bench(
        capsys, "--path", str(tmp_path), "--size", "2MiB", "--block-size", "64KiB", "--queue-depth", "8",
    )  # fmt: skip
    assert status == 1, err
    assert "write" in err and "Input/output error" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


# -- Ctrl-C ---------------------------------------------------------------------------------------
def _start_long_run(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    # QD 1 and small blocks over many repeats: minutes of work, interrupted after a moment.
    return subprocess.Popen(
        [sys.executable, "-m", "tiermem", "bench", "io", "--size", "16MiB", "--block-size", "64KiB",
         "--queue-depth", "1", "--repeats", "10000", *argv],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_default_sigint,
    )  # fmt: skip


def _default_sigint() -> None:
    # A shell runs background jobs with SIGINT ignored, and children inherit that: the
    # child would never see the Ctrl-C this test sends (tiermem leaves an ignored signal
    # ignored). Give it the default dispositions.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _data_file_written(root: Path) -> bool:
    # The child renames and creates directories meanwhile: a path may vanish under us.
    try:
        return any(p.name == "data" and p.stat().st_size > 0 for p in root.rglob("*") if p.is_file())
    except OSError:
        return False


@pytest.mark.usefixtures("interrupt_signals")
@pytest.mark.parametrize("through", ["raw", "scheduler"])
def test_a_signal_stops_the_run_between_two_calls_to_the_tier(
    through: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRAPS 25: a Ctrl-C that lands inside the tier's submission (a lock just taken, a
    request counted in flight and not yet given to the kernel) makes closing the tier wait
    forever. So the run holds the signal and raises where no call is half-made: the
    KeyboardInterrupt comes from DeferredInterrupts.check, no call to the tier follows the
    one the signal came in (raw; the scheduler finishes its move first), and the files go."""
    from tiermem.app.benchio import BenchSpec, run_benchmark
    from tiermem.tiers.nvme import NvmeTier

    calls: list[int] = []
    original = NvmeTier.write

    def signalled(self: NvmeTier, allocation: Any, offset: int, src: Any) -> Any:
        calls.append(src.numel())
        if len(calls) == 40:  # in the first timed pass (the untimed prepare pass is 32 calls)
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, allocation, offset, src)

    monkeypatch.setattr(NvmeTier, "write", signalled)
    spec = BenchSpec(
        paths=(str(tmp_path),), size=2 << 20, block_sizes=(64 << 10,), queue_depths=(1,), repeats=50,
        ops=("write",), through=through,
    )  # fmt: skip
    with pytest.raises(KeyboardInterrupt) as caught:
        run_benchmark(spec)
    innermost = caught.traceback[-1]
    assert (Path(innermost.path).name, innermost.name) == ("interrupts.py", "check"), caught.getrepr()
    if through == "raw":
        assert len(calls) == 40
    else:  # the scheduler's move of the pass lands (64 calls: two passes), none after it
        assert len(calls) == 64
    assert list(tmp_path.iterdir()) == []


def test_interrupts_leave_no_files(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) during a raw run with --path, and SIGTERM during a scheduler run in the
    private default directory: exit status 130 and an empty directory. The runs go in
    parallel, so the suite pays for about one interpreter start-up, not two."""
    runs: dict[str, tuple[Path, signal.Signals, subprocess.Popen[str]]] = {}
    for name, sig, through in [
        ("sigint-path", signal.SIGINT, "raw"),
        ("sigterm-default", signal.SIGTERM, "scheduler"),
    ]:
        root = tmp_path / name
        root.mkdir()
        env = dict(os.environ)
        if name == "sigterm-default":
            argv = []
            env["TMPDIR"] = str(root)  # the private default directory is made under it
        else:
            argv = ["--path", str(root)]
        runs[name] = (root, sig, _start_long_run([*argv, "--through", through], env))
    try:
        pending = dict(runs)
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            for name, (root, sig, child) in list(pending.items()):
                if child.poll() is not None:
                    pytest.fail(f"{name}: bench exited early ({child.returncode}): {child.communicate()[1]}")
                if _data_file_written(root):
                    time.sleep(0.2)  # into the timed passes
                    child.send_signal(sig)
                    del pending[name]
            time.sleep(0.05)
        assert not pending, f"never created a data file: {sorted(pending)}"
        for name, (root, _sig, child) in runs.items():
            _out, err = child.communicate(timeout=60)
            assert child.returncode == 130, f"{name}: {err}"
            assert "Traceback" not in err, f"{name}: {err}"
            assert list(root.iterdir()) == [], name
    finally:
        # Killed and reaped, pipes closed: an open pipe left to the garbage collector warns
        # in whichever later test happens to collect it.
        for _root, _sig, child in runs.values():
            if child.poll() is None:
                child.kill()
            child.communicate()


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--size", "abc"], "--size 'abc'"),
        (["--size", "0"], "--size '0'"),
        (["--block-size", "5000"], "not a multiple of 4096"),
        (["--block-size", "1MiB,3KiB"], "not a multiple of 4096"),
        (["--size", "4MiB", "--block-size", "8MiB"], "larger than --size"),
        (["--path", "/nonexistent/tiermem-bench"], "no such directory"),
        (["--queue-depth", "0"], "between 1 and 1024"),
        (["--queue-depth", "x"], "not a whole number"),
        (["--repeats", "two"], "not a whole number"),
        (["--op", "copy"], "expected one of read, write, both"),
        (["--tier", "gpu"], "expected one of nvme, host, device"),
        (["--through", "loop"], "expected one of raw, scheduler"),
        (["--backend", "spdk"], "expected one of auto, kvikio, aio, posix"),
        (["--tier", "host", "--backend", "posix"], "for --tier nvme"),
        (["--size", "1PiB"], "--size"),
        (["--run-blocks", "0"], "between 1 and"),
        (["--run-blocks", "2", "--through", "scheduler"], "only for --through raw"),
        (["--tier", "host", "--run-blocks", "2"], "only the nvme tier"),
        (["--buffer", "gpu"], "expected one of host, device"),
        (["--buffer", "device", "--tier", "host"], "only for --tier nvme"),
        (["--buffer", "device", "--through", "scheduler"], "only for --through raw"),
    ],
)
def test_bad_input_is_one_clear_line(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = bench(capsys, *argv)
    assert status == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("tiermem bench io: error: ") and words in err


def test_path_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "f"
    file.write_text("")
    status, _out, err = bench(capsys, "--path", str(file))
    assert status == 2 and "not a directory" in err


def test_more_than_the_disk_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _out, err = bench(capsys, "--path", str(tmp_path), "--size", "1000TiB", "--block-size", "1MiB")
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert "RAM" in err or "free" in err


@pytest.mark.skipif(importlib.util.find_spec("kvikio") is not None, reason="kvikio is installed here")
def test_kvikio_unavailable_is_an_error_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _out, err = bench(capsys, "--path", str(tmp_path), "--backend", "kvikio", *TINY)
    assert status == 1 and "kvikio" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_aio_backend_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--backend aio`` names the Linux AIO backend (where the kernel offers it)."""
    if auto_backend(tmp_path) != "aio":
        pytest.skip("Linux AIO is not usable here")
    report = bench_json(capsys, "--path", str(tmp_path), "--backend", "aio", "--op", "both", "--verify", *TINY)
    assert {r["backend"] for r in report["results"]} == {"aio"}
    assert all(r["bytes_per_s"]["median"] > 0 for r in report["results"])
    assert list(tmp_path.iterdir()) == []


# -- device buffers (--buffer device) --------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here: nothing to refuse")
def test_device_buffers_without_cuda_are_refused_naming_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = bench(capsys, "--path", str(tmp_path), "--buffer", "device", *TINY)
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("tiermem bench io: error: --buffer device: needs a CUDA device")
    assert ("CPU-only build" in err) if torch.version.cuda is None else ("is_available() is false" in err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here: nothing to refuse")
def test_the_engine_refuses_device_buffers_without_cuda_too(tmp_path: Path) -> None:
    from tiermem.app.benchio.passes import CaseEnv

    with pytest.raises(ValueError, match="device buffers need a CUDA device"):
        CaseEnv(
            "nvme", size=1 << 20, block_size=1 << 20, queue_depth=1, through="raw",
            paths=[str(tmp_path)], backend="posix", buffer="device",
        )  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_buffer_option_reaches_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """The argument plumbing, CUDA or not: --buffer device becomes the spec's buffer where CUDA is
    (is_available patched: nothing is run), the default stays host."""
    import argparse

    from tiermem.cli import bench_cmd

    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    assert bench_cmd.build_spec(parser.parse_args(["io"])).buffer == "host"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    spec = bench_cmd.build_spec(parser.parse_args(["io", "--buffer", "device", "--backend", "kvikio"]))
    assert (spec.buffer, spec.backend, spec.tier, spec.through) == ("device", "kvikio", "nvme", "raw")


def test_host_buffers_are_said_in_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = bench_json(capsys, "--path", str(tmp_path), "--backend", "posix", *TINY)
    assert report["machine"]["buffer"] == "host"
    assert report["machine"]["buffer_path"].startswith("page-aligned host memory")
    status, out, _err = bench(capsys, "--path", str(tmp_path), "--backend", "posix", *TINY)
    assert status == 0 and "buffer: host (page-aligned host memory" in out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_buffers_round_trip_through_each_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 21 item 1: device memory to NVMe and back, verified: posix stages it through page-locked
    bounces, kvikio (where usable) takes it as it is."""
    report = bench_json(capsys, "--path", str(tmp_path), "--backend", "posix", "--buffer", "device", "--verify", *TINY)
    assert report["machine"]["buffer"] == "device" and "page-locked" in report["machine"]["buffer_path"]
    if kvikio_backend.probe(tmp_path)[0]:
        report = bench_json(
            capsys, "--path", str(tmp_path), "--backend", "kvikio", "--buffer", "device", "--verify", *TINY
        )
        assert {r["backend"] for r in report["results"]} == {"kvikio"}
        assert "handed to kvikio as it is" in report["machine"]["buffer_path"]
    assert list(tmp_path.iterdir()) == []
