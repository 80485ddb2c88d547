"""``python -m lightning_distgrad.profiler plot trace.json out.png``: draw a merged timeline."""

from __future__ import annotations

import argparse

from ._plot import plot_timeline


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_distgrad.profiler")
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("plot", help="draw a merged trace as a PNG")
    plot.add_argument("trace", help="the trace written by lightning_distgrad.profiler.profile")
    plot.add_argument("out", help="the PNG to write")
    args = parser.parse_args(argv)
    plot_timeline(args.trace, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
