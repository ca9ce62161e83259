"""Incremental detokenization: new text only, never a broken character, no whole-output re-decode."""

from __future__ import annotations

import pytest

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.sample.detokenizer import IncrementalDetokenizer
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.serve.testing import byte_level_tokenizer
from pagedkv.testing import tiny_llama

TEXT = "안녕하세요, 세계! Hello world. 서울은 한국의 수도입니다 🙂 done"


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


class CountingTokenizer:
    """Wraps a tokenizer and counts how many token ids every decode call reads."""

    def __init__(self, inner):
        self.inner = inner
        self.decoded_ids = 0

    def decode(self, ids, **kwargs):
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, **kwargs)


def stream_chunks(tokenizer, ids):
    detok = IncrementalDetokenizer(tokenizer)
    chunks = [detok.push([token]) for token in ids]
    chunks.append(detok.push([], final=True))
    return detok, chunks


def test_korean_split_over_byte_tokens_never_ends_a_chunk_with_a_broken_character(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the fixture must split characters into bytes"
    detok, chunks = stream_chunks(tokenizer, ids)
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "".join(chunks) == TEXT == detok.text
    assert chunks.count("") >= 2 * len("안녕하세요")  # the first two bytes of each character are held


def test_each_character_goes_out_as_soon_as_its_last_byte_arrives(tokenizer):
    ids = tokenizer("한국")["input_ids"]
    assert len(ids) == 6
    _, chunks = stream_chunks(tokenizer, ids)
    assert chunks == ["", "", "한", "", "", "국", ""]


def test_incremental_text_matches_a_full_decode_of_smollm2_tokens(smollm2_dir):
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "The answer in Korean: 안녕하세요! And in Japanese: こんにちは. Emoji: 🙂🚀 end."
    ids = real(text)["input_ids"]
    _, chunks = stream_chunks(real, ids)
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "".join(chunks) == real.decode(ids, skip_special_tokens=True)


def test_work_per_token_is_bounded_not_proportional_to_the_output(tokenizer):
    ids = tokenizer(TEXT * 20)["input_ids"]
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    for token in ids:
        detok.update(detok.token_ids + [token])
    assert detok.text == TEXT * 20
    assert counting.decoded_ids < 12 * len(ids)  # a full re-decode per token would read ~len(ids)**2 / 2


def test_special_tokens_are_skipped_and_a_cut_character_is_dropped_at_the_end(tokenizer):
    ids = [tokenizer.convert_tokens_to_ids("<|im_start|>"), *tokenizer("ok")["input_ids"]]
    _, chunks = stream_chunks(tokenizer, ids)
    assert "".join(chunks) == "ok"
    lone_byte = tokenizer("한")["input_ids"][:1]  # a character's first byte and nothing after it
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(tokenizer("ok")["input_ids"]) == "ok"
    assert detok.push(lone_byte) == ""
    assert detok.push([], final=True) == ""  # cut by max_tokens mid-character: its bytes never show (vLLM)
    assert detok.text == "ok"
    detok = IncrementalDetokenizer(tokenizer)  # an invalid byte with text after it shows as a full decode shows it
    detok.push(lone_byte + tokenizer("ok")["input_ids"])
    assert detok.push([], final=True) == "" and detok.text == tokenizer.decode(lone_byte + tokenizer("ok")["input_ids"])


def test_engine_streams_only_complete_characters_and_ends_with_the_full_decode(tokenizer):
    engine = Engine(
        EngineConfig(device="cpu", num_blocks=64),
        model=tiny_llama(vocab_size=len(tokenizer)), tokenizer=tokenizer,
    )
    prompt = tokenizer("안녕하세요")["input_ids"]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=3))
    texts, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            texts.append(out.text)
            final = out
    assert final is not None and final.request_id == rid and final.finished
    assert not any(text.endswith("\ufffd") for text in texts[:-1])
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before)  # the text only grows: a chunk is the difference
    assert final.text == tokenizer.decode(final.token_ids, skip_special_tokens=True)
