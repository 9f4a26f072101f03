"""``tiermem rok``: the recompute-offload-keep curve as a CSV and a PNG plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tiermem.app.models.gpt import GPTConfig
from tiermem.cli.arguments import add_gpt_shape
from tiermem.config import Config
from tiermem.units import format_size


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="tier configuration file (default: the embedded default)")
    parser.add_argument("--batch-sizes", type=_int_list, default=[1, 2, 4], help="comma list (default 1,2,4)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per point, after one warm-up (default: 2)")
    add_gpt_shape(parser, vocab=1024)
    parser.add_argument("--out", default="rok", help="output prefix: writes PREFIX.csv and PREFIX.png")
    parser.add_argument("--json", action="store_true", help="print the points as JSON")


def run(args: argparse.Namespace) -> int:
    from tiermem.app import rok  # torch and matplotlib only when the command runs

    if args.steps < 1:
        raise SystemExit("tiermem rok: --steps must be >= 1")
    config = Config.coerce(args.config)
    model_config = GPTConfig(
        n_layer=args.layers, d_model=args.d_model, n_head=args.heads, vocab_size=args.vocab, seq_len=args.seq_len
    )

    def show(point: rok.RokPoint) -> None:
        if not args.json:
            print(
                f"batch {point.batch_size:>3} {point.policy:<9} step {point.step_s:.3f}s  "
                f"peak activations {format_size(point.peak_activation_bytes)}"
            )

    points = rok.sweep(config, model_config, args.batch_sizes, steps=args.steps, on_point=show)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out.with_suffix(".csv"), out.with_suffix(".png")
    rok.write_csv(points, csv_path)
    title = f"ROK curve: GPT {args.layers}x{args.d_model}, seq {args.seq_len}"
    rok.plot(points, png_path, title)
    if args.json:
        print(json.dumps({"csv": str(csv_path), "png": str(png_path), "points": [vars(p) for p in points]}))
    else:
        print(f"wrote {csv_path} and {png_path}")
    return 0
