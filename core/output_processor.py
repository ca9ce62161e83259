"""Turning a step's touched requests into what the user gets back (vLLM's output processor).

A request's output is built from its sequences (text decoded incrementally, logprobs, finish
reasons). Building one can fail (a tokenizer raising on its tokens): that request then ends
alone with finish reason ``"error"`` and keeps the tokens it had; the others are unaffected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.core.sequence import RequestOutput, Sequence
from pagedkv.core.stats import RunStats


class OutputProcessor:
    def __init__(self, groups: dict[str, list[Sequence]], scheduler: Any, stats: RunStats, tokenizer: Any,
                 forget: Callable[[Sequence], None]) -> None:
        self.groups = groups  # request id -> its sequences (the engine's, shared)
        self.scheduler = scheduler
        self.stats = stats
        self.tokenizer = tokenizer
        self.forget = forget  # drops a finished sequence's engine state (its sampler generator)

    def emit(self, touched: dict[str, None], stream: bool) -> list[RequestOutput]:
        """Outputs of the requests the step touched (finished ones always, others if ``stream``); a
        finished request is forgotten. A request whose output cannot be built ends alone, with an error."""
        outputs = []
        for request_id in touched:
            seqs = self.groups[request_id]
            finished = seqs[0].is_finished if len(seqs) == 1 else all(s.is_finished for s in seqs)
            if finished or stream:
                try:
                    outputs.append(RequestOutput.of(request_id, seqs, finished, self.tokenizer))
                except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer failing: this request ends alone
                    outputs.append(self._failed(request_id, seqs, exc))
                    finished = True
            if finished:
                del self.groups[request_id]
                for seq in seqs:
                    self.forget(seq)
        return outputs

    def _failed(self, request_id: str, seqs: list[Sequence], exc: Exception) -> RequestOutput:
        """Its output could not be built: every sample ends with an error and keeps the text it had."""
        message = f"building the output failed: {type(exc).__name__}: {exc}"
        for seq in seqs:
            if seq.finish_reason == "error":  # failed earlier: its own error stands
                continue
            if seq.is_finished:
                self.stats.finished -= 1
            else:
                self.scheduler.finish(seq, "error")
            seq.finish_reason, seq.error = "error", message
            self.stats.failed += 1
        first = seqs[0]
        completions = [seq.completion(index) for index, seq in enumerate(seqs)]
        return RequestOutput(request_id, first.prompt, list(first.prompt_token_ids), completions, True,
                             first.prompt_logprobs_out())
