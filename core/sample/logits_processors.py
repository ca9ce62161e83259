"""Batched logits processors: each changes a whole ``[rows, vocab]`` float32 tensor in a few tensor ops.

Semantics are vLLM's (and, where transformers has the same processor, identical to it): a row's
parameters arrive as per-row tensors or lists, and a row whose setting is "off" comes out unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from pagedkv.core.sample.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _flat_index(per_row: SequenceOf[SequenceOf[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of every id in ``per_row`` as two int64 tensors."""
    rows = [r for r, ids in enumerate(per_row) for _ in range(len(ids))]
    cols = [t for ids in per_row for t in ids]
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(cols, dtype=torch.long, device=device))


def ban_tokens(logits: torch.Tensor, banned: SequenceOf[SequenceOf[int]]) -> None:
    """Row ``r`` can never produce ``banned[r]`` (HF's NoBadWords with one-token words; vLLM's min_tokens)."""
    if any(banned):
        logits[_flat_index(banned, logits.device)] = NEG_INF


def keep_only(logits: torch.Tensor, allowed: SequenceOf[SequenceOf[int] | None]) -> None:
    """Row ``r`` can produce only ``allowed[r]`` (None: every token), vLLM's ``allowed_token_ids``."""
    for r, ids in enumerate(allowed):
        if ids is not None:
            mask = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
            mask[torch.tensor(list(ids), dtype=torch.long, device=logits.device)] = False
            logits[r].masked_fill_(mask, NEG_INF)
def apply_allowed_tokens(logits: torch.Tensor, allowed: SequenceOf[torch.Tensor | None]) -> None:
    """Row ``r`` may produce only the tokens whose bit is set in ``allowed[r]`` (a packed int32 mask row from a
    grammar, see ``grammar_backend``; None = unconstrained). One unpack and one masked fill for all such rows;
    tokens past the mask's width are disallowed."""
    rows = [r for r, mask in enumerate(allowed) if mask is not None]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    packed = torch.stack([allowed[r] for r in rows]).to(device)
    bits = (packed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=device)) & 1
    keep = bits.view(len(rows), -1).bool()
    if keep.shape[1] < vocab:
        keep = torch.nn.functional.pad(keep, (0, vocab - keep.shape[1]), value=False)
    keep = keep[:, :vocab]
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~keep, NEG_INF)
        return
    index = torch.tensor(rows, dtype=torch.long, device=device)
    logits[index] = logits[index].masked_fill_(~keep, NEG_INF)


def add_logit_bias(logits: torch.Tensor, biases: SequenceOf[dict[int, float]]) -> None:
    """Add ``biases[r][token]`` to row ``r``'s logit of ``token`` (OpenAI / vLLM ``logit_bias``)."""
    if not any(biases):
        return
    index = _flat_index([list(b) for b in biases], logits.device)
    values = torch.tensor([v for b in biases for v in b.values()], dtype=logits.dtype, device=logits.device)
    logits.index_put_(index, values, accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    params: SequenceOf[SamplingParams],
    prompt_ids: SequenceOf[SequenceOf[int]],
    output_ids: SequenceOf[SequenceOf[int]],
) -> None:
    """Repetition penalty over prompt + output tokens (HF: a positive logit is divided by it, a negative one
    multiplied), then ``logit -= frequency * count + presence * (count > 0)`` over output tokens (OpenAI)."""
    rows = [r for r, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    device = logits.device
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    sub = logits[row_index]
    counts = torch.zeros_like(sub)
    outputs = [output_ids[r] for r in rows]
    if any(outputs):
        index = _flat_index(outputs, device)
        counts.index_put_(index, torch.ones(index[0].shape[0], dtype=sub.dtype, device=device), accumulate=True)
    occurred = counts > 0
    repetition = torch.tensor([params[r].repetition_penalty for r in rows], dtype=sub.dtype, device=device)
    if bool((repetition != 1.0).any()):
        seen = occurred.clone()
        seen[_flat_index([prompt_ids[r] if params[r].repetition_penalty != 1.0 else () for r in rows], device)] = True
        rep = repetition.unsqueeze(1)
        sub = torch.where(seen, torch.where(sub < 0, sub * rep, sub / rep), sub)
    frequency = torch.tensor([params[r].frequency_penalty for r in rows], dtype=sub.dtype, device=device)
    presence = torch.tensor([params[r].presence_penalty for r in rows], dtype=sub.dtype, device=device)
    sub = sub - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * occurred.to(sub.dtype)
    logits[row_index] = sub


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits / t`` per row (every ``t`` > 0); overflow is clamped so a softmax stays defined."""
    scaled = logits / temperature.unsqueeze(1)
    big = torch.finfo(scaled.dtype).max
    return torch.nan_to_num_(scaled, nan=NEG_INF, posinf=big, neginf=NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability (0 = off)."""
    if not bool((min_p > 0).any()):
        return
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: SequenceOf[int], top_p: SequenceOf[float]) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties at the k-th kept; 0 = off), then the smallest set of
    those whose renormalized probability reaches ``top_p`` (1 = off).

    Each row comes out exactly as it would alone: rows are processed in groups of equal ``top_k`` and equal
    "top-p on or off", and each row's path is chosen by its own logits. (Which of several tied logits top-p
    drops depends on the order the path lists them in; a path chosen for the whole batch made a seeded
    sample depend on what shared its step, so a preemption, which changes the batches, changed samples.)
    Within a group with a small ``top_k`` (the usual 20..100 of a 50k vocabulary), one ``topk`` replaces
    the full sort and top-p runs on those few columns; a row whose tie at the k-th value reaches past
    ``top_k`` columns, and every row of a larger ``top_k``, is sorted in full.
    """
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    groups: dict[tuple[int, bool], list[int]] = {}
    for row, (k, p) in enumerate(zip(ks, top_p)):
        groups.setdefault((k, p < 1.0), []).append(row)
    if len(groups) == 1:
        (k, use_p), = groups
        return _top_k_top_p_rows(logits, k, top_p if use_p else None)
    out = torch.empty_like(logits)
    for (k, use_p), rows in groups.items():
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        out[index] = _top_k_top_p_rows(logits[index], k, [top_p[r] for r in rows] if use_p else None)
    return out


def _top_k_top_p_rows(logits: torch.Tensor, k: int, top_p: SequenceOf[float] | None) -> torch.Tensor:
    """Top-k (``k`` for every row; the vocabulary size is off) then top-p (None: off) on rows of one group."""
    vocab = logits.shape[-1]
    if k == vocab and top_p is None:
        return logits
    limit = None if top_p is None else torch.tensor([1.0 - p for p in top_p], dtype=logits.dtype,
                                                    device=logits.device).unsqueeze(1)
    if k > vocab // 8:
        return _sorted_top_k_top_p(logits, k, limit)
    values, ids = logits.topk(k, dim=-1)  # descending
    keep = logits >= values[:, -1:]  # transformers' rule: a tie with the k-th value stays
    if limit is None:
        return logits.masked_fill(~keep, NEG_INF)
    tie_past = keep.sum(dim=-1) > k  # this row's kept set is more than values' prefix: sort it in full
    if not bool(tie_past.any()):
        return _scatter_top_p(torch.full_like(logits, NEG_INF), ids.flip(1), values.flip(1), limit)
    out = torch.full_like(logits, NEG_INF)
    out[tie_past] = _sorted_top_k_top_p(logits[tie_past], k, limit[tie_past])
    prefix = ~tie_past
    if bool(prefix.any()):
        out[prefix] = _scatter_top_p(torch.full_like(logits[prefix], NEG_INF), ids[prefix].flip(1),
                                     values[prefix].flip(1), limit[prefix])
    return out


def _sorted_top_k_top_p(logits: torch.Tensor, k: int, limit: torch.Tensor | None) -> torch.Tensor:
    """Top-k then top-p (``limit`` = 1 - p per row; None: off) over one full sort of each row."""
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)
    if k < vocab:
        kth = ascending[:, vocab - k : vocab - k + 1]
        ascending = ascending.masked_fill(ascending < kth, NEG_INF)
    return _scatter_top_p(torch.empty_like(logits), order, ascending, limit) if limit is not None else (
        torch.empty_like(logits).scatter_(1, order, ascending)
    )


def _scatter_top_p(
    out: torch.Tensor, order: torch.Tensor, ascending: torch.Tensor, limit: torch.Tensor
) -> torch.Tensor:
    """Top-p on ascending logits (transformers' rule: drop while the mass up to here is <= 1 - p; 1 - p in
    double, then float32, as it compares), written back to ``out`` at ``order``."""
    cumulative = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
    drop = cumulative <= limit
    drop[:, -1] = False  # the most likely token always stays
    return out.scatter_(1, order, ascending.masked_fill(drop, NEG_INF))
