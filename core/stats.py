"""Run statistics: what the summary table and ``--json`` report."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunStats:
    requests: int = 0
    finished: int = 0
    failed: int = 0  # ended by a plugin fault
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    peak_blocks_used: int = 0
    waste_at_peak: float = 0.0  # allocated slots not holding a token, at the peak of blocks used
    peak_running: int = 0
    preemptions: int = 0
    tokens_recomputed: int = 0
    blocks_shared_by_fork: int = 0
    prefill_tokens_computed: int = 0  # prompt tokens run through the model (prefix hits skip some)
    elapsed: float = 0.0

    def observe_memory(self, used_blocks: int, tokens_held: int, block_size: int, running: int) -> None:
        self.peak_running = max(self.peak_running, running)
        if used_blocks > self.peak_blocks_used or (used_blocks == self.peak_blocks_used and used_blocks):
            slots = used_blocks * block_size
            waste = 1.0 - tokens_held / slots if slots else 0.0
            if used_blocks > self.peak_blocks_used:
                self.waste_at_peak = waste
            else:
                self.waste_at_peak = min(self.waste_at_peak, waste)
            self.peak_blocks_used = used_blocks

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed if self.elapsed > 0 else 0.0
