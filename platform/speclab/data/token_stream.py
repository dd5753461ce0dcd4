"""The tokenised training corpus the target's signals are cut from.

A :class:`TokenStream` is a sequence of token shards (global positions, shard after
shard). For plain text (stdlib, folders, JSONL text: one shard in memory, the text capped
by ``corpus.max_chars``) every position may start a window. For conversations (``corpus.source:
conversations``) it also carries, per token, the conversation it belongs to
(``segment``) and whether it belongs to an assistant turn (``mask``), so that

* a window or prompt never mixes two conversations (it lies inside one segment);
* every input ends on an assistant token (a window holds something to learn; a prompt
  continues an answer);
* each row's loss covers the assistant tokens only (:meth:`TokenStream.masks`).

:func:`token_stream` builds one from a ``corpus`` config group and the target's
tokenizer; conversations are read as a stream, rendered with the chat template
(:func:`speclab.data.conversations.render`) one by one, split by conversation, capped by
``corpus.max_conversations`` (None: all of them), and written once as token shards that
later runs memory-map (:mod:`speclab.data.token_shards`): the corpus is never held whole
in memory, and a job run again reuses the shards.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speclab.data.token_shards import (
    MANIFEST,
    Shard,
    open_shards,
    shard_dir,
    source_stamp,
    write_shards,
)


@dataclass
class TokenStream:
    """The corpus as a sequence of shards (:class:`~speclab.data.token_shards.Shard`:
    ``tokens``, and for conversations ``mask`` (1 on assistant tokens) and ``segment``
    (the conversation's index)), memory-mapped from disk for conversations, one shard in
    memory for plain text; positions are global (shard after shard). ``stats``: what
    reading found."""

    shards: list[Shard]
    stats: dict = field(default_factory=dict)
    _first: list[int] = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, tokens: TokenStream | torch.Tensor) -> TokenStream:
        """``tokens`` as a stream (a 1-D tensor: plain text)."""
        if isinstance(tokens, TokenStream):
            return tokens
        return cls([Shard(tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens)])

    def numel(self) -> int:
        """Tokens in the stream."""
        return sum(len(s) for s in self.shards)

    @property
    def segmented(self) -> bool:
        """Conversations (inputs stay inside one and end on an assistant token)."""
        return self.shards[0].segment is not None

    def _whole(self, part: str) -> torch.Tensor | None:
        arrays = [getattr(s, part) for s in self.shards]
        if arrays[0] is None:
            return None
        return torch.from_numpy(np.concatenate(arrays).astype(np.int64))

    @property
    def tokens(self) -> torch.Tensor:
        """``[N]`` the whole stream in memory (small corpora and tests; the sampler never
        calls it)."""
        return self._whole("tokens")

    @property
    def mask(self) -> torch.Tensor | None:
        """``[N]`` the whole loss mask in memory (see :attr:`tokens`); None: plain text."""
        return self._whole("mask")

    @property
    def segment(self) -> torch.Tensor | None:
        """``[N]`` every token's conversation, in memory (see :attr:`tokens`)."""
        return self._whole("segment")

    def _eligible(self, i: int, length: int) -> np.ndarray:
        """Shard ``i``'s local offsets of inputs of ``length`` tokens inside one
        conversation, ending on an assistant token (as over the whole stream: an input
        ends before the stream's last token)."""
        s = self.shards[i]
        m = len(s) - length + (0 if i == len(self.shards) - 1 else 1)
        if m <= 0:
            return np.zeros(0, dtype=np.int64)
        last = slice(length - 1, length - 1 + m)
        return np.flatnonzero((s.segment[:m] == s.segment[last]) & (s.mask[last] > 0))

    def starts(self, count: int, length: int, generator: torch.Generator) -> list[int]:
        """``count`` start offsets of inputs of ``length`` tokens, drawn with
        ``generator``: uniform over the stream for plain text (the draw every plan made
        before conversations existed, so those plans still match); for conversations
        uniform over the offsets whose input lies inside one conversation and ends on an
        assistant token (ValueError when none does). Shard by shard: two passes over
        the memory-mapped shards, one shard's offsets in memory at a time."""
        n = self.numel()
        if n <= length + 1:
            raise ValueError(f"corpus: too little text for inputs of {length} tokens")
        if not self.segmented:
            return torch.randint(0, n - length - 1, (count,), generator=generator).tolist()
        counts = [len(self._eligible(i, length)) for i in range(len(self.shards))]
        total = sum(counts)
        if total == 0:
            raise ValueError(f"corpus: no conversation holds an input of {length} tokens "
                             "ending in an assistant turn; use shorter inputs "
                             "(distill.seq_len / prompt_len) or longer conversations")
        picks = torch.randint(0, total, (count,), generator=generator).numpy()
        out = np.zeros(count, dtype=np.int64)
        first = base = 0
        for i, c in enumerate(counts):
            here = np.flatnonzero((picks >= first) & (picks < first + c))
            if here.size:
                out[here] = base + self._eligible(i, length)[picks[here] - first]
            first += c
            base += len(self.shards[i])
        return out.tolist()

    def _slice(self, part: str, start: int, length: int) -> list[int]:
        """Positions ``[start, start + length)`` of ``part`` (across shards if need be)."""
        bounds = self._bounds()
        i = bisect.bisect_right(bounds, start) - 1
        out: list[int] = []
        while length > 0 and i < len(self.shards):
            a = start - bounds[i]
            take = getattr(self.shards[i], part)[a: a + length].tolist()
            out += take
            start, length, i = start + len(take), length - len(take), i + 1
        return out

    def _bounds(self) -> list[int]:
        """Each shard's first global position."""
        if len(self._first) != len(self.shards):
            self._first = list(itertools.accumulate((len(s) for s in self.shards[:-1]),
                                                    initial=0))
        return self._first

    def inputs(self, starts: list[int], length: int) -> list[list[int]]:
        """The token ids of each input ``[start, start + length)``."""
        return [self._slice("tokens", x, length) for x in starts]

    def masks(self, starts: list[int], length: int) -> list[list[int]] | None:
        """The loss mask of each input (1 on assistant tokens); None for plain text."""
        if not self.segmented:
            return None
        return [self._slice("mask", x, length) for x in starts]


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
        return TokenStream.of(torch.tensor(tokenizer.encode(text), dtype=torch.long))
    from speclab.data.conversations import (
        ReadStats,
        read_conversations,
        render,
        sharegpt_file,
        split_of,
    )

    template = chat_template_of(corpus)
    source = sharegpt_file() if str(corpus.path) == "sharegpt" else Path(corpus.path).expanduser()
    if not source.exists():
        raise ValueError(f"corpus.path: {str(source)!r} does not exist")
    settings = {"path": str(source.resolve()), "stamp": source_stamp(source),
                "format": corpus.format, "strict": corpus.strict, "template": template,
                "max_conversations": corpus.max_conversations, "split": split,
                "shard_tokens": corpus.shard_tokens,
                "validation": corpus.validation, "test": corpus.test}
    folder = shard_dir(settings, tokenizer)
    reused = (folder / MANIFEST).exists()
    if not reused:
        stats = ReadStats()
        cap = corpus.max_conversations

        def records():
            kept = 0
            for conv in read_conversations(source, corpus.format, corpus.strict, stats):
                if split_of(conv.id, corpus.validation, corpus.test) != split:
                    continue
                yield render(tokenizer, conv, template)
                kept += 1
                if cap is not None and kept >= cap:
                    break

        def read() -> dict:
            return {"conversations_read": stats.conversations, "malformed": stats.malformed,
                    "no_assistant": stats.no_assistant, "truncated": stats.truncated,
                    "read": stats.summary(), "settings": settings}

        manifest = write_shards(records(), folder, corpus.shard_tokens, read,
                                lambda line: print(line, flush=True))
        if not manifest["conversations_used"]:
            raise ValueError(f"corpus.path: {corpus.path!r} holds no {split} conversation "
                             f"with an assistant turn ({manifest['read']})")
    shards, manifest = open_shards(folder)
    summary = {k: manifest[k] for k in ("conversations_read", "conversations_used",
                                        "malformed", "no_assistant", "truncated", "tokens",
                                        "assistant_tokens")}
    print(f"[corpus] {corpus.path}: {manifest['read']}; {manifest['conversations_used']} "
          f"{split} conversations used, {manifest['tokens']} tokens "
          f"({manifest['assistant_tokens']} assistant) in {len(shards)} shard(s) at {folder}"
          + (" (tokenised before: reused)" if reused else
             f", tokenised in {manifest['seconds']:.1f}s"), flush=True)
    return TokenStream(shards, {**summary, "shards": len(shards), "cache": str(folder)})
