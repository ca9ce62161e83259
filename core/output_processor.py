"""Turning a step's touched requests into what the user gets back (vLLM's output processor).

A request's output is built from its sequences (text decoded incrementally, logprobs, finish
reasons). Building one can fail (a tokenizer raising on its tokens): that request then ends
alone with finish reason ``"error"`` and keeps the tokens it had; the others are unaffected.
"""

from __future__ import annotations

from typing import Any

from pagedkv.core.sched.request_groups import RequestGroups
from pagedkv.core.sched.scheduler_interface import Scheduler
from pagedkv.core.sched.sequence import RequestOutput, Sequence
from pagedkv.core.stats import RunStats


class OutputProcessor:
    def __init__(self, requests: RequestGroups, scheduler: Scheduler, stats: RunStats, tokenizer: Any) -> None:
        self.requests = requests  # the engine's live requests; a finished one is let go here
        self.scheduler = scheduler
        self.stats = stats
        self.tokenizer = tokenizer

    def emit(self, touched: dict[str, None], stream: bool) -> list[RequestOutput]:
        """Outputs of the requests the step touched (finished ones always, others if ``stream``); a
        finished request is forgotten. A request whose output cannot be built ends alone, with an error."""
        outputs = []
        for request_id in touched:
            seqs = self.requests[request_id]
            finished = seqs[0].is_finished if len(seqs) == 1 else all(s.is_finished for s in seqs)
            if finished or stream:
                try:
                    outputs.append(RequestOutput.of(request_id, seqs, finished, self.tokenizer))
                except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer failing: this request ends alone
                    outputs.append(self._failed(request_id, seqs, exc))
                    finished = True
            if finished:
                self.requests.pop(request_id)
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
