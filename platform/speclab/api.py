"""Public Python API: load a target (and draft) once, generate many times.

    from speclab import Decoder
    dec = Decoder.from_pretrained("path/to/target", "path/to/draft")
    res = dec.generate("def main(", method="salf", max_new_tokens=64, nodes=16, batch=4,
                       salf_threshold=0.3)
    res.token_ids, res.text, res.stats.tau

``method`` names a registered method (:mod:`speclab.drafters.registry`: ``ar``,
``chain``, ``tree``, ``optimal``, ``salf``, ``specdecpp``, ``pld``, ``rest``, ``aasd``,
plus any registered at run time); its knobs are keyword arguments, validated by the
method's own config (unknown or out-of-range knobs raise ValueError naming the field).
``speclab generate --help`` lists every method's knobs with defaults.
Verification (``verify``): ``greedy`` (temperature 0), ``sample`` (lossless speculative
sampling), ``typical`` (Medusa typical acceptance, relaxed; ``verify_params``
``{"epsilon", "delta"}``). Default: greedy at temperature 0, sample otherwise. A method
whose drafts need their own rule (``aasd``: conditional verification) uses it, and a
request it cannot honour is an error, never a silent swap.
``budget="auto"``: each round's draft depth (0: plain decoding) chosen from the pair's
calibrated forward costs and the sequence's running acceptance
(:mod:`speclab.decoding.budget`, :mod:`speclab.calibration`); outputs are unchanged.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from speclab.calibration import Calibration, calibrate, load_calibration
from speclab.config.method import MethodSpec, method_class, parse_method
from speclab.decoding.batch_loop import BatchStats, generate_batch, new_rows
from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.budget import Acceptance, AutoBudget, judged_counts
from speclab.decoding.gqa_attention import use_packed_attention
from speclab.decoding.loop import GenerationStats, generate_tokens
from speclab.decoding.row_pool import DraftPool, TargetPool, seeded
from speclab.decoding.rules import request_rule
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.static_runner import FastPath, StaticBatchRunner
from speclab.drafters.registry import BuildContext, build_drafter, make_batch_drafter
from speclab.models.loading import check_same_vocab, load_model, load_tokenizer, resolve_source


@dataclass
class GenerationResult:
    """New tokens (prompt excluded), their text when a tokenizer is known, and stats."""

    token_ids: list[int]
    text: str | None
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "stats": self.stats.to_dict()}


def needs_draft_model(method: str) -> bool:
    """Whether method ``method`` drafts with a separate draft model."""
    return method_class(method).needs_draft_model


@dataclass
class Warmup:
    """One warm-up during a batched generate: which side's model, how long, and the rows
    (ids) that were decoding meanwhile."""

    side: str  # "draft" or "verify": the phase of a round it fell in
    seconds: float
    rids: tuple[str, ...]


def exclude_warmups(warmups: list[Warmup], batch: BatchStats,
                    stats: list[GenerationStats]) -> float:
    """Take ``warmups`` out of the timed figures of the generate they fell in: the batch's
    wall time and the phase each ran in (a draft model's warm-up in ``draft_s``, the
    target's in ``verify_s``), and the same for every row decoding meanwhile (row ids
    ``"0"``, ``"1"``, ... index ``stats``). Returns the seconds taken out."""
    def take(obj, name: str, s: float) -> None:
        setattr(obj, name, max(getattr(obj, name) - s, 0.0))

    for w in warmups:
        phase = "draft_s" if w.side == "draft" else "verify_s"
        for obj in [batch, *(stats[int(r)] for r in w.rids if 0 <= int(r) < len(stats))]:
            take(obj, "wall_s", w.seconds)
            take(obj, phase, w.seconds)
    return sum(w.seconds for w in warmups)


class Decoder:
    """A target (and optional draft) model pair ready for repeated generation.

    Timed figures (``GenerationResult.stats``, :attr:`last_batch`) never include the
    fast path's warm-up (compiling a new shape; on CUDA capturing its graph): that time
    is reported as :attr:`warmup_s` (all so far) and :attr:`last_warmup_s` (during the
    last generate) only."""

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | None = None,
        tokenizer=None,
        compile: bool = False,
        capacity: int | None = None,
    ) -> None:
        if capacity is not None and (isinstance(capacity, bool) or capacity < 2):
            raise ValueError(f"capacity: must be >= 2 cache slots, got {capacity}")
        if draft is not None:
            check_same_vocab(target, draft)
        for model in (target, draft):  # sdpa without copying a grouped-query cache
            if model is not None:
                use_packed_attention(model)
        self.target = ModelRunner(target)
        self.draft = ModelRunner(draft) if draft is not None else None
        self.tokenizer = tokenizer
        self._resources: dict = {}  # acceptance heads, datastores: loaded once per Decoder
        self.last_batch: BatchStats | None = None  # figures of the last batched generate
        # the opt-in fast path: static caches and compiled forwards, one per (model, rows)
        self.compile, self.capacity = bool(compile), capacity
        self._fast: dict[tuple[int, int], FastPath] = {}  # (model, rows): ONE static cache
        self._retired_warmup_s = 0.0
        self.last_warmup_s = 0.0  # warm-up seconds of the last generate (excluded from it)
        self._warmups: list[Warmup] | None = None  # those of the generate running now
        self._live_rows: Callable[[], list[str]] = list
        self._calibration: Calibration | None = None  # the `auto` budget's cost curves
        self.acceptance: dict[str, list[float]] = {}  # method -> measured q_k (auto's prior)
        self._acceptance_counts: dict[str, Acceptance] = {}  # method -> the rounds behind it
        # (method, its draft length, engine, rows) -> AutoBudget.state()
        self._budgets: dict[tuple, dict] = {}
        eos = target.generation_config.eos_token_id if target.generation_config else None
        self.eos_token_id = eos if eos is not None else target.config.eos_token_id

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        draft: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        compile: bool = False,
        capacity: int | None = None,
        attn_implementation: str = "auto",
    ) -> Decoder:
        """Load from local folders, hub ids or ``models:/name/version`` URIs; the tokenizer
        comes from the target's folder. ``compile``: the fast path (every generate runs
        the batched engine over static caches of ``capacity`` slots per row, with
        ``torch.compile``'d forwards; each new shape compiles once, on first use).
        ``capacity`` None: per call, the longest prompt + ``max_new_tokens`` + 64 tree
        slots, rounded up to 64 (attention runs over the whole capacity, so tight is fast;
        each new capacity compiles anew). ``attn_implementation``: ``auto`` (sdpa where
        the model supports it, else eager), ``sdpa`` or ``eager``, for both models."""
        target = resolve_source(target, "target")
        draft = resolve_source(draft, "draft") if draft else None
        target_model = load_model(target, dtype, device, "target", attn_implementation)
        draft_model = load_model(draft, dtype, device, "draft", attn_implementation) \
            if draft else None
        return cls(target_model, draft_model, load_tokenizer(target, field="target"),
                   compile=compile, capacity=capacity)

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
        prompts: list[str] | list[list[int]] | None = None,
        batch_size: int | None = None,
        method: str | MethodSpec = "chain",
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        sample_top_k: int = 0,
        top_p: float = 1.0,
        verify: str | None = None,
        verify_params: dict | None = None,
        seed: int = 0,
        budget: str | None = None,
        **knobs,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate up to ``max_new_tokens`` after the prompt (text or ids).

        ``method``: a registered method name with its ``knobs`` as keywords (e.g.
        ``method="chain", gamma=4``), or a method config object. ``sample_top_k`` /
        ``top_p`` / ``temperature`` warp target and draft alike; ``seed`` seeds sampling.

        ``prompts``: a list of texts or of token-id lists, decoded TOGETHER by the batched
        engine (at most ``batch_size`` rows at once, default all); returns one result per
        prompt, in order. Prompt ``i`` uses seed ``seed + i``, so at temperature 0 (and,
        up to float rounding, when sampling) it gets what ``generate`` gives it alone.

        ``budget``: None (the method's own length every round) or ``"auto"`` (each
        round's depth, 0 = plain decoding, chosen for committed tokens per second; the
        pair is calibrated once per device and dtype if no stored calibration covers
        the batch, see :mod:`speclab.calibration`).
        """
        cfg = self.method_config(method, knobs)
        budget = cfg.budget if budget is None else budget  # a method config's own
        params = SamplingParams(temperature, sample_top_k, top_p)
        if budget not in (None, "auto", "fixed"):
            raise ValueError(f"budget: 'auto' or 'fixed', got {budget!r}")
        auto = budget == "auto" and cfg.traits().drafting
        if auto and self.compile:
            raise ValueError("budget: auto needs calibrated eager costs; the compiled fast "
                             "path is not calibrated (drop compile)")
        if prompts is not None:
            if prompt is not None or prompt_ids is not None:
                raise ValueError("prompts: give either prompts (a list) or one prompt, not both")
            results = self._generate_batch(self.encode_all(prompts), cfg, params, batch_size,
                                           max_new_tokens, verify, verify_params, seed, auto)
            self._measured(cfg, [r.stats for r in results])
            return results
        if batch_size is not None:
            raise ValueError("batch_size: only with prompts=[...]")
        if (prompt is None) == (prompt_ids is None):
            raise ValueError("prompt: give exactly one of prompt (text) or prompt_ids")
        ids = self.encode(prompt) if prompt is not None else _ids(prompt_ids, "prompt_ids")
        if self.compile:  # the fast path is the batched engine's: one row
            return self._generate_batch([ids], cfg, params, 1, max_new_tokens, verify,
                                        verify_params, seed)[0]
        traits = cfg.traits()
        rule = request_rule(verify, verify_params, params, traits.rule)
        generator = seeded(seed)  # the sequence's one rng: its drafter's and its rule's
        drafter = build_drafter(cfg, self._context(self.draft, params, generator))
        shared = self.auto_budget(cfg, batched=False) if auto and drafter else None
        tokens, stats = generate_tokens(self.target, drafter, ids, max_new_tokens, params, rule,
                                        self.eos_token_id, generator, traits,
                                        shared.row() if shared is not None else None)
        self._learned(cfg, False, 1, shared)
        self._measured(cfg, [stats])
        return GenerationResult(tokens, self.decode(tokens), stats)

    def calibration(self, rows: int = 1) -> Calibration:
        """The pair's cost curves covering ``rows`` rows: this Decoder's, else the stored
        ones (:func:`speclab.calibration.load_calibration`), else measured now and
        stored (:func:`speclab.calibration.calibrate`)."""
        cal = self._calibration
        if cal is None or (rows > 1 and cal.max_rows < rows):
            cal = load_calibration(self, rows) or calibrate(self, max_rows=rows)
            self._calibration = cal
        return cal

    def auto_budget(self, cfg: MethodSpec, batched: bool, rows: int = 1) -> AutoBudget:
        """The ``auto`` budget of one generate with method ``cfg`` (each sequence takes a
        :meth:`~speclab.decoding.budget.AutoBudget.row`): resumed from what the last one
        of the same method, engine and batch learned, else with the acceptance this
        Decoder last measured for the method as prior."""
        depth = cfg.draft_length()
        if not depth:
            raise ValueError(f"budget: auto needs a method with a known draft length; "
                             f"{cfg.name!r} does not say its own")
        costs = self.calibration(rows if batched else 1).round_costs(batched)
        label = cfg.label or cfg.name
        budget = AutoBudget(costs, depth, list(self.acceptance.get(label, ())),
                            measured=self._acceptance_counts.get(label))
        state = self._budgets.get((label, depth, batched, rows))
        return budget.resume(state) if state is not None else budget

    def forget_budgets(self) -> None:
        """Drop what ``auto`` budgets learned (each method's next one starts from its
        calibrated costs): a warm-up pass's first-use costs (lazy kernel loads, a GPU's
        first launches) inflate the step times it learns, and a resumed state revisits
        them only by its probes. The acceptance measured per method stays (a prior that
        timing does not skew)."""
        self._budgets.clear()

    def _learned(self, cfg: MethodSpec, batched: bool, rows: int,
                 budget: AutoBudget | None) -> None:
        """Keep what an ``auto`` budget learned for the next generate like it."""
        if budget is not None:
            key = (cfg.label or cfg.name, budget.max_depth, batched, rows)
            self._budgets[key] = budget.state()

    def _measured(self, cfg: MethodSpec, stats: list[GenerationStats]) -> None:
        """Remember a drafting method's per-position acceptance (the next ``auto``
        budget's prior): the counts of every round this Decoder ran with it (an ``auto``
        run that decoded mostly plainly adds few rounds, and moves the prior little)."""
        depth = cfg.draft_length() if cfg.traits().drafting else None
        if depth:
            label = cfg.label or cfg.name
            counts = judged_counts([a for s in stats for a in s.round_accepted],
                                   [r for s in stats for r in s.round_reach], depth)
            old = self._acceptance_counts.get(label)
            if old is not None and len(old.judged) == depth:
                counts = old.plus(counts)
            # a position judged by a round or two is no prior (the budget weighs its
            # prior as prior_weight rounds): the last surer position's rate stands in.
            # EAGLE-3 on SmolLM2 at batch 1 drafted depth 1 in 400 rounds and depth 2 in
            # one, rejected: a prior of 0 at every depth past 1, which no probe revisits.
            # The first position's rate stays however few rounds judged it (else: none)
            q = counts.rates(least=AutoBudget.prior_weight) or counts.rates()[:1]
            if q:
                self.acceptance[label] = q
                self._acceptance_counts[label] = counts

    def drafter_networks(self) -> dict[str, torch.nn.Module]:
        """The drafters' own networks loaded so far (once per Decoder, e.g. an EAGLE
        drafter) whose forwards the cost curves can time: modules with ``cost_inputs(n)``
        (:mod:`speclab.forward_costs`), named ``<kind>:<source>``."""
        return {":".join(map(str, k)) if isinstance(k, tuple) else str(k): v
                for k, v in self._resources.items()
                if isinstance(v, torch.nn.Module) and callable(getattr(v, "cost_inputs", None))}

    def method_config(self, method: str | MethodSpec, knobs: dict) -> MethodSpec:
        """``method`` (a name plus ``knobs``, or a config object) as a validated config."""
        if isinstance(method, MethodSpec):
            if knobs:
                raise ValueError(f"{sorted(knobs)}: give knobs in the method config, not both")
            return method
        method_class(method)  # unknown method: ValueError naming `method`
        return parse_method({"name": method, **knobs})

    def encode_all(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        """Texts or token-id lists -> token-id lists (ValueError naming ``prompts[i]``)."""
        if isinstance(prompts, str) or not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError("prompts: must be a non-empty list of texts or token-id lists")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                try:
                    out.append(self.encode(p))
                except ValueError as e:
                    raise ValueError(f"prompts[{i}]: {e}") from None
            else:
                out.append(_ids(p, f"prompts[{i}]"))
        return out

    def decode(self, tokens: list[int]) -> str | None:
        """Token ids -> text (None without a tokenizer)."""
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else None

    def _context(self, draft: ModelRunner | None, params: SamplingParams,
                 generator: torch.Generator | None, rows: int = 1,
                 capacity: int = 0) -> BuildContext:
        return BuildContext(draft, params, generator, self._resources, self.target.model.config,
                            self.target.model,
                            lambda model, *classes: self.batch_runner(model, rows, capacity,
                                                                      *classes),
                            self.target.device, self.target.dtype)

    def batch_runner(self, model: PreTrainedModel, rows: int, capacity: int,
                     eager: type[BatchRunner] = BatchRunner,
                     static: type[StaticBatchRunner] = StaticBatchRunner) -> BatchRunner:
        """A batched runner over ``model`` for up to ``rows`` rows: ``eager(model)``, or
        the static, compiled fast path (``capacity`` slots per row; a ``static`` runner
        over a :class:`FastPath` built with ``static.stepper``) when the Decoder was built
        with ``compile=True``. One static cache per (model, rows): a call needing more
        capacity replaces it (the old one is freed), one needing less reuses it, so
        prompts of many lengths neither pile up caches nor compile each time."""
        if not self.compile:
            return eager(model)
        key = (id(model), rows)
        fast = self._fast.get(key)
        if fast is None or fast.capacity < capacity:
            if fast is not None:
                self._retired_warmup_s += fast.warmup_s
                del self._fast[key]  # freed before the new one is allocated
            side = "verify" if model is self.target.model else "draft"
            me = weakref.ref(self)  # the fast path must not keep its Decoder alive

            def heard(seconds: float, side: str = side) -> None:
                if (dec := me()) is not None:
                    dec._warmed(side, seconds)

            fast = self._fast[key] = FastPath(model, rows, capacity, stepper=static.stepper)
            fast.on_warmup = heard
        return static(fast)

    def _warmed(self, side: str, seconds: float) -> None:
        """A fast path warmed a shape up: remember it for the generate running now."""
        if self._warmups is not None:
            self._warmups.append(Warmup(side, seconds, tuple(self._live_rows())))

    @property
    def warmup_s(self) -> float:
        """Seconds spent so far warming the fast path up: the forwards that compiled a new
        shape (on CUDA also those that captured and settled its CUDA graph), timed with
        the device synchronised. Never part of a generate's timed figures."""
        return self._retired_warmup_s + sum(f.warmup_s for f in self._fast.values())

    def _generate_batch(self, prompts: list[list[int]], cfg: MethodSpec, params: SamplingParams,
                        batch_size: int | None, max_new_tokens: int, verify: str | None,
                        verify_params: dict | None, seed: int, auto: bool = False
                        ) -> list[GenerationResult]:
        """The batched engine over ``prompts`` (see :meth:`generate`; ``auto``: each row's
        budget chosen by :meth:`auto_budget`)."""
        batch_size = len(prompts) if batch_size is None else batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
        rows = min(batch_size, len(prompts))
        capacity = self.capacity or -(-(max(map(len, prompts)) + max_new_tokens + 64) // 64) * 64
        traits = cfg.traits()
        rule = request_rule(verify, verify_params, params, traits.rule)

        def make(sampling: SamplingParams):
            return make_batch_drafter(
                cfg, self._context(self.draft, sampling, None, rows, capacity),
                lambda g: build_drafter(cfg, self._context(
                    ModelRunner(self.draft.model) if self.draft else None, sampling, g)))

        target = TargetPool(self.batch_runner(self.target.model, rows, capacity),
                            traits.drafting and traits.needs_features, traits.feature_layers)
        draft = DraftPool(make) if traits.drafting else None
        policy = self.auto_budget(cfg, batched=True, rows=rows) if auto else None
        self._warmups, self._live_rows = [], lambda: list(target.rids)
        try:
            outs, stats, batch = generate_batch(
                target, draft, new_rows(prompts, params, rule, seed), max_new_tokens,
                batch_size, self.eos_token_id, traits.prefill_top_k, policy)
            self._learned(cfg, True, rows, policy)
            self.last_warmup_s = exclude_warmups(self._warmups, batch, stats)
        finally:
            self._warmups, self._live_rows = None, list
            target.runner.release()
            if draft is not None:
                draft.release()
        self.last_batch = batch
        return [GenerationResult(o, self.decode(o), s) for o, s in zip(outs, stats, strict=True)]


def _ids(ids: list[int], name: str) -> list[int]:
    """Token ids as ints; ValueError naming ``name`` for booleans or non-integers."""
    if isinstance(ids, str | bytes) or not isinstance(ids, list | tuple):
        raise ValueError(f"{name}: must be a list of token ids")
    if any(isinstance(t, bool) for t in ids):
        raise ValueError(f"{name}: booleans are not token ids")
    try:
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError(f"{name}: token ids must be integers") from None


def generate(target: str, draft: str | None = None, **kwargs) -> GenerationResult:
    """One-shot convenience: load the models and call :meth:`Decoder.generate`."""
    load_kw = {k: kwargs.pop(k) for k in ("dtype", "device") if k in kwargs}
    return Decoder.from_pretrained(target, draft, **load_kw).generate(**kwargs)
