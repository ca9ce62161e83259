"""How `engine run` shows a run while it goes: one prompt streams, several get a progress bar."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from pagedkv.core.startup_phases import mark


def drive(
    engine: Any, request_ids: list[str], stream_to: TextIO | None, progress: bool,
    stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Step until every request is done (or ``stop()`` says so between steps); returns {request_id: final output}.

    ``stream_to``: write the (single) request's new text there as tokens arrive.
    ``progress``: a transient rich progress bar on stderr with requests done and tokens/s.
    """
    results: dict[str, Any] = {}
    shown = ""
    bar = _ProgressBar(len(request_ids)) if progress else None
    first_token = True
    try:
        while engine.has_unfinished() and not (stop is not None and stop()):
            started = time.perf_counter()
            outputs = engine.step(stream=stream_to is not None)
            if first_token and engine.stats.generated_tokens:
                mark("first step (first token)", time.perf_counter() - started)
                first_token = False
            for out in outputs:
                if stream_to is not None:
                    shown = _write_new_text(stream_to, shown, out.text, out.finished)
                if out.finished:
                    results[out.request_id] = out
            if bar is not None:
                bar.update(len(results), engine.stats.generated_tokens)
    finally:
        if bar is not None:
            bar.close()
    return results


def _write_new_text(sink: TextIO, shown: str, text: str, finished: bool) -> str:
    """Write what ``text`` adds to ``shown``; hold a trailing replacement character (a half-decoded UTF-8
    character) until the next token completes it."""
    if not finished:
        text = text.rstrip("\ufffd")
    if not text.startswith(shown):  # a stop string cut text already shown: nothing more to add
        return shown
    sink.write(text[len(shown):])
    if finished:
        sink.write("\n")
    sink.flush()
    return text


class _ProgressBar:
    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._started = time.perf_counter()
        self._progress = Progress(
            TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(), transient=True, console=_stderr_console(),
        )
        self._task = self._progress.add_task("run", total=total, rate="")
        self._progress.start()

    def update(self, done: int, tokens: int) -> None:
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        self._progress.update(self._task, completed=done, rate=f"{tokens / elapsed:.1f} tok/s")

    def close(self) -> None:
        self._progress.stop()


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(file=sys.stderr)
