"""A recommendation dataset as token sequences: "history -> next item id" (AtSpeed).

Vocabulary: ``<pad>`` 0, ``<bos>`` 1, ``<sep>`` 2, ``<eos>`` 3, then one token per (level,
code) of the semantic ids: level ``l`` code ``c`` is token ``4 + l * codebook + c``.
A prompt is ``<bos> id(h_1) ... id(h_n) <sep>`` (the last ``history`` items) and the
answer is the ``levels`` tokens of the next item. ``RecMeta`` (saved as
``rec_meta.json`` next to a model) maps dataset item ids to token ids and back, and
builds the item trie for constrained decoding.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from speclab.data import recsys
from speclab.data.recsys import Interaction, chronological_split, id_tokens
from speclab.decoding.trie import ItemTrie

SPECIALS = ["<pad>", "<bos>", "<sep>", "<eos>"]
PAD, BOS, SEP, EOS = range(4)


@dataclass
class RecMeta:
    """Items, their semantic ids and the vocabulary layout."""

    items: list[int]  # dataset item id of each item index
    codes: list[list[int]]  # semantic id (levels codes) of each item index
    levels: int
    codebook: int
    history: int

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + self.levels * self.codebook

    def tokens_of(self, index: int) -> list[int]:
        return list(id_tokens([tuple(self.codes[index])], len(SPECIALS), self.codebook)[0])

    def trie(self) -> ItemTrie:
        seqs = id_tokens([tuple(c) for c in self.codes], len(SPECIALS), self.codebook)
        return ItemTrie(seqs, items=self.items)

    def prompt(self, history_items: list[int]) -> list[int]:
        """Token prompt for dataset item ids (most recent last); unknown ids are errors."""
        if not history_items:
            raise ValueError("history: must contain at least one item")
        index = {item: i for i, item in enumerate(self.items)}
        unknown = [h for h in history_items if h not in index]
        if unknown:
            raise ValueError(f"history: unknown item id(s) {unknown[:5]}")
        out = [BOS]
        for h in history_items[-self.history:]:
            out += self.tokens_of(index[h])
        return out + [SEP]

    def save(self, folder: str | Path) -> None:
        Path(folder, "rec_meta.json").write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, folder: str | Path) -> RecMeta:
        path = Path(folder, "rec_meta.json")
        if not path.exists():
            raise ValueError(f"target: {folder} has no rec_meta.json (not a recommender)")
        return cls(**json.loads(path.read_text()))

    def check_model(self, vocab_size: int) -> None:
        """Semantic-id length / vocabulary must match the model's."""
        if vocab_size != self.vocab_size:
            raise ValueError(f"model: vocab_size {vocab_size} does not match the item ids "
                             f"({self.levels} levels x {self.codebook} codes + "
                             f"{len(SPECIALS)} specials = {self.vocab_size})")


def save_rec_tokenizer(meta: RecMeta, folder: str | Path):
    """A word-level HF tokenizer over the special and id tokens (``<l0_c5>`` ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for level in range(meta.levels):
        for code in range(meta.codebook):
            vocab[f"<l{level}_c{code}>"] = len(SPECIALS) + level * meta.codebook + code
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                 eos_token="<eos>", sep_token="<sep>")
    hf.save_pretrained(str(folder))
    return hf


@dataclass
class RecExample:
    """One "history -> next item" example: prompt tokens and the answer's item index."""

    user: int
    prompt: list[int]
    target: int


def build_examples(events: list[Interaction], meta: RecMeta, min_history: int = 1):
    """Train / validation / test examples from a chronological 8:1:1 split of ``events``.

    Every event is the answer to one example whose history is the user's earlier events
    (from any split); its split is the event's. Items not in ``meta`` are skipped.
    """
    index = {item: i for i, item in enumerate(meta.items)}
    train, val, test = chronological_split(events)
    split_of = {id(e): name for name, part in (("train", train), ("validation", val),
                                               ("test", test)) for e in part}
    by_user: dict[int, list[Interaction]] = {}
    for e in sorted(events, key=lambda e: (e.user, e.timestamp)):
        by_user.setdefault(e.user, []).append(e)
    out: dict[str, list[RecExample]] = {"train": [], "validation": [], "test": []}
    for user, seq in by_user.items():
        for t in range(min_history, len(seq)):
            if seq[t].item not in index:
                continue
            hist = [e.item for e in seq[:t] if e.item in index]
            if not hist:
                continue
            out[split_of[id(seq[t])]].append(
                RecExample(user, meta.prompt(hist), index[seq[t].item]))
    return out


def collate_rec(examples: list[RecExample], meta: RecMeta) -> dict[str, torch.Tensor]:
    """Right-padded ``inputs``/``labels`` ``[B, S]`` and ``mask`` on the answer tokens."""
    seqs = [ex.prompt + meta.tokens_of(ex.target) for ex in examples]
    length = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(seqs), length), PAD, dtype=torch.long)
    labels = torch.full((len(seqs), length), PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), length)
    for b, (s, ex) in enumerate(zip(seqs, examples)):
        t = torch.tensor(s)
        inputs[b, : len(s) - 1], labels[b, : len(s) - 1] = t[:-1], t[1:]
        mask[b, len(ex.prompt) - 1 : len(s) - 1] = 1.0  # positions predicting the item id
    return {"inputs": inputs, "labels": labels, "mask": mask}


def prepare_rec_data(source: str, path: str | None, users: int, items: int, dim: int,
                     levels: int, codebook: int, history: int, seed: int = 0):
    """Interactions -> semantic ids -> (RecMeta, examples per split) for a ``rec`` group."""
    if source == "synthetic":
        spec = recsys.SyntheticSpec(users=users, items=items, dim=dim, seed=seed)
        events, feats = recsys.synthetic_interactions(spec)
        item_ids = list(range(items))
    else:
        if not Path(path).is_file():
            raise ValueError(f"rec.path: file {path!r} does not exist")
        loader = recsys.load_amazon_jsonl if source == "amazon" else recsys.load_movielens
        events = loader(path)
        if not events:
            raise ValueError(f"rec.path: {path} holds no interactions")
        item_ids, feats = recsys.interaction_features(events, dim)
    codes = recsys.semantic_ids(feats, levels, codebook, seed=seed)
    meta = RecMeta(item_ids, [list(c) for c in codes], levels, codebook, history)
    return meta, build_examples(events, meta)
