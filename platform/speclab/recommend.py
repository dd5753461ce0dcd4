"""Generative recommendation with a target recommender and (optionally) a drafter.

    from speclab.recommend import Recommender
    rec = Recommender.from_pretrained(target_dir, draft_dir)
    rec.recommend([12, 57, 301], k=10, method="sd", n=40, gamma=3, verify="strict")

``beam`` is the target's own constrained beam search (``verify="relaxed"``: its sampling
beam search); ``sd`` is beam speculative decoding with strict top-K verification
(lossless: the same K items in the same order) or relaxed sampling verification
(approximately the target's sampling beam search). Item ids are the dataset's ids.
"""

from __future__ import annotations

import time

import torch

from speclab.data.rec_dataset import RecMeta
from speclab.decoding.beam import (
    beam_speculative_sampling,
    beam_speculative_search,
    constrained_beam_search,
    sampling_beam_search,
)
from speclab.decoding.runner import ModelRunner
from speclab.models.loading import check_same_vocab, load_model, resolve_source


class Recommender:
    """A target recommender (+ drafter) and its item ids."""

    def __init__(self, target, draft, meta: RecMeta) -> None:
        meta.check_model(int(target.config.vocab_size))
        if draft is not None:
            check_same_vocab(target, draft)
        self.meta = meta
        self.trie = meta.trie()
        self.target = ModelRunner(target)
        self.draft = ModelRunner(draft) if draft is not None else None

    @classmethod
    def from_pretrained(cls, target: str, draft: str | None = None, dtype: str = "float32",
                        device: str = "cpu") -> Recommender:
        """Folders (or ``models:/`` URIs) written by ``jobs.train_recommender``."""
        target = resolve_source(target, "target")
        meta = RecMeta.load(target)
        t = load_model(target, dtype, device, field="target")
        d = load_model(resolve_source(draft, "draft"), dtype, device, field="draft") \
            if draft else None
        return cls(t, d, meta)

    def recommend(self, history: list[int], k: int = 10, method: str = "beam", n: int = 40,
                  gamma: int = 3, verify: str = "strict", seed: int = 0) -> dict:
        """Top-``k`` items for a history of dataset item ids (most recent last)."""
        if method not in ("beam", "sd"):
            raise ValueError(f"method: must be 'beam' or 'sd', got {method!r}")
        if verify not in ("strict", "relaxed"):
            raise ValueError(f"verify: must be 'strict' or 'relaxed', got {verify!r}")
        if k < 1 or k > len(self.meta.items):
            raise ValueError(f"k: must be in [1, {len(self.meta.items)}], got {k}")
        if method == "sd" and self.draft is None:
            raise ValueError("draft: method 'sd' needs a draft model")
        if method == "sd" and k > n:
            raise ValueError(f"k: must not exceed the draft beam size n={n}, got {k}")
        prompt = self.meta.prompt(history)
        g = torch.Generator().manual_seed(seed)
        t0 = time.perf_counter()
        stats = None
        if method == "beam" and verify == "strict":
            beams, _ = constrained_beam_search(self.target, prompt, self.trie, k)
        elif method == "beam":
            beams = sampling_beam_search(self.target, prompt, self.trie, k, g)
        elif verify == "strict":
            beams, stats = beam_speculative_search(self.target, self.draft, prompt, self.trie,
                                                   k, n, gamma)
        else:
            beams, stats = beam_speculative_sampling(self.target, self.draft, prompt,
                                                     self.trie, k, gamma, g, n=n)
        out = {"items": [self.trie.item_of(s) for s, _ in beams],
               "scores": [round(score, 6) for _, score in beams],
               "wall_s": time.perf_counter() - t0}
        if stats is not None:
            out["stats"] = {"accepted_steps": stats.accepted_steps,
                            "target_calls": stats.target_calls,
                            "draft_calls": stats.draft_calls, "steps": stats.steps,
                            "accepted_per_round": stats.accepted_per_round}
        return out
