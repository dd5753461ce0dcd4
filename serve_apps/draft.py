"""``DraftDeployment``: a drafter of any kind the engine supports (chain, EAGLE-2 tree,
optimal tree, SALF, SpecDec++ with its head, PLD / REST / AASD, and AtSpeed beams for
``POST /recommend``), with per-request drafter state.

Calls of one request (first argument: the request id; same replica throughout, see
:mod:`serve_apps.router`): ``start`` (a fresh drafter over the shared draft model; AASD
also gets the target's top tokens per prompt position), ``propose`` (tell the drafter
which path of its last tree the target accepted and which tokens were committed, and
get the next draft tree in wire form), ``end``. The draft model, an acceptance head and
a datastore are loaded once per replica; each request gets its own KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from serve_apps.sessions import RequestStates
from speclab.api import NO_DRAFT_MODEL, MethodParams, head_folder, make_drafter
from speclab.models.loading import load_model
from speclab.decoding.acceptance_head import load_head
from speclab.decoding.datastore import Datastore
from speclab.drafters.base import Drafter
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.tree import TokenTree


@dataclass
class _Request:
    drafter: Drafter
    runner: ModelRunner | None
    committed: list[int]
    last_tree: TokenTree | None = None
    calls0: int = 0
    extra: dict = field(default_factory=dict)

    def cached_tokens(self) -> int:
        return self.runner.length if self.runner is not None else len(self.committed)

    def release(self) -> None:
        if self.runner is not None:
            self.runner.release()


class DraftDeployment(RequestStates):
    """Holds the draft side of one method (``method``: a MethodConfig dump)."""

    def __init__(self, draft: str | None, method: dict, target_vocab: int,
                 dtype: str = "float32", device: str = "cpu", max_sessions: int = 64,
                 max_cached_tokens: int = 65536, idle_timeout_s: float = 60.0,
                 rec_draft: str | None = None) -> None:
        torch.set_num_threads(1)  # replicas get fractional CPUs; no oversubscription
        self.method = method["name"]
        self.hp = MethodParams(**{k: v for k, v in method.items()
                                  if k in MethodParams.__dataclass_fields__})
        self.model = None
        if self.method not in NO_DRAFT_MODEL:
            if draft is None:
                raise ValueError(f"models.draft: method {self.method!r} needs a draft model")
            self.model = load_model(draft, dtype, device, field="models.draft")
            vocab = int(self.model.config.vocab_size)
            if vocab != target_vocab:
                raise ValueError(f"models.draft: vocab_size {vocab} != target's {target_vocab}")
        if self.method == "specdecpp":  # the head is loaded once, checked against the draft
            if not self.hp.head:
                raise ValueError("method.head: method 'specdecpp' needs an acceptance head")
            self.hp.head = load_head(head_folder(str(self.hp.head)),
                                     int(self.model.config.hidden_size))
        if self.method == "rest":
            if not self.hp.datastore:
                raise ValueError("method.datastore: method 'rest' needs a datastore folder")
            self.hp.datastore = Datastore.load(str(self.hp.datastore))
        check_runner = self._runner()  # bad method params fail at deploy time
        check = make_drafter(self.method, check_runner, self.hp, SamplingParams(), None)
        self.prefill_top_k = check.prefill_top_k if check is not None else 0
        if check_runner is not None:
            check_runner.release()  # e.g. SpecDec++'s hidden-state hook on the shared model
        super().__init__(max_sessions, max_cached_tokens, idle_timeout_s)
        self.rec = None
        if rec_draft:
            from serve_apps.beams import RecDraftSide

            self.rec = RecDraftSide(rec_draft, dtype, device)

    def _runner(self) -> ModelRunner | None:
        return ModelRunner(self.model) if self.model is not None else None

    def info(self) -> dict:
        """The method and how many prefill top tokens its drafter reads (AASD)."""
        return {"method": self.method, "prefill_top_k": self.prefill_top_k}

    def start(self, rid: str, prompt_ids: list[int], prefill_top: list[list[int]] | None,
              sampling: dict, seed: int) -> None:
        """A fresh drafter for request ``rid`` (its own KV cache over the shared model)."""
        runner = self._runner()
        drafter = make_drafter(self.method, runner, self.hp, SamplingParams(**sampling),
                               torch.Generator().manual_seed(seed + 1))
        drafter.reset()
        if prefill_top is not None:
            drafter.observe_prefill_top(prefill_top)
        with self.lock:
            self.sessions.put(rid, _Request(drafter, runner, list(prompt_ids),
                                            calls0=drafter.calls))

    def propose(self, rid: str, accepted_path: list[int] | None, new_tokens: list[int],
                budget: int) -> dict:
        """Commit the last round (the accepted node path of the last tree and the tokens
        the target committed), then draft a tree of at most ``budget`` levels."""
        with self.lock:
            req = self.sessions.get(rid)
            if req.last_tree is not None and accepted_path is not None:
                req.drafter.accept(req.last_tree, accepted_path)
            req.committed += new_tokens
            req.last_tree = req.drafter.propose(req.committed, budget)
            return {"tree": req.last_tree.to_wire(),
                    "draft_calls": req.drafter.calls - req.calls0}

    def rec_start(self, rid: str, prompt: list[int]) -> None:
        """``POST /recommend``: prefill the history prompt on the drafter recommender."""
        if self.rec is None:
            raise ValueError("recommend: this app serves no recommender (serve.rec_draft)")
        with self.lock:
            self.sessions.put(rid, self.rec.start(prompt))

    def rec_draft(self, rid: str, committed: list, n: int, g: int) -> list:
        """``g`` levels of beam search with beam ``n`` from the committed beams."""
        with self.lock:
            return self.rec.draft(self.sessions.get(rid), committed, n, g)
