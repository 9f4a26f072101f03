"""What the I/O scheduler's threads spend a move when many moves are queued at once (NOTE
[ Scheduling rules ] rule 5 in tiermem.schedulers.asyncio_scheduler).

A training step queues hundreds of small moves together: a block's saved activations written out
as its forward ends, read back as backward nears it. Here ``--moves`` tensors of ``--size`` are
stored on the device tier (the CPU with a byte budget), all moved to NVMe and then all back,
``--rounds`` times in one process; each round prints the CPU microseconds a move of every tiermem
thread and of the calling thread (psutil), and the wall time. The first round, the
tier's first moves, runs slower (the scheduler 433-500 us a move against 183-233 after it, here),
so the summary is the median of the rounds after it.

    .venv/bin/python bench/queued_moves.py --moves 300 --size 2MiB --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time

import arguments  # bench/arguments.py: run as `python bench/NAME.py`, the folder is on sys.path
import machine  # bench/machine.py: run as `python bench/NAME.py`, the folder is on sys.path
import psutil


def thread_cpu_s() -> dict[int, float]:
    """User and system CPU seconds of each of this process's threads, by native id."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


def run(args: argparse.Namespace) -> list[dict[str, float]]:
    import torch

    import tiermem

    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(dir=args.path) as nvme:
        config = {"device": {"device": "cpu", "capacity": 2 * args.moves * args.size}, "nvme": {"paths": [nvme]}}
        with tiermem.Runtime(config) as rt:
            handles = [rt.store(torch.ones(args.size // 4), "device") for _ in range(args.moves)]
            threads = {t.native_id: t.name for t in threading.enumerate() if t.name.startswith("tiermem")}
            for _ in range(args.rounds):
                cpu = thread_cpu_s()
                main, wall = time.thread_time(), time.perf_counter()
                for tier in ("nvme", "device"):
                    for handle in handles:
                        handle.move_to(tier)
                    for handle in handles:
                        handle.wait()
                moves = 2 * args.moves
                after = thread_cpu_s()
                spent = {name: (after[tid] - cpu[tid]) * 1e6 / moves for tid, name in threads.items()}
                spent["calling thread"] = (time.thread_time() - main) * 1e6 / moves
                spent["wall"] = (time.perf_counter() - wall) * 1e6 / moves
                rounds.append(spent)
                if not args.json:
                    print("  " + ", ".join(f"{name} {us:.0f} us" for name, us in spent.items() if us >= 1), flush=True)
            for handle in handles:
                handle.free()
    return rounds


def tensor_size(value: str) -> int:
    """``--size``: bytes, a positive multiple of 4 KiB (what a tier reserves an object in)."""
    from tiermem import parse_size

    try:
        nbytes = parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if nbytes <= 0 or nbytes % 4096:
        raise argparse.ArgumentTypeError(f"{value}: a tensor's bytes must be a positive multiple of 4KiB")
    return nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moves", type=int, default=300, help="tensors moved together (default 300)")
    parser.add_argument(
        "--size",
        type=tensor_size,
        default=2 << 20,
        help="bytes of each, a multiple of 4KiB (default 2MiB: a saved activation's)",
    )
    parser.add_argument("--rounds", type=int, default=6, help="rounds out and back (default 6)")
    parser.add_argument("--path", type=arguments.directory, default=None, help="where the NVMe tier's files go")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    if args.moves < 1 or args.rounds < 1:
        parser.error("--moves and --rounds must be at least 1")
    facts = machine.facts()
    if not args.json:
        print(f"machine: {facts}")
    rounds = run(args)
    steady = rounds[1:] or rounds
    median = {name: statistics.median(r[name] for r in steady) for name in steady[0]}
    if args.json:
        settings = {"moves": args.moves, "size": args.size, "rounds": args.rounds}
        print(json.dumps({"machine": facts, "settings": settings, "us_a_move": rounds, "median_us_a_move": median}))
    else:
        print("median a move, rounds after the first: " + ", ".join(f"{k} {v:.0f} us" for k, v in median.items()))


if __name__ == "__main__":
    main()
