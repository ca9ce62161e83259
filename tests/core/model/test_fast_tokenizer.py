"""pagedkv's tokenizer on ``tokenizers`` + ``jinja2`` against transformers': the same ids, decoded strings and
chat renderings, for SmolLM2's tokenizer and the byte-level test tokenizers; transformers only when needed."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from pagedkv.core.model.fast_tokenizer import FastTokenizer, fast_tokenizer_problem
from pagedkv.testing import BYTE_CHAT_TEMPLATE

TEXTS = ["", "hi", " hello  world ", "The capital of France is", "naïve café — 東京 🎉 안녕하세요",
         "<|im_start|>user\nhi<|im_end|>", "line\n\n\ttab", "  ", "<|endoftext|> end", "a" * 300]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in <city> & \"quotes\", café 東京",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "naïve 東京 🎉 <|im_end|>"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "call it"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny", "tool_call_id": "c1"}],
    [{"role": "user", "content": "think"}, {"role": "assistant", "content": "ok", "reasoning": "because"}],
]


def outcome(fn, *args, **kwargs):
    """What a call gives: its result, or its error's type and message (a template may fail on a chat)."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - compared, not handled
        return "error", type(exc).__name__, str(exc)


def assert_same(ours, theirs, extra_ids=()):
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.special_tokens_map == theirs.special_tokens_map
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == theirs(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
            assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    ids = list(extra_ids) + list(range(0, len(theirs), max(1, len(theirs) // 97)))
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == theirs.convert_ids_to_tokens(
            ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids[-1]) == theirs.convert_ids_to_tokens(ids[-1])
    for chat in CHATS:
        for tools in (None, TOOLS):
            for gen in (True, False):
                for kwargs in ({}, {"enable_thinking": False}):
                    args = dict(tools=tools, add_generation_prompt=gen, tokenize=False, **kwargs)
                    want = outcome(theirs.apply_chat_template, copy.deepcopy(chat), **args)
                    assert outcome(ours.apply_chat_template, copy.deepcopy(chat), **args) == want, (chat, tools, gen)


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_dir):
    from transformers import AutoTokenizer

    assert fast_tokenizer_problem(smollm2_dir) is None
    return FastTokenizer(smollm2_dir), AutoTokenizer.from_pretrained(smollm2_dir)


def test_smollm2_same_as_transformers(smollm2_pair):
    ours, theirs = smollm2_pair
    assert_same(ours, theirs, extra_ids=[1, 2, 0, 5, 1])
    assert ours.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True) == \
        theirs.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True)


@pytest.mark.parametrize("template", ["serve", "byte"])
def test_byte_level_tokenizers_same_as_transformers(tmp_path, template):
    from transformers import AutoTokenizer

    from pagedkv.serve.testing import byte_level_tokenizer
    from pagedkv.testing import byte_tokenizer

    source = byte_level_tokenizer() if template == "serve" else byte_tokenizer()
    source.save_pretrained(tmp_path)
    assert fast_tokenizer_problem(tmp_path) is None
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    ours = FastTokenizer(tmp_path)
    assert ours.chat_template == theirs.chat_template == source.chat_template
    assert_same(ours, theirs, extra_ids=[len(theirs) - 1, 3])


def test_chat_template_settable_and_copies(tmp_path):
    from pagedkv.testing import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    ours = FastTokenizer(tmp_path)
    ours.chat_template = "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
    copied = copy.deepcopy(ours)
    copied.chat_template = BYTE_CHAT_TEMPLATE
    assert ours.apply_chat_template(CHATS[1], tokenize=False) == "[You are terse.][Name a colour.]"
    assert copied.apply_chat_template(CHATS[0], tokenize=False) == "<|user|>hi"  # trim_blocks ate the newline
    with pytest.raises(Exception, match="nope"):
        ours.apply_chat_template(CHATS[0], tokenize=False, chat_template="{{ raise_exception('nope') }}")


def test_rare_paths_delegate_to_transformers(tmp_path):
    from transformers import AutoTokenizer

    from pagedkv.testing import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    ours, theirs = FastTokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    chat = CHATS[2]
    for cont in (True, False):  # False (what the server passes) is rendered natively, True by transformers
        assert ours.apply_chat_template(chat, continue_final_message=cont, tokenize=False, documents=None) == \
            theirs.apply_chat_template(chat, continue_final_message=cont, tokenize=False, documents=None)
    assert ours(["a", "b"])["input_ids"] == theirs(["a", "b"])["input_ids"]
    assert ours.convert_tokens_to_ids("a") == theirs.convert_tokens_to_ids("a")  # not native: delegated
    out = tmp_path / "saved"
    ours.save_pretrained(out)
    assert FastTokenizer(out)("hi")["input_ids"] == ours("hi")["input_ids"]


def test_unplain_tokenizer_config_goes_to_transformers(tmp_path):
    from pagedkv.testing import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert "add_bos_token" in fast_tokenizer_problem(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert "LlamaTokenizer" in fast_tokenizer_problem(tmp_path)


def test_native_paths_import_no_transformers(tmp_path):
    from pagedkv.testing import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    code = ("import sys, pathlib; from pagedkv.core.model.fast_tokenizer import FastTokenizer; "
            f"t = FastTokenizer(pathlib.Path({str(tmp_path)!r})); ids = t('héllo')['input_ids']; t.decode(ids); "
            "t.apply_chat_template([{'role': 'user', 'content': 'x'}], add_generation_prompt=True, tokenize=False, "
            "continue_final_message=False, documents=None); "
            "t.convert_ids_to_tokens(ids); t.eos_token_id; __import__('copy').deepcopy(t); "
            "print(sorted(k for k in sys.modules if k.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]"


def test_structured_outputs_on_the_native_path(tmp_path):
    pytest.importorskip("llguidance")
    from tiny_checkpoint import save_tiny

    from conftest import drain
    from pagedkv.core.config import EngineConfig
    from pagedkv.core.engine import Engine
    from pagedkv.core.sample.sampling_params import SamplingParams
    from pagedkv.core.sample.structured_output import StructuredOutputs

    engine = Engine(EngineConfig(model=str(save_tiny(tmp_path)), device="cpu", num_blocks=64, block_size=4))
    assert isinstance(engine.tokenizer, FastTokenizer)
    choices = ["yes", "no", "maybe"]
    ids = [engine.add_request("Answer: ", SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                                                         structured=StructuredOutputs(choice=choices)))
           for s in range(4)]
    outputs, _ = drain(engine)
    assert all(outputs[i].outputs[0].text in choices for i in ids)
    assert engine.pool.num_used == 0


def test_grammar_tokenizer_from_the_native_json_same_as_from_transformers(smollm2_pair):
    """llguidance's tokenizer built from FastTokenizer's JSON (no transformers) equals the one llguidance builds
    from transformers' tokenizer: the same bytes and special flag for every token, the same tokenization."""
    pytest.importorskip("llguidance")
    import llguidance
    import llguidance.hf

    from pagedkv.plugins.llguidance_backend import guidance_tokenizer

    ours, theirs = smollm2_pair
    native = guidance_tokenizer(llguidance, ours, len(theirs), None)
    reference = llguidance.hf.from_tokenizer(theirs, n_vocab=len(theirs))
    assert native.vocab_size == reference.vocab_size and native.eos_token == reference.eos_token
    ids = list(range(len(theirs)))
    assert [native.decode_bytes([i]) for i in ids] == [reference.decode_bytes([i]) for i in ids]
    assert [native.is_special_token(i) for i in ids] == [reference.is_special_token(i) for i in ids]
    for text in TEXTS:
        assert native.tokenize_str(text) == reference.tokenize_str(text), text


def test_the_grammar_backend_on_the_native_tokenizer_imports_no_transformers(tmp_path):
    """The first constrained request built llguidance's tokenizer through transformers: +120 MiB of RSS kept
    and seconds (issue 42, big-grammar's RSS)."""
    pytest.importorskip("llguidance")
    from tiny_checkpoint import save_tiny

    path = save_tiny(tmp_path)
    code = ("import sys, pathlib; from pagedkv.core.model.fast_tokenizer import FastTokenizer; "
            "from pagedkv.plugins.llguidance_backend import GuidanceBackend; "
            "from pagedkv.core.sample.structured_output import StructuredOutputs; "
            f"t = FastTokenizer(pathlib.Path({str(path)!r})); b = GuidanceBackend(t, len(t), [t.eos_token_id]); "
            "b.compile(StructuredOutputs(regex='[a-z]+')).matcher(); "
            "print(sorted(k for k in sys.modules if k.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]"
