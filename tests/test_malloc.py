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
    from tiermem.malloc import return_freed_memory

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    with tiermem.Runtime({"device": {"device": "cpu"}, "nvme": {"paths": [sys.argv[1]]}}) as rt:
        configured = return_freed_memory()
        before = rss()
        for size in (24, 16):  # a freed mapped block raises the threshold: 16 MiB then comes from the heap
            block = torch.ones(size << 18)  # size MiB of float32
            del block
        print(json.dumps({"configured": configured, "kept": rss() - before}))
    """
)


def run(tmp_path, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120, env=environ
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_large_blocks_leave_the_process(tmp_path):
    measured = run(tmp_path)
    assert measured["configured"]
    assert measured["kept"] < 4 << 20, measured  # without it glibc keeps the 16 MiB block


def test_without_it_glibc_keeps_them(tmp_path):
    """What the test above guards against (TIERMEM_KEEP_MALLOC=1: glibc's own dynamic threshold)."""
    measured = run(tmp_path, TIERMEM_KEEP_MALLOC="1")
    assert not measured["configured"]
    assert measured["kept"] > 12 << 20, measured


def test_the_users_own_glibc_settings_win(tmp_path):
    measured = run(tmp_path, MALLOC_MMAP_THRESHOLD_=str(1 << 28), MALLOC_TRIM_THRESHOLD_=str(1 << 30))
    assert not measured["configured"]
    assert measured["kept"] > 12 << 20, measured  # glibc's behaviour, as the user asked for
