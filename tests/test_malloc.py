"""NOTE [ Returning freed memory ]: once a runtime started, host buffers freed by tiermem or by
torch leave the process's RSS (glibc only), unless the user set glibc's own thresholds."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import tiermem
    from tiermem.malloc import return_freed_memory, trim

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def in_heap(tensor):  # served from the brk heap, which glibc reuses, not mapped on its own
        with open("/proc/self/maps") as f:
            spans = [line.split()[0] for line in f if line.rstrip().endswith("[heap]")]
        return any(int(lo, 16) <= tensor.data_ptr() < int(hi, 16) for lo, hi in (s.split("-") for s in spans))

    with tiermem.Runtime({"device": {"device": "cpu"}, "nvme": {"paths": [sys.argv[1]]}}):
        configured = return_freed_memory()
    # Measured once the runtime is closed (mallopt's settings stay for the process).
    before = rss()
    block = torch.ones(48 << 18)  # 48 MiB of float32: above every threshold, mapped on its own
    holding = rss()
    big_in_heap = in_heap(block)
    del block
    big_left = holding - rss()
    small_in_heap = []
    for size in (24, 16):  # a freed mapped block raises glibc's threshold: 16 MiB then comes from the heap
        block = torch.ones(size << 18)
        small_in_heap.append(in_heap(block))
        del block
    kept = rss() - before
    untrimmed = rss()
    trim()  # what rules 4 and 5 do during training
    trimmed = untrimmed - rss()
    print(json.dumps({
        "configured": configured, "big_in_heap": big_in_heap, "big_left": big_left,
        "small_in_heap": small_in_heap, "kept": kept, "after_trim": rss() - before, "trimmed": trimmed,
    }))
    """
)


def run(tmp_path, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120, env=environ
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_large_blocks_leave_the_process_and_smaller_ones_are_reused(tmp_path):
    """Rule 2: a block of 32 MiB or more is mapped on its own and leaves at once; a smaller one is
    served from the heap, where glibc can reuse it (whether it does depends on the heap's layout:
    with few small blocks free, each aligned 16 MiB request misses the last one freed and takes
    fresh pages, which is why reuse itself is not asserted), and stays until a trim hands it back."""
    measured = run(tmp_path)
    assert measured["configured"]
    assert not measured["big_in_heap"], measured
    assert measured["big_left"] > 44 << 20, measured  # the 48 MiB block
    assert measured["small_in_heap"] == [True, True], measured
    assert measured["kept"] > 12 << 20, measured  # the 16 MiB heap block, until the trim
    assert measured["trimmed"] > 12 << 20, measured  # the 16 MiB heap block


def test_without_it_glibc_keeps_them(tmp_path):
    """What the test above guards against (TIERMEM_KEEP_MALLOC=1: glibc's own dynamic threshold,
    and no trims)."""
    measured = run(tmp_path, TIERMEM_KEEP_MALLOC="1")
    assert not measured["configured"]
    assert measured["after_trim"] > 12 << 20, measured


def test_the_users_own_glibc_settings_win(tmp_path):
    measured = run(tmp_path, MALLOC_MMAP_THRESHOLD_=str(1 << 28), MALLOC_TRIM_THRESHOLD_=str(1 << 30))
    assert not measured["configured"]
    assert measured["kept"] > 12 << 20, measured  # glibc's behaviour, as the user asked for


STREAMING = textwrap.dedent(
    """
    import json, sys
    import torch
    import tiermem
    from torch import nn

    def anonymous():
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Anonymous:"))

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB, a 4 MiB chunk each
    x = torch.randn(4, 1024)
    with tiermem.Runtime({"device": {"device": "cpu"}, "nvme": {"paths": [sys.argv[1]]}}) as rt:
        plan = {"persistent_chunks": 0, "chunk_size": "4MiB", "state_home": "host"}
        model, optimizer = rt.manage(model, torch.optim.SGD, lr=0.1, plan=plan, activations=None)
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        # Holes in the middle of the heap: 2 MiB blocks (below the 4 MiB mmap threshold), each
        # followed by a smaller one that stays, so that freeing them trims nothing off the top.
        holes, kept = [], []
        for _ in range(32):
            holes.append(torch.ones(1 << 19))
            kept.append(torch.ones(75_000))
        before = anonymous()
        del holes
        freed = anonymous()
        trims = rt._model_states[0].store.pool.trimming.trims
        with torch.no_grad():
            for _ in range(3):  # 96 MiB of chunks streamed in through the pool
                model(x)
        after = anonymous()
        trims = rt._model_states[0].store.pool.trimming.trims - trims
    print(json.dumps({"held_after_free": freed - before, "streamed": after - freed, "trims": trims}))
    """
)


def test_streaming_chunks_returns_the_heaps_freed_blocks(tmp_path):
    """Rule 5: blocks freed in the middle of the heap (a step's activations) leave the process's
    RSS at the next forward once the pool has streamed 64 MiB of chunks (once, not at every chunk), with glibc's
    thresholds as the benchmarks set them (the mmap threshold at 4 MiB: 2 MiB blocks come from
    the heap)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "TIERMEM_KEEP"))}
    environ |= {"MALLOC_MMAP_THRESHOLD_": str(4 << 20), "MALLOC_TRIM_THRESHOLD_": "0"}
    out = subprocess.run(
        [sys.executable, "-c", STREAMING, str(tmp_path)], capture_output=True, text=True, timeout=120, env=environ
    )
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["held_after_free"] > -8 << 20, measured  # freeing alone gave the 64 MiB of holes back
    assert measured["streamed"] < -48 << 20, measured
    assert 1 <= measured["trims"] <= 2, measured


def test_streamed_chunks_trim_the_heap_between_phases_not_within_them(tmp_path, monkeypatch):
    """Rule 5: a step whose chunks stream trims at most at the start of its forward, its backward
    and its optimizer step, however many chunks each phase fetches (a trim in the middle of a
    phase hands back pages the same phase then faults in and zeroes again)."""
    import torch
    from torch import nn

    import tiermem
    from tiermem import malloc

    trims: list[str] = []
    phase = ["none"]
    monkeypatch.setattr(malloc, "trim", lambda: trims.append(phase[0]) or True)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])  # a 1 MiB chunk each
    x = torch.randn(4, 512)
    with tiermem.Runtime({"device": {"device": "cpu"}, "nvme": {"paths": [str(tmp_path)]}}) as rt:
        plan = {"persistent_chunks": 0, "chunk_size": "1MiB", "state_home": "host"}
        model, optimizer = rt.manage(model, torch.optim.SGD, lr=0.1, plan=plan, activations=None)
        pool = rt._model_states[0].store.pool
        pool.trimming.every = 1  # any fetched byte fills the interval
        fetched = []
        for _ in range(3):
            trims.clear()
            before = rt.stats().as_dict()["links"]
            phase[0] = "forward"
            loss = model(x).square().sum()
            phase[0] = "backward"
            loss.backward()
            phase[0] = "step"
            optimizer.step()
            optimizer.zero_grad()
            after = rt.stats().as_dict()["links"]
            fetched.append(sum(v["bytes"] - before.get(k, {"bytes": 0})["bytes"] for k, v in after.items()))
            assert 1 <= len(trims) <= 3, trims
            assert len(set(trims)) == len(trims), trims  # once a phase at most
    assert min(fetched) >= 8 << 20, fetched  # the chunks did stream: 8 fetches a forward at least
