"""Fresh child processes without a new interpreter each (suite time): for the tests' children (the
ones SIGKILLed inside a save or a step, the access child, the examples) and for their gloo ranks.

Children: one server process (the session's ``fork_server`` fixture in tests/conftest.py) imports
torch and tiermem once, then forks one child per request. A child is a new process like a
spawned one: it builds its own Runtime (the server never builds one, so no thread, file or lock
is inherited), and a SIGKILL or a crash ends it as it would end a spawned child. What the fork
spares is the import of torch and of what the first ``rt.manage`` imports (about 3 CPU seconds a
child on this VM). A child runs on one torch thread (the server's setting, as the spawned
children set it) in the server's environment, the suite's at its start: a test passes what it
changed (a thread count, a variable) for the child to set.

    python -m tests.forked_children

Each line on the server's stdin is a JSON list ``[module, name, *args]``: the server imports
``module`` (``tests.checkpoint_child``, ``tests.test_checkpoint_resume``, ...; kept for the next
request), forks, and the child prints ``started PID`` before it calls
``module.CHILDREN[name](*args)``; the server prints ``ended PID STATUS`` (``waitpid``'s status)
once the child is gone, after everything it printed (its stderr goes to the same pipe; its exit
status is ``sys.exit``'s, 1 after an exception, 0 otherwise). One child at a time: the server
waits for it before it reads the next request.

Ranks: :func:`start_ranks` is ``torch.multiprocessing.spawn`` with multiprocessing's forkserver,
which imports torch, tiermem and FSDP2 once (``RANK_PRELOAD``) and forks every rank from there.
A rank gets its target and arguments pickled, as a spawned one does, but its environment is the
forkserver's, taken when the suite first used it: a test sets what a rank needs (MASTER_PORT,
the torchrun variables) inside the rank, never in its own environment before starting it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import multiprocessing.context
import os
import pathlib
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]


class ForkServer:
    """The tests' side: start children, read what they print, kill them. One child at a time: a
    test ends its child (``kill`` or ``wait``) in a ``finally``; one a failed test left running is
    killed by the next ``start`` or by ``close``."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.forked_children"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.running: int | None = None

    def start(self, module: str, name: str, *args: str) -> int:
        """Fork a child running ``module.CHILDREN[name](*args)``; its pid."""
        if self.running is not None:  # left by a test that failed (or timed out) before ending it
            self.kill(self.running)
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps([module, name, *args]) + "\n")
        self.process.stdin.flush()
        line = self.readline()
        if not line.startswith("started "):  # the module did not import: the server printed why
            answer = [line]
            while answer[-1] and answer[-1] != "import failed":
                answer.append(self.readline())
            raise AssertionError("the fork server answered:\n" + "\n".join(answer))
        self.running = int(line.split()[1])
        return self.running

    def readline(self) -> str:
        """The next line a child (or the server) printed, stripped; "" when the server is gone."""
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def returncode(self, status: int) -> int:
        """A wait status as ``subprocess`` gives it: the exit status, or minus the signal."""
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

    def alive(self, pid: int) -> bool:
        """Whether the child ``pid`` still runs (the server reaps it as it ends)."""
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self, pid: int) -> tuple[list[str], int]:
        """SIGKILL the child (unless it ended by itself: its status says so); the lines it printed
        that were not read yet, and its wait status."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return self.wait(pid)

    def wait(self, pid: int) -> tuple[list[str], int]:
        """Read until the child ``pid`` has ended: the lines it printed, and its wait status."""
        lines = []
        while True:
            line = self.readline()
            assert line, f"the fork server ended before child {pid} did: {lines}"
            if line.startswith(f"ended {pid} "):
                self.running = None
                return lines, int(line.split()[2])
            lines.append(line)

    def close(self) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        if self.running is not None:
            self.kill(self.running)
        self.process.stdin.close()
        self.process.wait(timeout=30)
        self.process.stdout.close()


#: what a rank imports before its first step: torch, what an optimizer's constructor imports
#: (torch._dynamo), FSDP2 and DTensor, tiermem, and pytest (the test modules import it)
RANK_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp", "tiermem", "pytest"]


def rank_context() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver context, its server importing ``RANK_PRELOAD`` once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts: the suite's first use
    return context


def start_ranks(target: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``torch.multiprocessing.spawn(target, args, nprocs)``, each rank forked from the forkserver;
    returns when every rank has ended, raising the first rank's error as spawn does."""
    import torch.multiprocessing

    rank_context()
    torch.multiprocessing.start_processes(target, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _warm() -> None:
    """What every child's first ``rt.manage`` imports lazily (torch._dynamo from an optimizer's
    constructor, torch.distributed.tensor from the sharded-model check), imported once here."""
    import torch
    import torch.distributed.tensor

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def _serve() -> None:
    import torch

    torch.set_num_threads(1)  # as the spawned children did: the same kernels' reduction order
    _warm()
    for request in sys.stdin:
        module, name, *args = json.loads(request)
        try:
            children = importlib.import_module(module).CHILDREN
        except Exception:  # noqa: BLE001 - the test gets the traceback; the server serves on
            traceback.print_exc(file=sys.stdout)
            print("import failed", flush=True)
            continue
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                sys.stdin.close()
                os.dup2(sys.stdout.fileno(), sys.stderr.fileno())  # its errors reach the test, in order
                print(f"started {os.getpid()}", flush=True)
                children[name](*args)
            except SystemExit as exc:  # sys.exit(n): the status a spawned child would end with
                status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 - printed, and the child ends: never back into the loop
                traceback.print_exc()
                status = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        print(f"ended {pid} {status}", flush=True)
    os._exit(0)  # stdin closed: the suite is done; an interpreter's teardown with torch loaded takes seconds


if __name__ == "__main__":
    _serve()
