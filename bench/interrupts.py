"""Ctrl-C at random moments of a user's own training loop: is it lost, does it hang?

Each trial starts a fresh process that trains a small GPT under ``with tiermem.Runtime()``
(model states and activations on NVMe, so hooks, waits and finalizers run all through a
step), sends it SIGINT at a random moment, and then checks that it exits with a
KeyboardInterrupt within ``--timeout`` seconds and leaves no file. A trial that is still
running then either trains on (the interrupt was lost in a finalizer, TRAPS 18) or hangs
(a lock left taken, TRAPS 25); the stack of its main thread is printed (with py-spy, when
installed) to tell which.

    python bench/interrupts.py --trials 45

Run it on a tree without ``RuntimeInterruptGuard`` (``--no-guard``) to see the failures
it prevents.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LOOP = textwrap.dedent(
    """
    import sys, torch, tiermem
    from tiermem.app.models.gpt import GPT, GPTConfig
    if sys.argv[2] == "no-guard":
        import tiermem.interrupts
        tiermem.interrupts.RuntimeInterruptGuard.install = lambda self: None
    torch.manual_seed(0)
    config = {"device": {"capacity": "6MiB"}, "host": {"capacity": "16MiB"}, "nvme": {"paths": [sys.argv[1]]},
              "activations": {"min_bytes": 0}}
    with tiermem.Runtime(config) as rt:
        model = GPT(GPTConfig(vocab_size=512, n_layer=4, d_model=128, n_head=4, seq_len=64))
        plan = {"chunk_size": 1 << 20, "persistent_chunks": 0, "buffers": 2, "state_home": "nvme"}
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-3, plan=plan)
        tokens = torch.randint(0, 512, (2, 64))
        print("ready", flush=True)
        while True:
            with rt.offload_activations(model, policy="nvme"):
                _, loss = model(tokens, tokens)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    """
)


def trial(index: int, guard: bool, timeout: float, seed: int) -> str:
    root = Path(tempfile.mkdtemp(prefix="tiermem-bench-interrupts-"))
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", LOOP, str(root), "guard" if guard else "no-guard"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # background jobs ignore it
        )  # fmt: skip
        assert child.stdout is not None
        child.stdout.readline()
        time.sleep(random.Random(seed + index).uniform(0, 3))
        child.send_signal(signal.SIGINT)
        try:
            _out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stack = ""
            if shutil.which("py-spy"):
                dump = subprocess.run(["py-spy", "dump", "--pid", str(child.pid)], capture_output=True, text=True)
                stack = _main_thread_top(dump.stdout)
            child.kill()
            child.communicate()
            return f"still running after {timeout:.0f}s{': ' + stack.strip() if stack else ''}"
        left = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        if "KeyboardInterrupt" not in err:
            return f"exit {child.returncode} without KeyboardInterrupt: {err[-300:]}"
        return f"files left: {left}" if left else "ok"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _main_thread_top(dump: str, frames: int = 3) -> str:
    """The innermost ``frames`` frames of the main thread in a ``py-spy dump``."""
    lines = dump.splitlines()
    start = next((i for i, line in enumerate(lines) if '"MainThread"' in line), None)
    if start is None:
        return ""
    top = []
    for line in lines[start + 1 :]:
        if not line.startswith(" ") or len(top) == frames:
            break
        top.append(line.strip())
    return " <- ".join(top)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=45)
    parser.add_argument("--parallel", type=int, default=3, help="trials at once")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a trial may take to exit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-guard", action="store_true", help="turn RuntimeInterruptGuard off in the trials")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}; trials {args.trials}, "
          f"guard {'off' if args.no_guard else 'on'}")  # fmt: skip
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda i: trial(i, not args.no_guard, args.timeout, args.seed), range(args.trials)))
    for index, result in enumerate(results):
        if result != "ok":
            print(f"trial {index}: {result}")
    failed = sum(r != "ok" for r in results)
    print(f"{args.trials - failed} of {args.trials} Ctrl-Cs stopped the loop cleanly; {failed} did not")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
