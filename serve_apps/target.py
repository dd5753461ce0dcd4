"""``TargetDeployment``: the target model, its per-request KV caches and the
verification rules (one target forward per round over the whole draft tree).

Calls of one request (first argument: the request id; routed to one replica by
:mod:`serve_apps.router`): ``start`` (prefill, optionally the top tokens per prompt
position for AASD), ``verify`` (a draft tree in wire form -> accepted path, new
tokens), ``end``; ``rec_start`` / ``rec_verify`` are the target's half of AtSpeed
beam SD for ``POST /recommend`` (:mod:`serve_apps.beams`). State is bounded by
:class:`serve_apps.sessions.SessionStore`.
"""

from __future__ import annotations

import torch

from serve_apps.sessions import RequestStates
from speclab.decoding.rules import RuleSpec
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.sides import TargetSide, pack_tensor
from speclab.models.loading import load_model


class TargetDeployment(RequestStates):
    """Holds the target; every method that touches a request takes its id first."""

    def __init__(self, target: str, dtype: str = "float32", device: str = "cpu",
                 max_sessions: int = 64, max_cached_tokens: int = 65536,
                 idle_timeout_s: float = 60.0, rec_target: str | None = None) -> None:
        torch.set_num_threads(1)  # replicas get fractional CPUs; no oversubscription
        self.model = load_model(target, dtype, device, field="models.target")
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen is not None else None
        self.eos = eos if eos is not None else self.model.config.eos_token_id
        super().__init__(max_sessions, max_cached_tokens, idle_timeout_s)
        self.rec = None
        if rec_target:
            from serve_apps.beams import RecTargetSide

            self.rec = RecTargetSide(rec_target, dtype, device)

    def info(self) -> dict:
        """Vocabulary size, EOS id(s), the recommender's items and id length (if any)."""
        return {"vocab_size": int(self.model.config.vocab_size), "eos": self.eos,
                "rec_items": len(self.rec.meta.items) if self.rec else 0,
                "rec_levels": self.rec.trie.length if self.rec else 0}

    def start(self, rid: str, prompt_ids: list[int], sampling: dict, rule: dict, seed: int,
              prefill_top_k: int = 0, features: bool = False) -> dict:
        """The target side of request ``rid``: prefill ``prompt_ids[:-1]``. Returns
        ``top``: the target's ``prefill_top_k`` best tokens per prompt position when asked
        (AASD), and ``features``: the prefill's last-layer features (packed) when asked (a
        feature drafter such as EAGLE; its verdicts then carry the accepted path's too).
        ``rule``: the resolved verification rule (:class:`RuleSpec` dict)."""
        side = TargetSide(ModelRunner(self.model), SamplingParams(**sampling),
                          RuleSpec.from_dict(rule), torch.Generator().manual_seed(seed),
                          features)
        with self.lock:
            top = side.start(prompt_ids, prefill_top_k)
            self.sessions.put(rid, side)
        return {"top": top, "features": pack_tensor(side.prefill_features)}

    def verify(self, rid: str, tree: dict | None) -> dict:
        """One round: the tree (wire form, root = the last committed token; None: the
        root alone) in ONE forward, the request's rule, the cache pruned to the accepted
        path. Returns a :class:`~speclab.decoding.sides.VerifyResult` dict."""
        with self.lock:
            return self.sessions.get(rid).verify(tree).to_dict()

    def rec_start(self, rid: str, history: list[int], k: int, mode: str = "strict",
                  seed: int = 0) -> list[int]:
        """``POST /recommend``: prefill the history's prompt; returns its tokens."""
        if self.rec is None:
            raise ValueError("recommend: this app serves no recommender (serve.rec_target)")
        with self.lock:
            side, prompt = self.rec.start(history, k, mode, seed)
            self.sessions.put(rid, side)
        return prompt

    def rec_verify(self, rid: str, proposal: dict, committed: list) -> dict:
        """Verification (strict top-K or relaxed sampling) of one round of drafted levels."""
        with self.lock:
            return self.rec.verify(self.sessions.get(rid), proposal, committed)
