"""Argument types and options the ``tiermem`` commands share: argparse reports a bad value with the
option's name and exits 2, before anything runs."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value


def add_gpt_shape(parser: argparse.ArgumentParser, *, vocab: int) -> None:
    """The built-in GPT's shape, as ``tiermem train`` and ``tiermem rok`` take it (``--vocab``
    defaults to ``vocab``)."""
    parser.add_argument("--layers", type=positive_int, default=4, help="transformer blocks (default: 4)")
    parser.add_argument("--d-model", type=positive_int, default=256, help="model width (default: 256)")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads (default: 4)")
    parser.add_argument("--vocab", type=positive_int, default=vocab, help=f"vocabulary size (default: {vocab})")
    parser.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sequence (default: 256)")
