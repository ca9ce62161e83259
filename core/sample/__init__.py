"""Turning logits into tokens and tokens into text.

``sampling_params`` (what a request asks for), ``sampling_batch`` (each row of one step),
``sampler`` (batched, seeded per request), ``logits_processors`` (penalties, bias, bans),
``logprobs`` and ``detokenizer`` (incremental). Imports only the foundation modules of
``pagedkv.core``: it knows nothing of the scheduler or the KV memory.
"""
