"""Fixtures shared by the scheduler tests (test_scheduler.py, test_scheduler_runs.py), the
suite's own profile cache, the signal dispositions of tests that signal themselves, and the
server that forks the children tests SIGKILL."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator

import pytest

from tests.forked_children import ForkServer
from tests.gated_tier import BLOCK, GatedTier
from tiermem.schedulers import AsyncioScheduler
from tiermem.tiers.device import DeviceTier


@pytest.fixture(autouse=True, scope="session")
def private_profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``rt.manage`` plans at the first step (NOTE [ Model-state rules ] rule 9) and caches
    profiles under ``$XDG_CACHE_HOME``: the suite keeps its own, never the user's."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def fork_server(private_profile_cache: None) -> Iterator[ForkServer]:
    """Children forked from one server that imported torch and tiermem once (tests/forked_children.py):
    each a process of its own, SIGKILLed as a spawned one would be, without a new interpreter
    (suite time). Started after the profile cache is set: its children inherit the environment."""
    server = ForkServer()
    yield server
    server.close()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Two cores shared with the runtime's copy and I/O threads: OpenMP threads spinning in tiny
    kernels only slow everything down (TRAPS 7); the thread count is restored after. A file
    asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def interrupt_signals() -> Iterator[None]:
    """SIGINT and SIGTERM as an interactive Python process has them (``default_int_handler``,
    ``SIG_DFL``) for a test that sends them to itself, restored after. A non-interactive shell
    starts a background job (``cmd &``, ``setsid nohup``, some CI runners) with SIGINT ignored,
    and tiermem, as Python, leaves an ignored signal ignored: without this the test's signal
    would do nothing. A child process inherits an ignored signal too: a test that signals a
    child resets it there (``preexec_fn``)."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for sig, handler in previous.items():
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)


@pytest.fixture
def device() -> Iterator[DeviceTier]:
    tier = DeviceTier(1 << 30, "cpu")
    yield tier
    tier.close()


@pytest.fixture(params=["asyncio", "uvloop"])
def make_scheduler(request: pytest.FixtureRequest) -> Iterator[Callable[..., AsyncioScheduler]]:
    made: list[AsyncioScheduler] = []

    def make(**kwargs: object) -> AsyncioScheduler:
        kwargs.setdefault("block_size", BLOCK)
        kwargs.setdefault("loop", request.param)
        scheduler = AsyncioScheduler(debug=True, **kwargs)  # type: ignore[arg-type]
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.close()


@pytest.fixture
def gated(make_scheduler: Callable[..., AsyncioScheduler]) -> Iterator[Callable[..., GatedTier]]:
    """Gated storage tiers (``tier_class=`` picks a subclass), released at teardown so no
    scheduler waits forever on them. Requests ``make_scheduler`` so that the tiers are
    released before the schedulers close."""
    made: list[GatedTier] = []

    def make(tier_class: type[GatedTier] = GatedTier, **kwargs: object) -> GatedTier:
        tier = tier_class(**kwargs)  # type: ignore[arg-type]
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.gated = False
        tier.release_all()
