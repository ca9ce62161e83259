"""Runs the HF model on one packed batch per step.

All scheduled tokens of all sequences go in one row ``[1, total_tokens]`` with
explicit ``position_ids``; HF's own cache is off, the KV lives in our paged
cache, and logits are computed only at the rows that sample (and at the prompt
positions of requests that asked for prompt logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.core.kv.attention_metadata import AttentionMetadata
from pagedkv.core.kv.kv_cache import KVCacheSpec, allocate_kv_caches
from pagedkv.core.kv.swap_space import SwapSpace
from pagedkv.core.model.cpu_linear import HasLinearKernel, pack_linears, packed_copies_fit, packed_linears
from pagedkv.core.model.hf_attention import ATTENTION_NAME, StepContext, register_attention
from pagedkv.core.model.llama_model import HasLlamaLayerKernel
from pagedkv.core.model.llama_model import LlamaForCausalLM as NativeLlama
from pagedkv.core.model.model_support import check_model_support
from pagedkv.core.model.quant_linear import HasQuantKernel, HasQuantLayerKernel, has_quantized, quantized_linears
from pagedkv.core.sample.logprobs import prompt_logprob_span
from pagedkv.core.sched.scheduler_output import SchedulerOutput
from pagedkv.core.startup_phases import phase


@dataclass
class StepBatch:
    """One step's inputs as plain lists, packed once per step: the tokens in one row, each sequence's
    block table and lengths, and the step's block moves (swap pairs, copy-on-write copies)."""

    input_ids: list[int]
    positions: list[int]
    sample_rows: list[int]  # rows of the packed batch whose logits are wanted (sampling, then prompt logprobs)
    block_tables: list[list[int]]
    context_lens: list[int]
    query_lens: list[int]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    block_copies: list[tuple[int, int]]


class ModelRunner:
    def __init__(
        self, model: Any, backend: Any, spec: KVCacheSpec, num_blocks: int, device: str,
        swap_space: SwapSpace | None = None, check_support: bool = True,
    ) -> None:
        if check_support:  # refuse what the engine would run wrongly, before anything (a sharded model: checked whole)
            with phase("model support checked"):
                check_model_support(model)
        if not getattr(model, "pagedkv_native", False):  # pagedkv's own Llama calls the attention directly
            register_attention()
            model.set_attn_implementation(ATTENTION_NAME)
        self.model = model
        self.backend = backend
        self.spec = spec
        self.device = device
        with phase(f"KV cache allocated ({num_blocks} blocks)"):
            self.kv_caches = allocate_kv_caches(spec, num_blocks, device)
        # fp32 linears on the CPU with packed weights, by the backend's kernel where it offers one, else
        # oneDNN: the bulk of a CPU step (pagedkv.core.model.cpu_linear); after the KV cache, which has the
        # first claim on memory
        self.linear_kernel = backend.linear_kernel if isinstance(backend, HasLinearKernel) else None
        # pagedkv's own Llama on the CPU: the layers' dense parts fused by the backend, where it offers that (it
        # packs the same weights as the linears, so not when those copies would not fit in memory)
        self.layer_kernel = (backend.llama_layer_kernel if device == "cpu" and isinstance(model, NativeLlama)
                             and isinstance(backend, HasLlamaLayerKernel) and packed_copies_fit(model) else None)
        if has_quantized(model):  # weights in GGUF blocks: the backend's layer for those, or none
            self.layer_kernel = (backend.quant_layer_kernel if device == "cpu" and isinstance(model, NativeLlama)
                                 and isinstance(backend, HasQuantLayerKernel) else None)
        # weights kept in GGUF blocks (quantization gguf): multiplied by the backend's kernel where it has one
        self.quant_kernel = backend.quant_kernel if isinstance(backend, HasQuantKernel) else None
        with phase("linear layers set to pack at first use"):
            self.packed_linears = device == "cpu" and pack_linears(model, self.linear_kernel) > 0
        # the other end of swap copies: host tensors of the swap space (pagedkv.core.kv.swap_space), if any
        self.cpu_kv_caches = swap_space.host_kv_caches(spec, device) if swap_space is not None else None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step; returns float32 logits ``[num_sampling_seqs, vocab]`` in scheduled order, followed
        by the rows of :func:`~pagedkv.core.sample.logprobs.prompt_logprob_span` (requests asking for prompt
        logprobs)."""
        return self.run(self.pack(out))

    def pack(self, out: SchedulerOutput) -> StepBatch:
        """The step as plain lists (what a tensor-parallel rank 0 sends to the other ranks)."""
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []  # positions whose logits give prompt logprobs, after the sampling rows
        for item in out.scheduled:
            start, end = prompt_logprob_span(item)
            first = len(input_ids) - item.context_len  # packed row of position 0
            prompt_rows.extend(range(first + start, first + end))
            input_ids.extend(item.seq.token_slice(item.context_len, item.context_len + item.num_new_tokens))
            positions.extend(range(item.context_len, item.context_len + item.num_new_tokens))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
        return StepBatch(
            input_ids, positions, sample_rows + prompt_rows,
            block_tables=[s.seq.block_table.blocks for s in out.scheduled],
            context_lens=[s.context_len for s in out.scheduled],
            query_lens=[s.num_new_tokens for s in out.scheduled],
            swap_out=list(out.swap_out), swap_in=list(out.swap_in), block_copies=list(out.block_copies),
        )

    def build_metadata(self, batch: StepBatch) -> AttentionMetadata:
        return AttentionMetadata.build(
            block_tables=batch.block_tables,
            context_lens=batch.context_lens,
            query_lens=batch.query_lens,
            block_size=self.spec.block_size,
            device=self.device,
        )

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Block moves, then the forward pass; logits at ``batch.sample_rows``."""
        # Order matters: blocks swapped out may be refilled by a swap-in or a copy of this same step.
        if batch.swap_out:
            self.backend.swap_blocks(self.kv_caches, self.cpu_kv_caches, torch.tensor(batch.swap_out))
        if batch.swap_in:
            self.backend.swap_blocks(self.cpu_kv_caches, self.kv_caches, torch.tensor(batch.swap_in))
        if batch.block_copies:
            pairs = torch.tensor(batch.block_copies, dtype=torch.int64, device=self.device)
            self.backend.copy_blocks(self.kv_caches, pairs)
        meta = self.build_metadata(batch)
        step = StepContext(meta=meta, backend=self.backend, kv_caches=self.kv_caches, layer_kernel=self.layer_kernel)
        with packed_linears(self.packed_linears, self.linear_kernel), quantized_linears(self.quant_kernel):
            result = self.model(
                input_ids=torch.tensor([batch.input_ids], dtype=torch.long, device=self.device),
                position_ids=torch.tensor([batch.positions], dtype=torch.long, device=self.device),
                use_cache=False,
                logits_to_keep=torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device),
                pagedkv_step=step,
            )
        return result.logits[0].float()

