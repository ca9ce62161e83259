"""The `engine` command: the parser and the dispatch to each subcommand's module under ``cli/``
(``run``, the default, ``serve``, ``monitor``, ``simulate``, ``plugins``).

It sits above core, plugins, serve, monitor and sim: the one place that composes them all."""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedkv.cli.interrupts import SignalsAfterReturn, raise_on_sigterm, report_interrupt
from pagedkv.core.errors import PagedKVError
from pagedkv.core.startup_phases import mark, since_start

# subcommand -> (its module under cli/, the function that runs it); each module has add_arguments(parser)
COMMANDS = {
    "run": ("pagedkv.cli.run", "cmd_run"),
    "monitor": ("pagedkv.cli.monitor", "run"),
    "plugins": ("pagedkv.cli.plugins", "cmd_plugins"),
    "simulate": ("pagedkv.cli.simulate", "run_cli"),
    "serve": ("pagedkv.cli.serve", "run"),
}
_HELP = {
    "run": "run a workload (the built-in chat demo by default) and print a summary",
    "monitor": "the live block-map dashboard: --connect ADDR or --replay FILE",
    "plugins": "list loaded plugins: distribution, version, hooks they implement",
    "simulate": "capacity planning: a workload through the real scheduler, no model",
    "serve": "an OpenAI-compatible HTTP server (needs the serve extra)",
}


def build_parser() -> argparse.ArgumentParser:
    from pagedkv import __version__

    parser = argparse.ArgumentParser(prog="engine", description="pagedkv: a PagedAttention inference engine")
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="how much pagedkv logs to stderr (default: %(default)s)")
    sub = parser.add_subparsers(dest="command")
    for name, (module, _) in COMMANDS.items():
        # plugins' help is short enough without the defaults
        formatter = argparse.HelpFormatter if name == "plugins" else argparse.ArgumentDefaultsHelpFormatter
        command = sub.add_parser(name, help=_HELP[name], formatter_class=formatter)
        importlib.import_module(module).add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    imported = since_start()  # the interpreter's start and `import pagedkv.cli.main`
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args([*(argv or []), "run"])
    import logging

    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(levelname)s: %(message)s")
    mark("python started, engine imported", imported)
    mark("arguments parsed", since_start() - imported)
    raise_on_sigterm()
    try:
        if args.command in COMMANDS:
            module, function = COMMANDS[args.command]
            return getattr(importlib.import_module(module), function)(args)
    except PagedKVError as exc:
        print(f"engine: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM outside a run loop (e.g. while the model loads)
        return report_interrupt(exc)
    parser.print_help()
    return 1


def entry() -> None:
    """The ``engine`` console script: :func:`main`, then an exit without the interpreter's teardown.

    Tearing down torch's thousands of modules and C++ state took 1.5-1.9 s after ``engine run`` had
    printed everything, time in which the shell waits for nothing. The exit handlers still
    run (logging, telemetry files, plugins', tensor-parallel workers'), and both streams are flushed;
    only the module teardown is skipped. An exception leaves through the normal path (its traceback).
    A SIGINT/SIGTERM that lands in main's own error report, or while the exit handlers run, ends the
    process with 128 + its number and no traceback.
    """
    import atexit
    import os

    try:
        code = main()
    except KeyboardInterrupt as exc:  # inside main's except clauses, after its run or error report
        code = report_interrupt(exc)
    late = SignalsAfterReturn().hold()
    atexit._run_exitfuncs()  # what a normal exit runs first, in the same order
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (engine run | head): nothing left to deliver
            pass
    if late.status is not None:
        code = late.status
    os._exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    entry()
