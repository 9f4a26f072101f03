"""What a freshly faulted page costs on this machine, and how it depends on how long ago memory was
freed (TRAPS 22; NOTE [ Returning freed memory ] rule 5 in ``tiermem/malloc.py``).

Each round allocates ``--blocks`` tensors of ``--block-mib`` MiB, fills them (every page faulted in
and zeroed by the kernel, then written) and frees them; before each round it sleeps ``--gap``
seconds. A freed block of 32 MiB or more is unmapped at once (glibc's mmap threshold), so each
round's pages are new to the process. Run once with torch's huge-page alignment
(``THP_MEM_ALLOC_ENABLE=1``, what ``import tiermem`` sets) and once without, each in its own
process since torch reads the variable once.

On a VM whose balloon reports free pages to the hypervisor (virtio ``free page reporting``, feature
bit 5 of the balloon device, printed below), free blocks of 2 MiB and more go back to the host about
2 s after they are freed, and a page faulted in over them pays the host's fault as well: the rounds
after a gap of a few seconds then cost many times the rounds after none. Reported per mode and gap:
the median ms a MiB (wall and system time).

    .venv/bin/python bench/fresh_pages.py
    .venv/bin/python bench/fresh_pages.py --gaps 0,0.5,1,2,3,5 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import machine  # bench/machine.py: run as `python bench/NAME.py`, the folder is on sys.path


def balloon_reports_free_pages() -> bool | None:
    """True when a virtio balloon device offers free page reporting (feature bit 5); None without one."""
    for device in Path("/sys/bus/virtio/devices").glob("*"):
        try:
            if int((device / "device").read_text(), 16) == 5:  # VIRTIO_ID_BALLOON
                features = (device / "features").read_text().strip()
                return len(features) > 5 and features[5] == "1"
        except (OSError, ValueError):
            continue
    return None


def worker(args: argparse.Namespace) -> None:
    import resource

    import torch

    torch.set_num_threads(1)
    block = args.block_mib << 20
    results = {}
    for gap in args.gaps:
        wall, system = [], []
        for _ in range(args.rounds):
            time.sleep(gap)
            start_sys = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            start = time.perf_counter()
            blocks = [torch.empty(block, dtype=torch.uint8).fill_(1) for _ in range(args.blocks)]
            elapsed = time.perf_counter() - start
            sys_s = resource.getrusage(resource.RUSAGE_SELF).ru_stime - start_sys
            del blocks
            mib = args.blocks * args.block_mib
            wall.append(1e3 * elapsed / mib)
            system.append(1e3 * sys_s / mib)
        results[str(gap)] = {"ms_per_mib": statistics.median(wall), "sys_ms_per_mib": statistics.median(system)}
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gaps", default="0,0.5,3", help="seconds slept before each round, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block-mib", type=int, default=32)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        args.gaps = [float(g) for g in args.gaps.split(",")]
    except ValueError:
        parser.error(f"--gaps takes seconds separated by commas (e.g. 0,0.5,3), not {args.gaps!r}")
    if any(g < 0 for g in args.gaps) or min(args.rounds, args.blocks, args.block_mib) < 1:
        parser.error("--gaps must be >= 0 and --rounds, --blocks, --block-mib >= 1")
    if args.worker:
        worker(args)
        return
    print(json.dumps({"machine": machine.facts(), "free_page_reporting": balloon_reports_free_pages()}), flush=True)
    forwarded = [f"--gaps={','.join(map(str, args.gaps))}", f"--rounds={args.rounds}"]
    forwarded += [f"--blocks={args.blocks}", f"--block-mib={args.block_mib}"]
    for huge in ("1", "0"):
        out = subprocess.run(
            [sys.executable, __file__, "--worker", *forwarded],
            env={**os.environ, "THP_MEM_ALLOC_ENABLE": huge},
            capture_output=True,
            text=True,
            check=True,
        )
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        for gap, row in measured.items():
            print(
                f"huge pages {'on ' if huge == '1' else 'off'}  gap {float(gap):4.1f} s: "
                f"{row['ms_per_mib']:.3f} ms/MiB (system {row['sys_ms_per_mib']:.3f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
