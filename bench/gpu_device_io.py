"""Device buffers to NVMe and back through the NVMe tier: posix (page-locked bounces) vs kvikio
(device memory handed to cuFile; NOTE [ NVMe tier layout and I/O ] rule 7). Part of
bench/gpu_check.sh; prints one JSON object. ``tiermem bench io`` measures host buffers.

    python bench/gpu_device_io.py [--size 512MiB] [--path DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from tiermem.tiers.backends import kvikio_backend
from tiermem.tiers.nvme import NvmeTier
from tiermem.units import parse_size


def measure(backend: str, path: str, nbytes: int) -> dict:
    tier = NvmeTier([path], nbytes + (1 << 20), backend=backend)
    try:
        allocation = tier.allocate(nbytes)
        source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        back = torch.empty_like(source)
        torch.cuda.synchronize()
        tier.fence()
        start = time.perf_counter()
        tier.write(allocation, 0, source).result()
        tier.sync().result()
        write_s = time.perf_counter() - start
        tier.fence()
        start = time.perf_counter()
        tier.read(allocation, 0, back).result()
        read_s = time.perf_counter() - start
        assert torch.equal(back, source), f"{backend}: bytes read back differ"
        counts = tier.segment_counts()
        facts = tier.describe()
        tier.free(allocation)
    finally:
        tier.close()
    return {
        "backend": facts["backend"],
        "backend_reason": facts["backend_reason"],
        "direct": facts["direct"],
        "bytes": nbytes,
        "write_GBps": round(nbytes / write_s / 1e9, 3),
        "read_GBps": round(nbytes / read_s / 1e9, 3),
        "segments": counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB")
    parser.add_argument("--path", default=None)
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    with tempfile.TemporaryDirectory(dir=args.path) as path:
        results = {"posix": measure("posix", path, nbytes)}
        ok, why = kvikio_backend.probe(path)
        results["kvikio"] = measure("kvikio", path, nbytes) if ok else {"skipped": f"kvikio unusable: {why}"}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
