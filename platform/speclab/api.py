"""Public Python API: load a target (and draft) once, generate many times.

    from speclab import Decoder
    dec = Decoder.from_pretrained("path/to/target", "path/to/draft")
    res = dec.generate("def main(", method="salf", max_new_tokens=64, nodes=16, batch=4,
                       threshold=0.3)
    res.token_ids, res.text, res.stats.tau

Methods: ``ar`` (no draft), ``chain`` (gamma), ``tree`` (EAGLE-2: top_k, depth, nodes),
``optimal`` (nodes, batch, depth), ``salf`` (nodes, batch, threshold, depth),
``specdecpp`` (head: a folder or ``models:/`` URI holding an acceptance head, threshold
h, max_draft); without a draft model: ``pld`` (prompt lookup: ngram, max_key,
candidates), ``rest`` (datastore folder, ngram, max_key, candidates) and ``aasd`` (PLD +
alignment sampling of align_k tokens + conditional verification with aasd_alpha,
aasd_beta; relaxed: it changes outputs). Tree methods also take ``score_temperature``
(the softmax temperature used to rank nodes).
Verification: ``greedy`` (temperature 0), ``sample`` (lossless speculative sampling),
``typical`` (Medusa typical acceptance, relaxed). Default: greedy at temperature 0,
sample otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from speclab.models.loading import check_same_vocab, load_model, load_tokenizer, resolve_source
from speclab.decoding.acceptance_head import AcceptanceHead, load_head
from speclab.decoding.datastore import Datastore
from speclab.drafters import ChainDrafter, Drafter, Eagle2TreeDrafter, OptimalTreeDrafter
from speclab.drafters.pld import PromptLookupDrafter
from speclab.drafters.rest import RestDrafter
from speclab.drafters.specdecpp import SpecDecPPDrafter
from speclab.decoding.loop import GenerationStats, autoregressive_generate, speculative_generate
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams

METHODS = ("ar", "chain", "tree", "optimal", "salf", "specdecpp", "pld", "rest", "aasd")
NO_DRAFT_MODEL = ("ar", "pld", "rest", "aasd")  # methods that need no draft model


@dataclass
class MethodParams:
    """Drafting hyperparameters (unused ones are ignored by a method)."""

    gamma: int = 4
    top_k: int = 4
    depth: int = 5
    nodes: int = 16
    batch: int = 4
    threshold: float = 0.3
    score_temperature: float = 1.0
    head: str | AcceptanceHead | None = None
    max_draft: int = 20
    ngram: int = 10
    max_key: int = 3
    candidates: int = 1
    datastore: str | Datastore | None = None
    align_k: int = 2
    conditional: bool = True
    aasd_alpha: float = 0.1
    aasd_beta: float = 0.1


@dataclass
class GenerationResult:
    """New tokens (prompt excluded), their text when a tokenizer is known, and stats."""

    token_ids: list[int]
    text: str | None
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "stats": self.stats.to_dict()}


def head_folder(source: str) -> str:
    """A head folder: ``models:/`` URIs are downloaded; local folders are used as given
    (a head may sit next to a drafter copy or alone)."""
    return resolve_source(source, "head") if source.startswith("models:/") else source


def make_drafter(
    method: str,
    draft: ModelRunner | None,
    hp: MethodParams,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Drafter | None:
    """Build the drafter for ``method`` (``None`` for ``ar``)."""
    if method not in METHODS:
        raise ValueError(f"method: must be one of {METHODS}, got {method!r}")
    if method == "ar":
        return None
    if method == "pld":
        return PromptLookupDrafter(hp.ngram, hp.max_key, hp.candidates)
    if method == "aasd":
        if hp.aasd_alpha < 0:
            raise ValueError(f"aasd_alpha: must be >= 0, got {hp.aasd_alpha}")
        relax = (hp.aasd_alpha, hp.aasd_beta) if hp.conditional else None
        return PromptLookupDrafter(hp.ngram, hp.max_key, hp.candidates, hp.align_k, relax)
    if method == "rest":
        if hp.datastore is None:
            raise ValueError("datastore: method 'rest' needs a datastore folder (--datastore)")
        store = hp.datastore
        if not isinstance(store, Datastore):
            store = Datastore.load(store)
        return RestDrafter(store, hp.ngram, hp.max_key, hp.candidates)
    if draft is None:
        raise ValueError(f"draft: method {method!r} needs a draft model")
    if method == "chain":
        return ChainDrafter(draft, hp.gamma, params, generator)
    if method == "tree":
        return Eagle2TreeDrafter(draft, hp.top_k, hp.depth, hp.nodes, hp.score_temperature)
    if method == "specdecpp":
        if hp.head is None:
            raise ValueError("head: method 'specdecpp' needs an acceptance head (--head DIR)")
        head = hp.head
        if not isinstance(head, AcceptanceHead):
            head = load_head(head_folder(head), int(draft.model.config.hidden_size))
        return SpecDecPPDrafter(draft, head, hp.threshold, params, hp.max_draft, generator)
    if method == "salf" and not 0.0 < hp.threshold < 1.0:
        raise ValueError(f"threshold: must be in (0, 1), got {hp.threshold}")
    threshold = hp.threshold if method == "salf" else 0.0
    return OptimalTreeDrafter(draft, hp.nodes, hp.batch, threshold, hp.depth,
                              hp.score_temperature)


class Decoder:
    """A target (and optional draft) model pair ready for repeated generation."""

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | None = None,
        tokenizer=None,
    ) -> None:
        if draft is not None:
            check_same_vocab(target, draft)
        self.target = ModelRunner(target)
        self.draft = ModelRunner(draft) if draft is not None else None
        self.tokenizer = tokenizer
        self._heads: dict[str, AcceptanceHead] = {}
        self._stores: dict[str, Datastore] = {}
        eos = target.generation_config.eos_token_id if target.generation_config else None
        self.eos_token_id = eos if eos is not None else target.config.eos_token_id

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        draft: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> Decoder:
        """Load from local folders, hub ids or ``models:/name/version`` URIs; the tokenizer
        comes from the target's folder."""
        target = resolve_source(target, "target")
        draft = resolve_source(draft, "draft") if draft else None
        target_model = load_model(target, dtype, device, field="target")
        draft_model = load_model(draft, dtype, device, field="draft") if draft else None
        return cls(target_model, draft_model, load_tokenizer(target, field="target"))

    def encode(self, prompt: str) -> list[int]:
        """Text -> token ids (no special tokens added)."""
        if self.tokenizer is None:
            raise ValueError("prompt: no tokenizer next to the target; pass prompt_ids instead")
        if not prompt:
            raise ValueError("prompt: must not be empty")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: list[int] | None = None,
        method: str = "chain",
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k_sampling: int = 0,
        top_p: float = 1.0,
        verify: str | None = None,
        seed: int = 0,
        typical_epsilon: float = 0.09,
        typical_delta: float = 0.3,
        **method_params,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after the prompt (text or ids).

        ``method_params`` are :class:`MethodParams` fields (gamma, top_k, depth, nodes,
        batch, threshold, score_temperature, head, max_draft, ngram, max_key, candidates,
        datastore, align_k, conditional, aasd_alpha, aasd_beta). ``top_k_sampling`` is the
        top-k filter of the sampler.
        """
        if (prompt is None) == (prompt_ids is None):
            raise ValueError("prompt: give exactly one of prompt (text) or prompt_ids")
        ids = self.encode(prompt) if prompt is not None else [int(t) for t in prompt_ids]
        unknown = set(method_params) - set(MethodParams.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown method parameter(s): {sorted(unknown)}")
        params = SamplingParams(temperature, top_k_sampling, top_p)
        generator = torch.Generator().manual_seed(seed)
        hp = MethodParams(**method_params)
        if method == "specdecpp" and isinstance(hp.head, str) and self.draft is not None:
            if hp.head not in self._heads:  # resolve + load once per Decoder
                self._heads[hp.head] = load_head(head_folder(hp.head),
                                                 int(self.draft.model.config.hidden_size))
            hp.head = self._heads[hp.head]
        if method == "rest" and isinstance(hp.datastore, str):
            if hp.datastore not in self._stores:  # load once per Decoder
                self._stores[hp.datastore] = Datastore.load(hp.datastore)
            hp.datastore = self._stores[hp.datastore]
        drafter = make_drafter(method, self.draft, hp, params, generator)
        if verify is None:
            verify = "greedy" if params.greedy else "sample"
        if drafter is None:
            tokens, stats = autoregressive_generate(
                self.target, ids, max_new_tokens, params, self.eos_token_id, generator
            )
        else:
            tokens, stats = speculative_generate(
                self.target, drafter, ids, max_new_tokens, params, verify,
                self.eos_token_id, generator, typical_epsilon, typical_delta,
            )
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else None
        return GenerationResult(tokens, text, stats)


def generate(target: str, draft: str | None = None, **kwargs) -> GenerationResult:
    """One-shot convenience: load the models and call :meth:`Decoder.generate`."""
    load_kw = {k: kwargs.pop(k) for k in ("dtype", "device") if k in kwargs}
    return Decoder.from_pretrained(target, draft, **load_kw).generate(**kwargs)
