"""Ranks (NOTE [ Ranks ] in tiermem.distributed): rank detection, per-rank NVMe directories,
the process group tiermem sets up from torchrun's environment, and a rank that dies or hangs
ending the others with PeerFailureError within the timeout, its files reclaimed by the next run."""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import tiermem
from tests.forked_children import rank_context
from tiermem import distributed
from tiermem.config_fields import DistributedConfig
from tiermem.distributed import PeerFailureError, RankContext
from tiermem.errors import ConfigError
from tiermem.tiers.rundir import RunDirectory

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test runner started under torchrun must not make these tests multi-process."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


def torchrun_env(rank: int, world: int, **extra: str) -> dict[str, str]:
    launched = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    return {name: str(value) for name, value in launched.items()} | extra


# -- who this process is -------------------------------------------------------------------------


def test_one_process_without_launcher_or_group() -> None:
    assert distributed.detect({}) == RankContext()
    assert RankContext().subdirectory is None and RankContext().rank_paths(("/a",)) == ("/a",)
    one = distributed.detect({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert one.source == "environment"  # torchrun with one process: a group is made (FSDP2 needs it) ...
    assert not one.multi_process and one.subdirectory is None  # ... and the files are where they were


def test_torchrun_environment_before_a_group_exists() -> None:
    ranks = distributed.detect(torchrun_env(3, 4) | {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert ranks == RankContext(rank=3, world_size=4, local_rank=1, local_world_size=2, source="environment")
    assert ranks.subdirectory == "rank3"  # the global rank: unique across machines
    assert ranks.rank_paths(("/a", "/b")) == ("/a/rank3", "/b/rank3")
    # Without torchrun's LOCAL_* every rank counts as on this machine (never overcommits it).
    assert distributed.detect({"RANK": "1", "WORLD_SIZE": "2"}).local_world_size == 2


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "1"}, "RANK='1' and WORLD_SIZE=None: set both"),
        ({"WORLD_SIZE": "2"}, "RANK=None and WORLD_SIZE='2': set both"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a non-negative integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0"),
    ],
)
def test_a_broken_launcher_environment_is_a_clear_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match="the environment") as info:
        distributed.detect(env)
    assert message in str(info.value)


# -- per-rank directories --------------------------------------------------------------------------


def _config(path: Path) -> dict:
    return {"nvme": {"paths": [str(path)]}, "device": {"capacity": "64MiB"}, "host": {"capacity": "64MiB"}}


def test_one_process_uses_the_paths_themselves(tmp_path: Path) -> None:
    with tiermem.Runtime(_config(tmp_path)) as rt:
        assert rt.resolved is not None and rt.resolved.nvme.paths == (str(tmp_path),)
        (run,) = rt.tiers["nvme"].run_directories
        assert os.path.dirname(run) == str(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_rank_uses_its_own_directory_made_and_removed_by_tiermem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    other = tmp_path / "b"
    other.mkdir()
    config = _config(tmp_path) | {"nvme": {"paths": [str(tmp_path / "a"), str(other)]}}
    (tmp_path / "a").mkdir()
    with tiermem.Runtime(config) as rt:
        rank_dirs = (str(tmp_path / "a" / "rank1"), str(other / "rank1"))
        assert rt.resolved is not None and rt.resolved.nvme.paths == rank_dirs
        assert [os.path.dirname(run) for run in rt.tiers["nvme"].run_directories] == list(rank_dirs)
        handle = rt.store(torch.arange(1 << 20, dtype=torch.float32), "nvme")
        handle.wait()
        assert torch.equal(handle.tensor(), torch.arange(1 << 20, dtype=torch.float32))
        with rt.init(min_bytes=1024) as built:  # rt.init() builds under the rank directory too
            nn.Linear(256, 256)
            # reached through the run directory's held descriptor (NOTE [ Run directory rules ] rule 7)
            assert os.path.dirname(os.path.realpath(built.directory)) == rank_dirs[0] and built.tensors == 2
        handle.free()
    assert list((tmp_path / "a").iterdir()) == [] and list(other.iterdir()) == []


def test_a_rank_directory_the_user_made_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "rank0").mkdir()
    with tiermem.Runtime(_config(tmp_path)):
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["rank0"] and list((tmp_path / "rank0").iterdir()) == []


def test_default_path_per_rank_is_removed_by_the_last_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the default $TMPDIR/tiermem-nvme-<uid>, private
    config = {"device": {"capacity": "64MiB"}, "host": {"capacity": "64MiB"}}
    runtimes = []
    for rank in (0, 1):  # two ranks in one process stand for two processes on one machine
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        runtimes.append(tiermem.Runtime(config).start())
    base = tmp_path / f"tiermem-nvme-{os.geteuid()}"
    assert sorted(p.name for p in base.iterdir()) == ["rank0", "rank1"]
    for rt in runtimes:  # rank 0 made the default directory and leaves first: rank 1 removes it
        rt.close()
    assert list(tmp_path.iterdir()) == []


def _dead_rank_directory(parent: Path) -> str:
    """The run directory of a rank that died by SIGKILL under ``parent``/rank1."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (Python 3.12+)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            run = RunDirectory.create(parent / "rank1", create_parent=True)
            os.write(write_end, run.path.encode())
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(3)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        dead = pipe.read().decode()
    os.waitpid(pid, 0)
    assert os.path.isdir(dead)
    return dead


@pytest.mark.parametrize("next_run", ["one process", "rank 0 of 2"])
def test_the_next_run_reclaims_a_dead_ranks_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, next_run: str
) -> None:
    _dead_rank_directory(tmp_path)
    if next_run == "rank 0 of 2":
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
    with tiermem.Runtime(_config(tmp_path)):
        assert not (tmp_path / "rank1").exists(), "the dead rank's run directory and rank directory are gone"
    assert list(tmp_path.iterdir()) == []


# -- the [distributed] settings and the process group ------------------------------------------


def test_backend_auto_is_gloo_without_cuda_and_nccl_needs_cuda() -> None:
    assert distributed.resolve_backend("auto", cuda_available=False) == "gloo"
    assert distributed.resolve_backend("auto", cuda_available=True) == "cpu:gloo,cuda:nccl"
    assert distributed.resolve_backend("gloo", cuda_available=True) == "gloo"
    with pytest.raises(ConfigError, match=r'distributed\.backend: "nccl" needs CUDA'):
        distributed.resolve_backend("nccl", cuda_available=False)
    with pytest.raises(ConfigError, match=r'distributed\.backend: "cpu:gloo,cuda:nccl" needs CUDA'):
        distributed.resolve_backend("cpu:gloo,cuda:nccl", cuda_available=False)
    assert distributed.resolve_backend("cpu:gloo,cuda:nccl", cuda_available=True) == "cpu:gloo,cuda:nccl"


def test_no_process_group_is_made_outside_a_torchrun_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert distributed.setup_process_group(DistributedConfig()) is False
    for name, value in torchrun_env(0, 2).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT unset; launch with torchrun"):
        distributed.setup_process_group(DistributedConfig())
    distributed.close_process_group(False)  # not ours: nothing to do


def test_a_one_process_torchrun_launch_gets_a_group_and_keeps_its_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    for name, value in torchrun_env(0, 1, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(name, value)
    owned = distributed.setup_process_group(DistributedConfig(timeout_s=30))
    try:
        assert owned and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        assert distributed.detect().source == "process group"
        with tiermem.Runtime(_config(tmp_path)) as rt:
            assert rt.resolved is not None and rt.resolved.nvme.paths == (str(tmp_path),)
    finally:
        distributed.close_process_group(owned)
    assert not dist.is_initialized()


def test_one_process_errors_pass_through_unchanged() -> None:
    gloo_like = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed by peer")
    assert distributed.is_collective_failure(gloo_like)
    assert not distributed.is_collective_failure(RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError) as info, distributed.peer_failures():
        raise gloo_like
    assert info.value is gloo_like  # one process: no peer to blame


# -- a rank that dies or hangs (2 gloo processes) -----------------------------------------------------

TIMEOUT_S = 3.0
SLACK_S = 6.0
FAIL_AT_STEP = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_group_wins(rank: int) -> None:
    ranks = distributed.detect()
    assert ranks == RankContext(rank=rank, world_size=2, local_rank=rank, local_world_size=2, source="process group")
    # A stale or foreign RANK/WORLD_SIZE does not change who this process is once a group exists.
    assert distributed.detect({"RANK": "7", "WORLD_SIZE": "9"}).rank_paths(("/p",)) == (f"/p/rank{rank}",)
    assert distributed.setup_process_group(DistributedConfig()) is False  # never over an existing group


def _train_until_failure(rank: int, root: str, mode: str, report: dict) -> None:
    """A data-parallel loop (gradients all-reduced) with activations on NVMe under tiermem;
    rank 1 fails at FAIL_AT_STEP, after its NVMe files exist."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"nvme": {"paths": [root]}, "activations": {"min_bytes": 0}, "device": {"capacity": "64MiB"}}
    with distributed.peer_failures(), tiermem.Runtime(config) as rt:
        report["rank_dir"] = rt.resolved.nvme.paths[0]
        kept = []
        for step in range(100):
            if rank == 1 and step == FAIL_AT_STEP:
                assert os.listdir(report["rank_dir"]), "rank 1 has NVMe files when it fails"
                Path(root, "failed_at").write_text(str(time.time()))
                if mode == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(120)  # hung: alive, never reaching the next collective
            with rt.offload_activations(model, policy="nvme"):
                model(torch.randn(32, 64)).square().mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            optimizer.step()
            optimizer.zero_grad()
            # A copy of the weights on NVMe each step, waited for: this rank's files hold data.
            kept.append(rt.store(model[0][0].weight.detach().clone(), "nvme"))
            kept[-1].wait()
            report["steps"] = step + 1
            report["nvme_written"] = rt.stats().as_dict()["tiers"]["nvme"]["bytes_written"]


def _rank(rank: int, port: int, root: str, mode: str) -> None:
    """One rank as torchrun starts it: its environment, then tiermem's process group."""
    warnings.simplefilter("ignore", FutureWarning)
    torch.set_num_threads(1)
    os.environ.update(torchrun_env(rank, 2, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    report: dict = {"rank": rank}
    # Both ranks start the rendezvous together: it too is bounded by the short timeout, and one
    # rank's imports may take longer on a loaded machine.
    Path(root, f"ready{rank}").touch()
    deadline = time.monotonic() + 60
    while not Path(root, f"ready{1 - rank}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    owned = distributed.setup_process_group(DistributedConfig(timeout_s=TIMEOUT_S, backend="auto"))
    failed = True
    try:
        _check_group_wins(rank)
        _train_until_failure(rank, root, mode, report)
        failed = False
    except PeerFailureError as exc:
        report.update(error=str(exc), error_at=time.time(), cause=type(exc.__cause__).__name__)
        report["rank_dir_left"] = os.path.exists(report["rank_dir"])
    finally:
        distributed.close_process_group(owned, wait_for_peers=not failed)
    Path(root, f"report{rank}.json").write_text(json.dumps(report))


@pytest.mark.parametrize("mode", ["killed", "hung"])
def test_a_failed_rank_ends_the_other_with_a_clear_error_in_bounded_time(tmp_path: Path, mode: str) -> None:
    """Issue 18 item 5: rank 1 is SIGKILLed (or hangs) mid-training with NVMe files; rank 0 raises
    PeerFailureError within the process group's timeout (+ slack), its own files are gone, and
    the next Runtime on the same path reclaims rank 1's run directory."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    context = rank_context()  # new processes, forked from a server that imported torch once (suite time)
    port = _free_port()
    processes = [context.Process(target=_rank, args=(rank, port, str(tmp_path), mode)) for rank in (0, 1)]
    for process in processes:
        process.start()
    try:
        processes[0].join(60)
        assert processes[0].exitcode == 0, f"rank 0 ended with {processes[0].exitcode}"
    finally:
        processes[1].kill()
        processes[1].join(10)
    if mode == "killed":
        assert processes[1].exitcode == -signal.SIGKILL
    report = json.loads((tmp_path / "report0.json").read_text())
    assert report["steps"] >= FAIL_AT_STEP and report["nvme_written"] > 0, report
    error = report["error"]
    assert error.startswith("tiermem distributed: rank 0 of 2: a collective failed: "), error
    cause = "another rank died" if mode == "killed" else "another rank did not reach the same collective"
    assert f"Probable cause: {cause}" in error, error
    assert "Timeout in force: 3 s ([distributed] timeout_s)" in error and "What to do:" in error, error
    waited = report["error_at"] - float((tmp_path / "failed_at").read_text())
    assert 0 <= waited <= TIMEOUT_S + SLACK_S, waited
    if mode == "hung":
        assert waited >= TIMEOUT_S - 1, f"a hung peer is waited for up to the timeout ({waited:.1f} s)"
    assert report["rank_dir_left"] is False, "rank 0's own files and directory are removed as it fails"
    # SIGKILL (or the launcher's kill of a hung rank) skipped rank 1's cleanup: its run directory is left.
    assert [name.startswith("tiermem-run-") for name in os.listdir(tmp_path / "rank1")] == [True]
    with tiermem.Runtime(_config(tmp_path)):
        assert not (tmp_path / "rank1").exists(), "the next run reclaimed the failed rank's run directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["failed_at", "ready0", "ready1", "report0.json"]
