"""The target's log-probs (:mod:`speclab.decoding.logprobs` entries) in OpenAI's shapes.

* completions (``logprobs: n``, optionally ``echo``): ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``; ``top_logprobs[i]`` maps the ``n`` best tokens and
  the chosen one to their log-probs (so up to ``n + 1`` entries, as OpenAI defines it);
  an echoed prompt's first token has ``None`` for both (nothing predicts it);
  ``text_offset`` counts characters from the start of the returned text.
* chat (``logprobs: true``, ``top_logprobs: n``): ``{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``.

A token's string is its own decoded text (``tokenizer.decode([id])``); nothing here
knows about HTTP.
"""

from __future__ import annotations

from collections.abc import Callable

Detok = Callable[[int], str]


def completion_logprobs(entries: list, detok: Detok, offset: int = 0) -> dict:
    """``entries`` (``[token, logprob, [[id, logprob], ...]]`` or None for an echoed
    prompt's first token) as a completions ``logprobs`` object whose ``text_offset``
    starts at ``offset``."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        if entry is None:  # the prompt's first token: its text, no log-prob
            continue
        token, logprob, top = entry
        text = detok(token)
        top_map = {detok(i): lp for i, lp in top}
        top_map.setdefault(text, logprob)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top_map)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def echoed_prompt_logprobs(prompt_ids: list[int], entries: list, detok: Detok) -> dict:
    """An echoed prompt's completions ``logprobs`` (``entries[0]`` is None: its first
    token is listed with ``None`` log-prob and top)."""
    first = detok(prompt_ids[0])
    rest = completion_logprobs(entries[1:], detok, len(first))
    return {"tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]]}


def join_completion_logprobs(a: dict, b: dict) -> dict:
    """Two completions ``logprobs`` objects one after the other (``b``'s offsets already
    continue ``a``'s)."""
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(entries: list, detok: Detok) -> dict:
    """``entries`` as a chat ``logprobs`` object (``{"content": [...]}``)."""

    def item(token: int, logprob: float) -> dict:
        text = detok(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(token, logprob),
                         "top_logprobs": [item(i, lp) for i, lp in top]}
                        for token, logprob, top in entries]}
