"""Prompt sets for evaluation: stdlib function headers or a user JSONL file.

JSONL: one object per line with a ``prompt`` field (``response`` is optional and ignored
here). Bad lines are reported with their line number.
"""

from __future__ import annotations

from pathlib import Path

from speclab.data.corpus import function_header_prompts
from speclab.data.jsonl import json_lines


def jsonl_records(path: str | Path, limit: int | None = None) -> list[tuple[str, str]]:
    """``(category, prompt)`` of a prompt JSONL file (field ``prompt``; ``category``
    optional, ``all`` when absent)."""
    out = []
    for i, obj in json_lines(path):
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise ValueError(f"data.path: {path}:{i} needs a non-empty string field 'prompt'")
        out.append((str(obj.get("category") or "all"), obj["prompt"]))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"data.path: {path} holds no prompts")
    return out


def first_turn_records(path: str | Path, limit: int | None = None,
                       field: str = "data.path") -> list[tuple[str, str]]:
    """``(category, prompt)`` of a prompt file whose lines are either prompt JSONL
    (``prompt``) or MT-bench / Spec-Bench ``question.jsonl`` (``turns``: its first turn),
    grouped by category (in the order the categories first appear; a line's
    ``category`` optional, ``all`` when absent). A line with neither field: ValueError
    naming ``field``, the file and the line."""
    out: dict[str, list[str]] = {}
    n = 0
    for i, obj in json_lines(path):
        turns = obj.get("turns") if isinstance(obj, dict) else None
        text = obj.get("prompt") if isinstance(obj, dict) else None
        if text is None and isinstance(turns, list) and turns:
            text = turns[0]
        if not isinstance(text, str) or not text:
            raise ValueError(f"{field}: {path}:{i} needs a non-empty 'prompt' text or "
                             "'turns' list of texts")
        out.setdefault(str(obj.get("category") or "all"), []).append(text)
        n += 1
        if limit is not None and n >= limit:
            break
    if not n:
        raise ValueError(f"{field}: {path} holds no prompts")
    return [(cat, t) for cat, texts in out.items() for t in texts]


def load_jsonl_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from a JSONL file (field ``prompt``)."""
    return [prompt for _, prompt in jsonl_records(path, limit)]


def load_prompts(kind: str, num_prompts: int, context_chars: int = 300, path: str | None = None,
                 seed: int = 0) -> list[str]:
    """Prompt texts for a ``data`` config group."""
    if kind == "jsonl":
        return load_jsonl_prompts(path, num_prompts)
    return [p.text for p in function_header_prompts("test", num_prompts, context_chars, seed)]


def held_out_prompts(kind: str, num_prompts: int, skip: int, context_chars: int = 300,
                     path: str | None = None, seed: int = 0) -> list[str]:
    """Up to ``num_prompts`` prompts of ``kind`` from the evaluation's own prompt sequence
    that an evaluation of its first ``skip`` prompts never sees: the JSONL file's prompts
    after its first ``skip``; for stdlib function headers the LAST ``num_prompts`` of the
    test split's sequence (the one :func:`load_prompts` reads from its start; at most two
    prompts per file, so other files than the evaluation's), never before index ``skip``.
    The tail, so that an evaluation of more prompts (the bench's 16) does not meet them
    either. The evaluation's split, not the validation split it once was: one set of
    prompts predicts another only up to their sampling spread, and the validation
    split's first 64 headers happened to be easy ones (Medusa heads: chain tau 2.41 on
    them, 2.22 on the next 64, 2.20 on 83 test prompts; closing note of stop 50). May be
    empty."""
    if kind == "jsonl":
        return load_jsonl_prompts(path)[skip: skip + num_prompts]
    every = function_header_prompts("test", 10**9, context_chars, seed)
    return [p.text for p in every[max(skip, len(every) - num_prompts):]]


#: the prompt kinds rendered with the chat template (``jsonl`` too with ``data.chat``)
CHAT_KINDS = ("conversations", "questions")


class Prompts(list):
    """Token-id prompts (a list of id lists, usable wherever one is) with a category
    each: ``categories[i]`` names prompt ``i``'s category (``all`` for a set without
    categories)."""

    def __init__(self, ids: list[list[int]], categories: list[str] | None = None) -> None:
        super().__init__(ids)
        self.categories = list(categories) if categories else ["all"] * len(ids)
        if len(self.categories) != len(ids):
            raise ValueError(f"{len(ids)} prompts but {len(self.categories)} categories")


def is_chat(data) -> bool:
    """Whether a ``data`` group's prompts go through the chat template."""
    return data.prompts in CHAT_KINDS or (data.prompts == "jsonl" and data.chat)


def _question_records(path: str, limit: int) -> list[tuple[str, list[str]]]:
    """(category, user turns) of an MT-bench / Spec-Bench ``question.jsonl``."""
    out = []
    for i, obj in json_lines(path):
        turns = obj.get("turns") if isinstance(obj, dict) else None
        if not isinstance(turns, list) or not turns or not all(
                isinstance(t, str) and t for t in turns):
            raise ValueError(f"data.path: {path}:{i} needs 'turns', a non-empty list of texts "
                             "(MT-bench / Spec-Bench question.jsonl)")
        out.append((str(obj.get("category") or "all"), turns))
        if len(out) >= limit:
            break
    if not out:
        raise ValueError(f"data.path: {path} holds no questions")
    return out


def _conversation_records(path: str, limit: int) -> list[tuple[str, list[dict]]]:
    """(category, messages up to the second user turn) of held-out conversations: the
    ``test`` split (:func:`speclab.data.conversations.split_of`, the corpus's default
    fractions), so a drafter trained on the ``train`` split never saw them."""
    from speclab.data.conversations import read_conversations, split_of

    out = []
    for conv in read_conversations(path):
        if split_of(conv.id) != "test":
            continue
        msgs = [m for m in conv.messages if m["role"] != "assistant"]
        if any(m["role"] == "user" for m in msgs):
            out.append(("conversations", msgs))
        if len(out) >= limit:
            break
    if not out:
        raise ValueError(f"data.path: {path!r} holds no held-out (test split) conversation")
    return out


def chat_prompts(data, tokenizer, answer=None) -> Prompts:
    """The ``data`` group's chat prompts as token ids through the chat template
    (``data.chat_template``, else the tokenizer's; neither: ValueError naming
    ``data.chat_template``), with their categories. ``data.turns`` 2 adds each second
    user turn after the target's own answer to the first: ``answer(ids) -> text``
    (greedy decoding by the caller's target)."""
    from speclab.data.conversations import template_ids
    from speclab.data.token_stream import chat_template_of

    template = chat_template_of(data)
    if not template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("data.chat_template: the target's tokenizer has no chat template; "
                         "give one")

    if data.prompts == "questions":
        records = [(c, [{"role": "user", "content": t} for t in turns])
                   for c, turns in _question_records(data.path, data.num_prompts)]
    elif data.prompts == "conversations":
        records = _conversation_records(data.path, data.num_prompts)
    else:  # jsonl through the chat template
        records = [(c, [{"role": "user", "content": t}])
                   for c, t in jsonl_records(data.path, data.num_prompts)]
    ids, cats = [], []
    for cat, msgs in records:
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        first = msgs[: users[0] + 1]
        ids.append(template_ids(tokenizer, first, template))
        cats.append(cat)
        if data.turns == 2 and len(users) > 1:
            if answer is None:
                raise ValueError("data.turns: 2 needs the target to answer the first turns")
            second = first + [{"role": "assistant", "content": answer(ids[-1])},
                              *msgs[users[0] + 1: users[1] + 1]]
            ids.append(template_ids(tokenizer, second, template))
            cats.append(cat)
    return Prompts(ids, cats)
