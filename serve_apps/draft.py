"""``DraftDeployment``: the draft side of any registered method (chain, EAGLE-2 tree,
optimal tree, SALF, SpecDec++ with its head, PLD / REST / AASD, methods registered at run
time, and AtSpeed beams for ``POST /recommend``), with per-request drafter state.

Calls of one request (first argument: the request id; same replica throughout, see
:mod:`serve_apps.router`): ``start`` (a fresh :class:`~speclab.decoding.sides.DraftSide`
over the shared draft model; AASD also gets the target's top tokens per prompt
position), ``propose`` (the draft side's round: commit the last verdict, draft the next
tree, returned in wire form), ``end``. The draft model and the method's resources (an
acceptance head, a datastore) are loaded once per replica; each request gets its own
KV cache.
"""

from __future__ import annotations

import importlib

import torch

from serve_apps.sessions import RequestStates
from speclab.config.method import parse_method
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.sides import DraftSide, unpack_tensor
from speclab.drafters.registry import BuildContext, build_drafter
from speclab.models.loading import load_model


class DraftDeployment(RequestStates):
    """Holds the draft side of one method (``method``: a method config dump; ``plugins``:
    modules to import first, for methods registered outside speclab)."""

    def __init__(self, draft: str | None, method: dict, target_vocab: int,
                 dtype: str = "float32", device: str = "cpu", max_sessions: int = 64,
                 max_cached_tokens: int = 65536, idle_timeout_s: float = 60.0,
                 rec_draft: str | None = None, plugins: list[str] | None = None) -> None:
        torch.set_num_threads(1)  # replicas get fractional CPUs; no oversubscription
        for module in plugins or []:
            importlib.import_module(module)
        self.cfg = parse_method(method)
        self.method = self.cfg.name
        self.model = None
        if self.cfg.needs_draft_model:
            if draft is None:
                raise ValueError(f"models.draft: method {self.method!r} needs a draft model")
            self.model = load_model(draft, dtype, device, field="models.draft")
            vocab = int(self.model.config.vocab_size)
            if vocab != target_vocab:
                raise ValueError(f"models.draft: vocab_size {vocab} != target's {target_vocab}")
        self.resources: dict = {}  # the method's head / datastore, loaded once here
        check = self._side(SamplingParams(), 0)  # bad method params fail at deploy time
        self.drafting = check is not None  # False: plain decoding (the empty drafter)
        self.prefill_top_k = check.prefill_top_k if check else 0
        self.features = bool(check and check.needs_features)
        self.rule = check.drafter.rule.to_dict() if check and check.drafter.rule else None
        if check is not None:
            check.release()  # e.g. SpecDec++'s hidden-state hook on the shared model
        super().__init__(max_sessions, max_cached_tokens, idle_timeout_s)
        self.rec = None
        if rec_draft:
            from serve_apps.beams import RecDraftSide

            self.rec = RecDraftSide(rec_draft, dtype, device)

    def _side(self, sampling: SamplingParams, seed: int) -> DraftSide | None:
        runner = ModelRunner(self.model) if self.model is not None else None
        ctx = BuildContext(runner, sampling, torch.Generator().manual_seed(seed),
                           self.resources)
        drafter = build_drafter(self.cfg, ctx)
        return DraftSide(drafter) if drafter is not None else None

    def info(self) -> dict:
        """The method, whether it drafts at all, how many prefill top tokens its drafter
        reads (AASD), whether it reads the target's features (EAGLE) and the verification
        rule its drafts need (None: the request's)."""
        return {"method": self.method, "drafting": self.drafting,
                "prefill_top_k": self.prefill_top_k, "features": self.features,
                "rule": self.rule}

    def start(self, rid: str, prompt_ids: list[int], prefill_top: list[list[int]] | None,
              sampling: dict, seed: int, features: dict | None = None) -> None:
        """A fresh draft side for request ``rid`` (its own KV cache over the shared model;
        ``features``: the target's prefill features, packed, for feature drafters)."""
        side = self._side(SamplingParams(**sampling), seed + 1)
        if side is None:
            raise ValueError(f"method: {self.method!r} does not draft")
        side.start(prompt_ids, prefill_top, unpack_tensor(features))
        with self.lock:
            self.sessions.put(rid, side)

    def propose(self, rid: str, accepted_path: list[int] | None, new_tokens: list[int],
                budget: int, features: dict | None = None) -> dict:
        """The draft side's round: commit the last verdict (``features``: the target's on
        the accepted path, packed), then draft a tree of at most ``budget`` levels (wire
        form) and the request's draft forwards so far."""
        feats = unpack_tensor(features)
        with self.lock:
            proposal = self.sessions.get(rid).propose(accepted_path, new_tokens, budget,
                                                      feats)
        return {"tree": proposal.tree.to_wire(), "draft_calls": proposal.draft_calls}

    def rec_start(self, rid: str, prompt: list[int], mode: str = "strict", n: int = 10,
                  seed: int = 0) -> None:
        """``POST /recommend``: prefill the history prompt on the drafter recommender."""
        if self.rec is None:
            raise ValueError("recommend: this app serves no recommender (serve.rec_draft)")
        with self.lock:
            self.sessions.put(rid, self.rec.start(prompt, mode, n, seed))

    def rec_draft(self, rid: str, committed: list, g: int) -> dict:
        """``g`` levels from the committed beams (strict: beam search with beam ``n``;
        relaxed: ``n`` samples per level and each level's ``q``)."""
        with self.lock:
            return self.rec.draft(self.sessions.get(rid), committed, g)
