"""Built-in models and generated data for ``tiermem train`` and the benchmarks (no downloads).

Submodules import torch; this package's ``__init__`` only re-exports them, so importing
``tiermem`` itself stays light (it never imports this package).
"""

from __future__ import annotations

from tiermem.app.models.data import MarkovChainData
from tiermem.app.models.gpt import GPT, Block, GPTConfig, activation_bytes_per_step

__all__ = ["GPT", "Block", "GPTConfig", "MarkovChainData", "activation_bytes_per_step"]
