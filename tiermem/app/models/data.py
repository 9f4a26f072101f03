"""Generated training data whose loss visibly falls within a few dozen steps.

Token sequences come from a fixed random *sparse* Markov chain: every token has between
``min_successors`` and ``max_successors`` possible next tokens with random probabilities.
A model starts at ``ln(vocab_size)`` nats (uniform guessing) and can get down to the chain's
entropy (about 1 nat), and the first big drop — learning which successors exist, a bigram
table — takes only a few dozen steps even for a tiny model. No downloads, no files, and the
same seed always gives the same chain and the same batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

__all__ = ["MarkovChainData"]


class MarkovChainData:
    """Batches ``(x, y)`` of shape ``(batch, seq_len)`` with ``y`` = ``x`` shifted left by one.

    The chain and the batch stream both come from a private ``torch.Generator`` seeded with
    ``seed``, so the global RNG (model init, dropout) is never consumed and a run is
    reproducible whatever else draws random numbers. ``stream`` picks one of several batch
    streams over the same chain (one per rank of a multi-process run): stream 0 continues the
    chain's generator, stream k > 0 has a generator of its own seeded from ``seed`` and k.
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        *,
        seed: int = 0,
        stream: int = 0,
        min_successors: int = 2,
        max_successors: int = 4,
    ) -> None:
        if vocab_size < 2 or seq_len < 1:
            raise ValueError(f"MarkovChainData: need vocab_size >= 2 and seq_len >= 1, got {vocab_size}, {seq_len}")
        if not 1 <= min_successors <= max_successors <= vocab_size:
            raise ValueError(
                f"MarkovChainData: need 1 <= min_successors <= max_successors <= vocab_size, got "
                f"{min_successors}, {max_successors}, {vocab_size}"
            )
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self._gen = torch.Generator().manual_seed(seed)
        # successors[t, j]: the j-th possible next token after t; probs[t, j] its probability
        # (0 in the padding slots of tokens with fewer than max_successors successors).
        counts = torch.randint(min_successors, max_successors + 1, (vocab_size,), generator=self._gen)
        order = torch.rand(vocab_size, vocab_size, generator=self._gen).argsort(dim=1)
        self.successors = order[:, :max_successors].contiguous()
        weights = torch.rand(vocab_size, max_successors, generator=self._gen, dtype=torch.float64) + 0.25
        weights[torch.arange(max_successors) >= counts[:, None]] = 0.0
        self.probs = weights / weights.sum(dim=1, keepdim=True)
        if stream < 0:
            raise ValueError(f"MarkovChainData: stream must be >= 0, got {stream}")
        if stream:  # the chain is seed's alone; the batches are this stream's (distinct from stream 0's)
            self._gen = torch.Generator().manual_seed((seed * 1_000_003 + stream) % 2**63)

    def batch(self, batch_size: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch of the stream: ``x`` and ``y``, int64, ``(batch_size, seq_len)``."""
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=self._gen)
        for t in range(self.seq_len):
            current = tokens[:, t]
            pick = torch.multinomial(self.probs[current], 1, generator=self._gen).squeeze(1)
            tokens[:, t + 1] = self.successors[current, pick]
        tokens = tokens.to(device)
        # Separate contiguous tensors, as a DataLoader would give: no hidden sharing between x and y.
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def stream_state(self) -> torch.Tensor:
        """Where the batch stream is: ``set_stream_state`` of it makes the next ``batch`` the
        one this stream would draw next (a resumed run continues the same data)."""
        return self._gen.get_state()

    def set_stream_state(self, state: torch.Tensor) -> None:
        self._gen.set_state(state)

    def batches(
        self, batch_size: int, count: int, device: torch.device | str = "cpu"
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``count`` consecutive batches of the stream."""
        for _ in range(count):
            yield self.batch(batch_size, device)

    def optimal_loss(self) -> float:
        """The lowest mean cross-entropy (nats) any model can reach on these sequences.

        Exact for this data: the first token is uniform and each next one depends only on
        the current one, so the best prediction at position t is the chain's row for x[t];
        averaged over positions with the distribution of x[t] propagated from uniform.
        """
        plogp = torch.where(self.probs > 0, self.probs * self.probs.clamp_min(1e-300).log(), 0.0)
        row_entropy = -plogp.sum(dim=1)
        dist = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        total = 0.0
        for _ in range(self.seq_len):
            total += float((dist * row_entropy).sum())
            dist = torch.zeros_like(dist).index_add_(
                0, self.successors.flatten(), (dist[:, None] * self.probs).flatten()
            )
        return total / self.seq_len

    def uniform_loss(self) -> float:
        """The loss of uniform guessing, where an untrained model starts: ``ln(vocab_size)``."""
        return math.log(self.vocab_size)
