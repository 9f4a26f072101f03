"""``import tiermem`` makes torch put large CPU tensors on page boundaries (tiermem/__init__.py,
TRAPS 5 and 22), so NVMe I/O into a chunk buffer refilled with ``resize_`` is zero-copy; a
user's own ``THP_MEM_ALLOC_ENABLE`` is left as it is. Each case runs in a fresh interpreter:
torch reads the variable once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json, os, sys, torch
import tiermem  # before the first large allocation, as a training script would
from tiermem.tiers.device import DeviceTier
from tiermem.tiers.nvme import NvmeTier
buffer = torch.empty(8 << 20, dtype=torch.uint8)
buffer.untyped_storage().resize_(0)  # how the chunk pool releases a streamed chunk ...
buffer.untyped_storage().resize_(8 << 20)  # ... and refills it
nvme = NvmeTier([sys.argv[1]], 64 << 20, block_size=1 << 20, queue_depth=4)
try:
    home = nvme.allocate(8 << 20)
    source = torch.arange(8 << 20, dtype=torch.int64).to(torch.uint8)
    nvme.write(home, 0, source).result()
    nvme.read(home, 0, buffer).result()
    counts = nvme.segment_counts()
    # More large tensors, held together: one buffer's offset alone can be 0 by chance (a
    # refilled buffer may come from glibc's heap, 64-byte aligned), four of them hardly.
    more = [torch.empty(n << 20, dtype=torch.uint8) for n in (3, 5, 6, 7)]
    print(json.dumps({
        "more_offsets": [t.data_ptr() % 4096 for t in more],
        "env": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "offset_in_page": buffer.data_ptr() % 4096,
        "equal": bool(torch.equal(buffer, source)),
        "zero_copy": counts["zero_copy"],
        "staged": counts["staged"],
        "direct": bool(nvme.describe().get("direct")),
    }))
finally:
    nvme.close()
"""


def _probe(tmp_path: Path, env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_tiermem_page_aligns_large_tensors_so_nvme_reads_are_zero_copy(tmp_path: Path) -> None:
    result = _probe(tmp_path, None)
    assert result["env"] == "1"
    assert result["offset_in_page"] == 0 and result["more_offsets"] == [0, 0, 0, 0]
    assert result["equal"]
    if not result["direct"]:
        pytest.skip("this filesystem refused O_DIRECT: every segment is staged either way")
    # The write's source and the read's chunk buffer: no bounce copy.
    assert result["staged"] == 0 and result["zero_copy"] > 0
    assert list(tmp_path.iterdir()) == []


def test_a_users_choice_is_kept(tmp_path: Path) -> None:
    result = _probe(tmp_path, "0")
    assert result["env"] == "0"
    assert result["equal"]
    # torch's default placement: 64-byte aligned (glibc's mapping or heap), not page-aligned;
    # any one tensor may land on a page boundary by chance, not all five.
    assert any(offset != 0 for offset in [result["offset_in_page"], *result["more_offsets"]])
    if result["direct"] and result["offset_in_page"] != 0:  # unaligned buffers cost bounce copies
        assert result["staged"] > 0 and result["zero_copy"] == 0
    assert list(tmp_path.iterdir()) == []
