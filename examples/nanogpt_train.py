"""nanoGPT's training loop (Karpathy's ``train.py``: gradient accumulation, autocast with a
``GradScaler``, gradient clipping after ``unscale_``, a warmup + cosine learning rate set on the
param groups, periodic ``estimate_loss`` under ``model.eval()``), at a tiny size on synthetic
data. ``nanogpt_train_tiermem.py`` is ``nanogpt_train.py`` with 3 lines changed (README, "Your
training loop"). Prints every iteration's loss exactly (``repr``) and a digest of the final
weights. On the CPU, fp16 autocast and ``torch.amp.GradScaler("cpu")`` as on a GPU.

    python examples/nanogpt_train.py --max_iters 20 --dtype float16
"""

from __future__ import annotations

import argparse
import hashlib
import math
from contextlib import nullcontext

import torch

from nanogpt_model import GPT, GPTConfig


def parse_args() -> argparse.Namespace:
    """nanoGPT's configuration names, tiny defaults."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [
        ("n_layer", 4), ("n_head", 4), ("n_embd", 64), ("block_size", 64), ("vocab_size", 96), ("batch_size", 4),
        ("gradient_accumulation_steps", 2), ("max_iters", 8), ("warmup_iters", 2), ("lr_decay_iters", 8),
        ("eval_interval", 4), ("eval_iters", 2),
    ]:  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    for name, default in [
        ("learning_rate", 6e-4), ("min_lr", 6e-5), ("weight_decay", 1e-1), ("beta1", 0.9), ("beta2", 0.95),
        ("grad_clip", 1.0), ("dropout", 0.1),
    ]:  # fmt: skip
        parser.add_argument(f"--{name}", type=float, default=default)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float16", choices=["float32", "bfloat16", "float16"])
    return parser.parse_args()


def synthetic_data(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Stands in for shakespeare_char's train.bin/val.bin: a noisy periodic token stream."""
    generator = torch.Generator().manual_seed(0)
    tokens = (torch.arange(20_000) * 7 + torch.randint(0, 3, (20_000,), generator=generator)) % args.vocab_size
    return {"train": tokens[:18_000], "val": tokens[18_000:]}


def get_batch(data: dict[str, torch.Tensor], split: str, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = data[split]
    ix = torch.randint(len(tokens) - args.block_size, (args.batch_size,))
    x = torch.stack([tokens[i : i + args.block_size] for i in ix])
    y = torch.stack([tokens[i + 1 : i + 1 + args.block_size] for i in ix])
    return x.to(args.device), y.to(args.device)


def get_lr(it: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to ``min_lr``."""
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return args.min_lr
    decay_ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return args.min_lr + coeff * (args.learning_rate - args.min_lr)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().clone().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(model: GPT, optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> None:
    data = synthetic_data(args)
    device_type = "cuda" if "cuda" in args.device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    ctx = nullcontext() if args.dtype == "float32" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
    scaler = torch.amp.GradScaler(device_type, enabled=(args.dtype == "float16"))

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(data, split, args)
                with ctx:
                    _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    X, Y = get_batch(data, "train", args)
    for iter_num in range(args.max_iters):
        lr = get_lr(iter_num, args)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']!r}, val loss {losses['val']!r}")
        for _micro_step in range(args.gradient_accumulation_steps):
            with ctx:
                _, loss = model(X, Y)
                loss = loss / args.gradient_accumulation_steps
            X, Y = get_batch(data, "train", args)
            scaler.scale(loss).backward()
        if args.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item() * args.gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf!r}, lr {lr:.4e}, scale {scaler.get_scale()!r}")
    print(f"weights {digest(model)}")


def main() -> None:
    args = parse_args()
    torch.manual_seed(1337)
    config = GPTConfig(args.block_size, args.vocab_size, args.n_layer, args.n_head, args.n_embd, args.dropout)
    model = GPT(config).to(args.device)
    device_type = args.device.split(":")[0]
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, (args.beta1, args.beta2), device_type)
    train(model, optimizer, args)


if __name__ == "__main__":
    main()
