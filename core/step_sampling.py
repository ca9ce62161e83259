"""The sample phase of a step, failing per request: what the model computed becomes tokens.

Prompt logprobs are recorded from their rows, then every sequence that sampled draws its token
(batched, with its own generator). Anything that fails for one request here (its logits
processors, its prompt logprobs, its min-tokens ban) is kept as that request's fault; the engine
fails it once the step's bookkeeping is done, and the others go on exactly as without the fault.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedkv.core.sample.grammar_compiler import GrammarCompiler
from pagedkv.core.sample.grammar_step import advance_matchers, allowed_masks
from pagedkv.core.sample.logprobs import prompt_logprob_span, record_prompt_logprobs
from pagedkv.core.sample.mask_ahead import MaskAhead
from pagedkv.core.sample.sampler import Sampler
from pagedkv.core.sample.sampling_batch import SamplingBatch
from pagedkv.core.sched.scheduler_output import Sample, SchedulerOutput
from pagedkv.core.sched.sequence import Sequence
from pagedkv.core.sched.stop_check import StopCheck

Fork = Callable[[Sequence, int], list[Sequence]]  # (parent, its computed tokens) -> the children forked from it


def sampling_rows(out: SchedulerOutput, fork: Fork) -> tuple[list[Sequence], list[int]]:
    """The sequences that sample this step and their logits rows. A parent with samples still to fork
    is split first (``fork(parent, computed)`` returns its new children): they share the parent's row
    but draw with their own generators."""
    seqs: list[Sequence] = []
    rows: list[int] = []
    row = 0
    for item in out.scheduled:
        if item.samples:
            seq = item.seq
            forked = fork(seq, item.context_len + item.num_new_tokens) if seq.pending_forks else ()
            for sample in (seq, *forked):
                seqs.append(sample)
                rows.append(row)
            row += 1
    return seqs, rows


class StepSampling:
    def __init__(self, sampler: Sampler, stop_check: StopCheck, seq_keys: dict[int, int],
                 grammars: GrammarCompiler | None = None, masks: MaskAhead | None = None) -> None:
        self.sampler = sampler
        self.grammars = grammars  # the engine's GrammarCompiler (its backend fills the masks), or None
        self.masks = masks  # slow grammars' masks, computed ahead off the step loop (or None: all in the step)
        self.stop_check = stop_check
        self.seq_keys = seq_keys  # seq_id -> its generator's key (the engine's)
        self._faults: dict[Sequence, Exception] = {}  # this step's per-request failures after the model ran

    def run(self, out: SchedulerOutput, seqs: list[Sequence], rows: list[int], logits: torch.Tensor) -> list[Sample]:
        """Tokens for ``seqs`` (logits row ``rows[i]`` each); rows past the last are prompt logprobs."""
        sampling_rows = rows[-1] + 1 if rows else 0
        if logits.shape[0] > sampling_rows:
            self._prompt_logprobs(out, logits[sampling_rows:])
            logits = logits[:sampling_rows]
        return self.draw(seqs, rows, logits)

    def take_faults(self) -> dict[Sequence, Exception]:
        """This step's failed sequences, and a clean slate for the next step."""
        faults, self._faults = self._faults, {}
        return faults

    def _prompt_logprobs(self, out: SchedulerOutput, logits: torch.Tensor) -> None:
        """Each request's prompt logprobs from its own rows; one that fails ends that request alone."""
        offset = 0
        for item in out.scheduled:
            start, end = prompt_logprob_span(item)
            if start == end:
                continue
            try:
                record_prompt_logprobs([item], logits[offset : offset + end - start])
            except Exception as exc:  # noqa: BLE001 - not the other requests' problem
                self._fault(item.seq, "prompt logprobs", exc)
            offset += end - start

    def _fault(self, seq: Sequence, what: str, exc: Exception) -> None:
        """``seq`` failed after the model ran; the step fails it once its bookkeeping is done."""
        self._faults.setdefault(seq, RuntimeError(f"{what} failed: {type(exc).__name__}: {exc}"))

    def draw(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor) -> list[Sample]:
        if not seqs:
            return []
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        banned = []
        for seq in seqs:
            try:
                p = seq.params
                banned.append(self.stop_check.banned(seq) if p.min_tokens or p.bad_words_token_ids else ())
            except Exception as exc:  # noqa: BLE001 - this row fails below, alone
                banned.append(())
                self._fault(seq, "sampling", exc)
        constrained = self.grammars is not None and any(s.matcher is not None for s in seqs)
        allowed = (allowed_masks(seqs, self.grammars.backend, logits.shape[-1], self._fault, self.masks)
                   if constrained else None)
        batch = SamplingBatch.of(seqs, banned, [self.seq_keys[s.seq_id] for s in seqs], allowed)
        result = self.sampler.sample(logits, batch)
        for seq, exc in zip(seqs, result.errors):
            if exc is not None:
                self._fault(seq, "sampling", exc)
        if constrained:
            advance_matchers(seqs, result.tokens, self._faults, self._fault)
        faults = self._faults
        return [sample for sample in zip(seqs, result.tokens, result.logprobs) if sample[0] not in faults]
