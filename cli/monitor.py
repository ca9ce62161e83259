"""``engine monitor --connect ADDR | --replay FILE [--speed X]``: the live block-map dashboard
(``monitor/launch.py`` starts it)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--connect", metavar="ADDR", help="watch a live engine: unix:PATH or tcp:127.0.0.1:PORT")
    source.add_argument("--replay", metavar="FILE", help="replay a trace recorded with engine run --trace FILE")
    parser.add_argument("--speed", type=float, default=1.0, help="replay speed factor (0: as fast as possible)")


def run(args: argparse.Namespace) -> int:
    """``engine monitor``: returns the exit status."""
    from pagedkv.monitor.launch import watch

    return watch(connect=args.connect, replay=args.replay, speed=args.speed)
