"""Chat messages -> the prompt text of ``POST /v1/chat/completions``.

The target tokenizer's own chat template is used when it has one. A tokenizer without
one (the tiny and reference code models) gets :data:`PLAIN_CHAT_TEMPLATE`: each message
as ``<|role|>`` on its own line followed by its content, then ``<|assistant|>`` and a
newline for the reply, e.g.::

    <|system|>
    You write Python.
    <|user|>
    A function that adds two numbers.
    <|assistant|>
"""

from __future__ import annotations

PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """The prompt text of ``messages`` (``{"role", "content"}`` dicts)."""
    template = None if getattr(tokenizer, "chat_template", None) else PLAIN_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=True)
