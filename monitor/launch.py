"""Starting the dashboard: on a live engine or a recorded trace (``engine monitor``), or beside a run
(``engine run --monitor``); the command lines are in ``cli/``.

Textual is imported here, lazily, and only by the monitor: the engine and the
telemetry plugin never need it.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from pagedkv.core.errors import PagedKVError


class MonitorError(PagedKVError):
    """The monitor cannot start (missing Textual, unreadable trace, bad address)."""


def need_textual() -> None:
    try:
        import textual  # noqa: F401
    except ImportError:
        raise MonitorError("the monitor needs Textual: pip install 'pagedkv[monitor]'") from None


def need_terminal() -> None:
    """The dashboard draws on a terminal; into a pipe or a file it would only write escape codes forever."""
    if not (sys.stdout.isatty() and sys.stdin.isatty()):
        raise MonitorError("the monitor is a terminal dashboard, and stdin/stdout is not a terminal; run it in one "
                           "(for a record of a run, use engine run --trace FILE)")


def watch(connect: str | None = None, replay: str | None = None, speed: float = 1.0) -> int:
    """The dashboard on a live engine (``connect``) or a recorded trace (``replay``); the exit status."""
    from pagedkv.plugins.telemetry_address import parse_address

    if connect:
        parse_address(connect, allow_port_zero=False)  # refuse a non-loopback address up front
    need_textual()
    from pagedkv.core.trace import TraceError
    from pagedkv.monitor.app import MonitorApp, load_replay

    if replay:
        try:
            trace = load_replay(replay)
        except TraceError as exc:
            raise MonitorError(str(exc)) from None
        if not trace.messages:
            raise MonitorError(str(trace.error))
        need_terminal()  # after the trace is read: a bad file is reported as such
        app = MonitorApp(trace=trace, speed=speed)
    else:
        need_terminal()
        app = MonitorApp(connect=connect)
    return run_app(app)


def run_app(app: Any) -> int:
    """Run the dashboard; the exit status once it is gone: 143 if SIGTERM closed it, else 0.

    Textual's loop takes SIGTERM over and, closing, resets it to the default; the handler the
    caller had (the CLI's, which raises so clean-up runs) is put back here, so SIGTERM during the
    rest of ``engine run --monitor`` still stops the run cleanly.
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        app.run()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 143 if getattr(app, "terminated", False) else 0


def run_with_monitor(args: argparse.Namespace, cmd_run: Callable[[argparse.Namespace], int]) -> int:
    """``engine run --monitor``: the engine works on a thread while the dashboard runs in this process.

    Telemetry goes over a private Unix socket (in a fresh 0700 directory) unless
    ``--telemetry`` names one. What the run prints is shown after the dashboard closes.
    """
    need_textual()
    need_terminal()
    from pagedkv.monitor.app import MonitorApp

    run_args = copy.copy(args)
    run_args.monitor = False
    tmpdir = None
    if getattr(args, "telemetry", None):
        from pagedkv.plugins.telemetry_address import parse_address

        parse_address(args.telemetry, allow_port_zero=False)  # the dashboard must know where to connect
    else:
        tmpdir = tempfile.mkdtemp(prefix="pagedkv-monitor-")
        run_args.telemetry = f"unix:{os.path.join(tmpdir, 'telemetry.sock')}"
    result: dict = {}

    def work() -> None:
        try:
            result["rc"] = cmd_run(run_args)
        except PagedKVError as exc:
            result["error"] = exc
        except Exception as exc:  # noqa: BLE001 - reported after the dashboard closes
            result["error"] = exc

    captured: list[str] = []
    worker = threading.Thread(target=work, name="pagedkv-engine", daemon=True)
    app = MonitorApp(connect=run_args.telemetry, on_start=worker.start, capture=captured)
    status = run_app(app)
    sys.stdout.write("".join(captured))
    if status:
        print("engine: terminated (SIGTERM)", file=sys.stderr, flush=True)
        return status
    if worker.is_alive():
        print("engine: the monitor was closed; the run goes on (Ctrl-C to stop it)", file=sys.stderr, flush=True)
        try:
            worker.join()
        except KeyboardInterrupt:
            return 130
    if tmpdir is not None:
        try:
            os.rmdir(tmpdir)
        except OSError:
            pass
    if "error" in result:
        error = result["error"]
        if isinstance(error, PagedKVError):
            raise error
        raise MonitorError(f"the engine failed: {error!r}")
    return int(result.get("rc", 1))
