"""The examples (issue 22 item 5; README "Your training loop"): two loops a user already has, a
nanoGPT ``train.py`` (fp16 autocast, ``GradScaler("cpu")``, accumulation, clipping after
``unscale_``, dropout, tied weights) and a torchtune full fine-tune (bf16 autocast, token-summed
loss, hand-scaled gradients, clipping, ``LambdaLR``), each with a tiermem version 3 lines away.
Each runs in a process of its own as a user would run it (forked from the suite's server, which
spares the interpreter start: tests/forked_children.py); the tiermem version prints bitwise the
plain version's losses and final-weight digest, with its model states streamed through a device budget
smaller than they are and activations offloaded (the runtime's statistics say so)."""

from __future__ import annotations

import difflib
import json
import os
import pathlib
import runpy
import sys

import pytest

from tests.forked_children import ForkServer

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NAMES = ["nanogpt_train", "torchtune_finetune"]


def run_example(path: str, environment: str, stdout: str, stderr: str) -> None:
    """The child: runs an example as ``python examples/<name>.py`` would, with ``environment``
    (JSON) added to its variables and its output in the files ``stdout`` and ``stderr``,
    printing the statistics of every Runtime as it leaves ``with`` (the examples themselves
    print only losses and a digest)."""
    import tiermem

    os.environ.update(json.loads(environment))
    for fd, file in ((1, stdout), (2, stderr)):
        os.dup2(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    leave = tiermem.Runtime.__exit__

    def report_then_leave(self: tiermem.Runtime, *exc_info: object) -> object:
        print("TIERMEM-STATS " + json.dumps(self.stats().as_dict()), file=sys.stderr)
        return leave(self, *exc_info)  # type: ignore[arg-type]

    tiermem.Runtime.__exit__ = report_then_leave  # type: ignore[method-assign]
    sys.argv = [path]
    sys.path.insert(0, str(pathlib.Path(path).parent))
    runpy.run_path(path, run_name="__main__")


#: the children by name, for tests/forked_children.py
CHILDREN = {"example": run_example}

#: Tier settings per example (environment variables: the examples construct tiermem.Runtime()):
#: a 3 MiB device for ~3.4 (nanoGPT) and ~5 MiB (torchtune) of model states, which stream through
#: it (the budget is enforced: running at all proves they do), and saved tensors of 64 KiB and more
#: captured, so the plan's activation policy offloads some. nanoGPT's kept activations must give
#: the gradient buffer room when it comes back to accumulate (NOTE [ Activation fallbacks ] rule 8;
#: it raised StatesMemoryError before).
TIERS = {
    "nanogpt_train": {"TIERMEM_DEVICE_CAPACITY": "3MiB", "TIERMEM_ACTIVATIONS_MIN_BYTES": "64KiB"},
    "torchtune_finetune": {"TIERMEM_DEVICE_CAPACITY": "3MiB", "TIERMEM_ACTIVATIONS_MIN_BYTES": "64KiB"},
}


def run(fork_server: ForkServer, output: pathlib.Path, name: str, env: dict[str, str]) -> tuple[str, str]:
    """The example's stdout and stderr; the server's process runs one torch thread, as
    OMP_NUM_THREADS=1 would."""
    stdout, stderr = output / f"{name}.out", output / f"{name}.err"
    pid = fork_server.start(
        __name__, "example", str(EXAMPLES / f"{name}.py"), json.dumps(env), str(stdout), str(stderr)
    )
    lines, status = fork_server.wait(pid)
    assert fork_server.returncode(status) == 0, (lines, stderr.read_text()[-4000:])
    return stdout.read_text(), stderr.read_text()


def changed_lines(name: str) -> tuple[list[str], list[str]]:
    plain = (EXAMPLES / f"{name}.py").read_text().splitlines()
    tiered = (EXAMPLES / f"{name}_tiermem.py").read_text().splitlines()
    diff = list(difflib.unified_diff(plain, tiered, lineterm="", n=0))[2:]
    return [d[1:] for d in diff if d.startswith("-")], [d[1:] for d in diff if d.startswith("+")]


@pytest.mark.parametrize("name", NAMES)
def test_the_tiermem_version_is_three_lines_from_the_plain_one(name):
    removed, added = changed_lines(name)
    assert len(added) <= 3 and len(removed) <= 1, (removed, added)
    assert any("rt.manage(model, optimizer)" in line for line in added)
    readme = (ROOT / "README.md").read_text()
    for line in removed:  # the README shows this diff
        assert f"-{line}\n" in readme
    for line in added:
        assert f"+{line}\n" in readme


@pytest.mark.slow  # two processes of 3-5 s each
@pytest.mark.parametrize("name", NAMES)
def test_the_example_trains_bitwise_like_the_plain_one(tmp_path, tmp_path_factory, fork_server, name):
    env = {
        **TIERS[name],
        "TIERMEM_HOST_CAPACITY": "16MiB",
        "TIERMEM_NVME_PATHS": str(tmp_path),
        "TIERMEM_SCHEDULER_LOOP": "asyncio",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # the planner's profile cache
    }
    (tmp_path / "cache").mkdir()
    output = tmp_path_factory.mktemp("output")
    out, err = run(fork_server, output, f"{name}_tiermem", env)
    want, _ = run(fork_server, output, name, {})
    assert want.count("loss") >= 6 and "weights " in want
    assert out == want  # every loss printed exactly, and the final weights' digest
    reports = [line for line in err.splitlines() if line.startswith("TIERMEM-STATS ")]
    assert len(reports) == 1
    stats = json.loads(reports[0].removeprefix("TIERMEM-STATS "))
    device = stats["tiers"]["device"]
    assert device["peak_bytes"] <= device["capacity"]
    assert stats["model_states"]["persistent_chunks"] < stats["model_states"]["chunks"]
    assert stats["links"]["host->device"]["bytes"] > 0  # chunks streamed in from their homes
    # the plan's activation policy ran on the model's forwards (its saved activations captured); the
    # first step runs on the plan too (NOTE [ Model-state rules ] rule 9), so nothing need be offloaded
    assert stats["activations"]["captured_bytes"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # the runtime's files are gone
