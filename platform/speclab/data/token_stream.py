"""The tokenised training corpus the target's signals are cut from.

A :class:`TokenStream` is one long tensor of token ids. For plain text (stdlib, folders,
JSONL text) every position may start a window. For conversations (``corpus.source:
conversations``) it also carries, per token, the conversation it belongs to
(``segment``) and whether it belongs to an assistant turn (``mask``), so that

* a window or prompt never mixes two conversations (it lies inside one segment);
* every input ends on an assistant token (a window holds something to learn; a prompt
  continues an answer);
* each row's loss covers the assistant tokens only (:meth:`TokenStream.masks`).

:func:`token_stream` builds one from a ``corpus`` config group and the target's
tokenizer; conversations are rendered with the chat template
(:func:`speclab.data.conversations.render`), split by conversation, and capped by
``corpus.max_conversations``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class TokenStream:
    """``tokens [N]`` (long); for conversations ``mask [N]`` (1 on assistant tokens) and
    ``segment [N]`` (the conversation's index); ``stats``: what reading found."""

    tokens: torch.Tensor
    mask: torch.Tensor | None = None
    segment: torch.Tensor | None = None
    stats: dict = field(default_factory=dict)

    @classmethod
    def of(cls, tokens: TokenStream | torch.Tensor) -> TokenStream:
        """``tokens`` as a stream (a 1-D tensor: plain text)."""
        return tokens if isinstance(tokens, TokenStream) else cls(tokens)

    def numel(self) -> int:
        """Tokens in the stream."""
        return int(self.tokens.numel())

    def starts(self, count: int, length: int, generator: torch.Generator) -> list[int]:
        """``count`` start offsets of inputs of ``length`` tokens, drawn with
        ``generator``: uniform over the stream for plain text (the draw every plan made
        before conversations existed, so those plans still match); for conversations
        uniform over the offsets whose input lies inside one conversation and ends on an
        assistant token (ValueError when none does)."""
        n = self.numel()
        if n <= length + 1:
            raise ValueError(f"corpus: too little text for inputs of {length} tokens")
        if self.segment is None:
            return torch.randint(0, n - length - 1, (count,), generator=generator).tolist()
        s = torch.arange(n - length)
        ok = (self.segment[s] == self.segment[s + length - 1]) & (self.mask[s + length - 1] > 0)
        eligible = s[ok]
        if eligible.numel() == 0:
            raise ValueError(f"corpus: no conversation holds an input of {length} tokens "
                             "ending in an assistant turn; use shorter inputs "
                             "(distill.seq_len / prompt_len) or longer conversations")
        pick = torch.randint(0, eligible.numel(), (count,), generator=generator)
        return eligible[pick].tolist()

    def inputs(self, starts: list[int], length: int) -> list[list[int]]:
        """The token ids of each input ``[start, start + length)``."""
        return [self.tokens[x: x + length].tolist() for x in starts]

    def masks(self, starts: list[int], length: int) -> list[list[int]] | None:
        """The loss mask of each input (1 on assistant tokens); None for plain text."""
        if self.mask is None:
            return None
        return [self.mask[x: x + length].tolist() for x in starts]


def row_loss_mask(row_tokens: list[int], inputs: list[int], mask: list[int]) -> list[int]:
    """The loss mask of a row whose ``row_tokens`` began as ``inputs`` (mask ``mask``):
    the input's mask over the prefix the row keeps, 1 past it (tokens the target wrote
    itself: its own answer, all of it to be learned)."""
    same = 0
    for a, b in zip(row_tokens, inputs):
        if a != b:
            break
        same += 1
    return list(mask[:same]) + [1] * (len(row_tokens) - same)


def chat_template_of(corpus: Any) -> str | None:
    """``corpus.chat_template``: Jinja text, or the path of a file holding it (None: the
    tokenizer's own)."""
    text = corpus.chat_template
    if text and "{" not in text and Path(text).expanduser().is_file():
        return Path(text).expanduser().read_text(encoding="utf-8")
    return text


def token_stream(corpus: Any, tokenizer, split: str = "train") -> TokenStream:
    """The ``split`` of a ``corpus`` config group as a :class:`TokenStream`, tokenised
    with the target's ``tokenizer``: plain text (``train`` or ``validation``) from
    :func:`speclab.data.text.load_corpus`, or conversations rendered with the chat
    template (ValueError naming ``corpus.chat_template`` when neither the tokenizer nor
    the config has one)."""
    if corpus.source != "conversations":
        from speclab.data.text import load_corpus

        train, val = load_corpus(corpus.source, corpus.path, corpus.max_chars,
                                 corpus.val_chars, corpus.text_field)
        text = train if split == "train" else val
        return TokenStream(torch.tensor(tokenizer.encode(text), dtype=torch.long))
    from speclab.data.conversations import ReadStats, read_conversations, render, split_of

    template = chat_template_of(corpus)
    stats = ReadStats()
    ids, mask, seg, kept, t0 = [], [], [], 0, time.perf_counter()
    for conv in read_conversations(corpus.path, corpus.format, corpus.strict, stats):
        if split_of(conv.id, corpus.validation, corpus.test) != split:
            continue
        i, m = render(tokenizer, conv, template)
        ids += i
        mask += m
        seg += [kept] * len(i)
        kept += 1
        if kept >= corpus.max_conversations:
            break
    if not kept:
        raise ValueError(f"corpus.path: {corpus.path!r} holds no {split} conversation with an "
                         f"assistant turn ({stats.summary()})")
    summary = {"conversations_read": stats.conversations, "conversations_used": kept,
               "malformed": stats.malformed, "no_assistant": stats.no_assistant,
               "truncated": stats.truncated, "tokens": len(ids),
               "assistant_tokens": sum(mask)}
    print(f"[corpus] {corpus.path}: {stats.summary()}; {kept} {split} conversations used, "
          f"{len(ids)} tokens ({sum(mask)} assistant) in {time.perf_counter() - t0:.1f}s",
          flush=True)
    return TokenStream(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long),
                       torch.tensor(seg, dtype=torch.long), summary)
