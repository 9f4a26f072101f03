"""torchtune's full fine-tuning loop (the ``full_finetune_single_device`` recipe's ``train``:
an SFT dataset whose prompt tokens are masked with ``ignore_index``, a shuffling ``DataLoader``
with padding collation, loss summed over tokens and gradients scaled by ``1 / num_tokens`` at
the end of each accumulation window, ``clip_grad_norm_``, a cosine schedule with warmup), with
the forward under ``torch.amp.autocast(dtype=torch.bfloat16)``; tiny size, synthetic data.
``torchtune_finetune_tiermem.py`` is ``torchtune_finetune.py`` with 3 lines changed (README,
"Your training loop"). Prints every step's loss exactly (``repr``) and a digest of the final
weights.

    python examples/torchtune_finetune.py --epochs 1 --max_steps_per_epoch 6
"""

from __future__ import annotations

import argparse
import hashlib
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from torchtune_model import TransformerDecoder

CROSS_ENTROPY_IGNORE_IDX = -100


class SyntheticInstructDataset(Dataset[dict[str, list[int]]]):
    """Stands in for an instruct dataset: prompt then response, prompt tokens not trained on."""

    def __init__(self, size: int, vocab_size: int, max_len: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.samples = []
        for _ in range(size):
            prompt = torch.randint(1, vocab_size, (int(torch.randint(4, max_len // 2, (1,), generator=generator)),))
            response = (prompt[: max_len // 2].flip(0) + 1) % vocab_size  # learnable: the reversed prompt + 1
            tokens = torch.cat([prompt, response]).tolist()
            labels = [CROSS_ENTROPY_IGNORE_IDX] * len(prompt) + response.tolist()
            self.samples.append({"tokens": tokens, "labels": labels})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.samples[index]


def padded_collate_sft(batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    length = max(len(sample["tokens"]) for sample in batch)
    tokens = [sample["tokens"] + [0] * (length - len(sample["tokens"])) for sample in batch]
    labels = [sample["labels"] + [CROSS_ENTROPY_IGNORE_IDX] * (length - len(sample["labels"])) for sample in batch]
    return {"tokens": torch.tensor(tokens), "labels": torch.tensor(labels)}


def get_cosine_schedule_with_warmup(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    def lr_lambda(current_step: int) -> float:
        if current_step < num_warmup_steps:
            return current_step / max(1, num_warmup_steps)
        progress = (current_step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 2.0 * 0.5 * progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def scale_grads(model: nn.Module, scaler: torch.Tensor) -> None:
    """torchtune's ``training.scale_grads``."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= scaler


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().clone().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [
        ("vocab_size", 128), ("num_layers", 4), ("embed_dim", 64), ("num_heads", 4), ("num_kv_heads", 2),
        ("max_seq_len", 48), ("batch_size", 4), ("gradient_accumulation_steps", 2), ("epochs", 1),
        ("max_steps_per_epoch", 6), ("num_warmup_steps", 2), ("seed", 0),
    ]:  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--clip_grad_norm", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args()


def train(model: nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> None:
    dataset = SyntheticInstructDataset(64, args.vocab_size, args.max_seq_len)
    sampler_generator = torch.Generator().manual_seed(args.seed)
    dataloader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, generator=sampler_generator, collate_fn=padded_collate_sft
    )
    total_steps = args.epochs * min(args.max_steps_per_epoch, len(dataloader) // args.gradient_accumulation_steps)
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, args.num_warmup_steps, total_steps)
    loss_fn = nn.CrossEntropyLoss(ignore_index=CROSS_ENTROPY_IGNORE_IDX)
    autocast = torch.amp.autocast(args.device.split(":")[0], dtype=torch.bfloat16)
    ignore_labels_cache = torch.full((args.batch_size, 1), CROSS_ENTROPY_IGNORE_IDX, device=args.device)
    model.train()
    global_step = 0
    for curr_epoch in range(args.epochs):
        running_loss, num_tokens = torch.zeros((), device=args.device), torch.zeros((), device=args.device)
        for idx, batch in enumerate(dataloader):
            if idx // args.gradient_accumulation_steps == args.max_steps_per_epoch:
                break
            tokens, labels = batch["tokens"].to(args.device), batch["labels"].to(args.device)
            current_num_tokens = (labels != CROSS_ENTROPY_IGNORE_IDX).sum()
            num_tokens += current_num_tokens
            with autocast:
                logits = model(tokens)
            labels = torch.hstack((labels[..., 1:], ignore_labels_cache[: labels.shape[0]]))
            current_loss = loss_fn(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1)) * current_num_tokens
            running_loss += current_loss.detach()
            current_loss.backward()
            if (idx + 1) % args.gradient_accumulation_steps == 0:
                scale_grads(model, 1 / num_tokens)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=args.clip_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                lr_scheduler.step()
                global_step += 1
                loss_to_log = running_loss.item() / num_tokens.item()
                print(
                    f"epoch {curr_epoch} step {global_step}: loss {loss_to_log!r}, grad_norm {grad_norm.item()!r}, "
                    f"lr {lr_scheduler.get_last_lr()[0]:.4e}"
                )
                running_loss, num_tokens = torch.zeros((), device=args.device), torch.zeros((), device=args.device)
    print(f"weights {digest(model)}")


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    model = TransformerDecoder(
        args.vocab_size, args.num_layers, args.embed_dim, args.num_heads, args.num_kv_heads, args.max_seq_len
    ).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train(model, optimizer, args)


if __name__ == "__main__":
    main()
