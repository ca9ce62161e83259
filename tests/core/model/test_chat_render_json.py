"""``render_json_chat``: what transformers' apply_chat_template(tokenize=False) renders, bounded in length.

It renders clients' chat templates in the server's sandbox, so it must cover what ``render_chat`` leaves to
transformers (documents, continue_final_message, ``{% generation %}`` blocks) with transformers' exact text.
"""

from __future__ import annotations

import pytest

from pagedkv.core.model.chat_render import RenderTooLong, render_json_chat
from pagedkv.serve.testing import byte_level_tokenizer

TEMPLATE = (
    "{{ bos_token }}{% if documents %}DOCS:{% for d in documents %}[{{ d.title }}|{{ d.text }}]{% endfor %}\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}\n  {%- generation -%}\n"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endgeneration %}\n{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if tools %}TOOLS {{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ extra | default('') }}"
)
CHAT = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Hello, I am  "}]
CASES = {
    "generation_prompt": {"add_generation_prompt": True},
    "continue_final_message": {"continue_final_message": True},
    "documents_and_variables": {"documents": [{"title": "a", "text": "b"}], "add_generation_prompt": True,
                                "extra": "E"},
    "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
}


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def ours(tokenizer, template, conversation, max_chars=10**6, **arguments):
    tools, documents = arguments.pop("tools", None), arguments.pop("documents", None)
    prompt, resume = arguments.pop("add_generation_prompt", False), arguments.pop("continue_final_message", False)
    return render_json_chat(template, conversation, tools, documents, prompt, resume,
                            {**tokenizer.special_tokens_map, **arguments}, max_chars)


@pytest.mark.parametrize("case", CASES)
def test_same_text_as_transformers(tokenizer, case):
    theirs = tokenizer.apply_chat_template(CHAT, chat_template=TEMPLATE, tokenize=False, **CASES[case])
    assert ours(tokenizer, TEMPLATE, CHAT, **CASES[case]) == theirs


def test_what_transformers_refuses_is_refused(tokenizer):
    with pytest.raises(ValueError, match="not compatible"):
        ours(tokenizer, TEMPLATE, CHAT, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="does not appear"):
        ours(tokenizer, "{% for m in messages %}{{ m.role }}{% endfor %}{{ messages[0].content }}", CHAT,
             continue_final_message=True)


def test_a_long_loop_stops_at_max_chars():
    with pytest.raises(RenderTooLong) as caught:
        render_json_chat("{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}",
                         CHAT, None, None, False, False, {}, max_chars=1000)
    assert caught.value.chars == 1001
