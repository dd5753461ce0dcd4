"""The decode loop: draft -> verify in ONE target call -> commit; plus the AR baseline.

Both loops use the same convention: the target's cache holds every committed token but
the last one (the root); each target call processes the root (plus the draft tree) and
yields the next token(s). Hence an autoregressive run makes exactly one target call per
new token, and ``verification_rate = target_calls / new_tokens`` compares directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from speclab.drafters.base import Drafter
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams, sample, warp_probs
from speclab.decoding.tree import TokenTree
from speclab.decoding.verify import (
    Verdict,
    verify_conditional,
    verify_greedy,
    verify_speculative,
    verify_typical_relaxed,
)

VERIFY_RULES = ("greedy", "sample", "typical")


@dataclass
class GenerationStats:
    """Counters for one generation (SpecDec++ eq. 2.3 naming).

    ``accepted_lengths[r]`` = tokens committed by round ``r`` (accepted drafts + 1);
    ``tau`` is their mean. ``acceptance_rate`` (alpha) = accepted draft tokens / draft
    tokens judged (depth positions where the rule looked at a draft token).
    """

    new_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    judged_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0

    def add_round(self, drafted: int, accepted: int, judged: int, committed: int) -> None:
        """Count one draft -> verify round (one target call) that committed
        ``committed`` tokens (accepted drafts + the bonus)."""
        self.target_calls += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.judged_tokens += judged
        self.accepted_lengths.append(committed)

    @property
    def tau(self) -> float:
        n = len(self.accepted_lengths)
        return sum(self.accepted_lengths) / n if n else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.judged_tokens if self.judged_tokens else 0.0

    @property
    def discard_rate(self) -> float:
        """N_discarded / N."""
        n = self.new_tokens
        return (self.drafted_tokens - self.accepted_tokens) / n if n else 0.0

    @property
    def verification_rate(self) -> float:
        """N_target / N."""
        return self.target_calls / self.new_tokens if self.new_tokens else 0.0

    @property
    def other_s(self) -> float:
        return max(self.wall_s - self.draft_s - self.verify_s - self.prefill_s, 0.0)

    def to_dict(self) -> dict:
        """Plain dict with the derived rates (JSON-ready)."""
        d = asdict(self)
        for name in ("tau", "acceptance_rate", "discard_rate", "verification_rate", "other_s"):
            d[name] = getattr(self, name)
        return d


def eos_set(eos_token_id: int | Iterable[int] | None) -> set[int]:
    """A model config's ``eos_token_id`` (None, one id or several) as a set."""
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


def commit_tokens(out: list[int], new: list[int], limit: int, eos: set[int]) -> bool:
    """Append ``new`` to ``out`` up to ``limit`` tokens or the first EOS; True when done."""
    for t in new:
        out.append(t)
        if t in eos or len(out) >= limit:
            return True
    return False


def _check_inputs(prompt_ids: list[int], max_new_tokens: int, vocab: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("prompt: must contain at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens: must be > 0, got {max_new_tokens}")
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_ids: token ids {bad[:5]} outside the vocabulary [0, {vocab})")


def prefill(target: ModelRunner, prompt_ids: list[int]) -> torch.Tensor | None:
    """Reset and cache ``prompt[:-1]``; returns its ``[L-1, V]`` logits (None for
    1-token prompts). The last prompt token is the first round's root."""
    target.reset()
    if len(prompt_ids) > 1:
        return target.forward(torch.tensor(prompt_ids[:-1], dtype=torch.long))
    return None


def _prefill(target: ModelRunner, prompt_ids: list[int],
             stats: GenerationStats) -> torch.Tensor | None:
    t0 = time.perf_counter()
    logits = prefill(target, prompt_ids)
    stats.prefill_s = time.perf_counter() - t0
    return logits


def autoregressive_generate(
    target: ModelRunner,
    prompt_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], GenerationStats]:
    """Plain decoding with a KV cache (greedy or sampling). Returns new tokens and stats."""
    _check_inputs(prompt_ids, max_new_tokens, target.vocab_size)
    stats, out, eos = GenerationStats(), [], eos_set(eos_token_id)
    t_start = time.perf_counter()
    _prefill(target, prompt_ids, stats)
    root, done = prompt_ids[-1], False
    while not done:
        t0 = time.perf_counter()
        logits = target.forward(torch.tensor([root], dtype=torch.long))[-1]
        probs = warp_probs(logits, params)
        root = int(probs.argmax()) if params.greedy else sample(probs, generator)
        stats.verify_s += time.perf_counter() - t0
        stats.add_round(0, 0, 0, 1)
        done = commit_tokens(out, [root], max_new_tokens, eos)
    stats.new_tokens = len(out)
    stats.wall_s = time.perf_counter() - t_start
    return out, stats


def _greedy(tree: TokenTree, logits: torch.Tensor) -> Verdict:
    if tree.relax_params is not None:  # AASD: the drafter asked for conditional rules
        return verify_conditional(tree, logits, *tree.relax_params)
    return verify_greedy(tree, logits)


def verify_tree(
    tree: TokenTree,
    logits: torch.Tensor,
    rule: str,
    params: SamplingParams,
    generator: torch.Generator | None,
    typical_epsilon: float = 0.09,
    typical_delta: float = 0.3,
) -> Verdict:
    """Dispatch to a verification rule. ``logits``: ``[T, V]`` target logits per node."""
    if rule == "greedy":
        if not params.greedy:
            raise ValueError("verify: 'greedy' needs temperature 0 (use 'sample' or 'typical')")
        return _greedy(tree, logits)
    if rule == "sample":
        if params.greedy:  # identical outcome, no random draws
            return _greedy(tree, logits)
        return verify_speculative(tree, warp_probs(logits, params), generator)
    if rule == "typical":
        return verify_typical_relaxed(
            tree, logits, params, generator, typical_epsilon, typical_delta
        )
    raise ValueError(f"verify: must be one of {VERIFY_RULES}, got {rule!r}")


def verify_round(
    target: ModelRunner,
    tree: TokenTree,
    rule: str,
    params: SamplingParams,
    generator: torch.Generator | None,
    typical_epsilon: float = 0.09,
    typical_delta: float = 0.3,
) -> tuple[Verdict, list[int]]:
    """The target's half of a round: ONE forward over every node of ``tree`` (tree
    attention unless it is a chain), the acceptance rule, and the target cache pruned
    to the accepted path. Returns the verdict and the new committed tokens (accepted
    drafts + the bonus token)."""
    prefix = target.length
    if tree.is_chain():
        logits = target.forward(tree.token_tensor())
    else:
        logits = target.forward(
            tree.token_tensor(), tree.position_ids(prefix), tree.attention_mask(prefix)
        )
    verdict = verify_tree(tree, logits, rule, params, generator, typical_epsilon, typical_delta)
    target.keep(list(range(prefix)) + [prefix + i for i in verdict.path])
    return verdict, [tree.tokens[i] for i in verdict.path[1:]] + [verdict.bonus]


def speculative_generate(
    target: ModelRunner,
    drafter: Drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    verify: str = "greedy",
    eos_token_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    typical_epsilon: float = 0.09,
    typical_delta: float = 0.3,
) -> tuple[list[int], GenerationStats]:
    """Speculative decoding of one sequence. Returns new tokens and stats."""
    _check_inputs(prompt_ids, max_new_tokens, target.vocab_size)
    if verify not in VERIFY_RULES:
        raise ValueError(f"verify: must be one of {VERIFY_RULES}, got {verify!r}")
    stats, out, eos = GenerationStats(), [], eos_set(eos_token_id)
    committed = list(prompt_ids)
    t_start = time.perf_counter()
    draft_calls0 = drafter.calls
    prefill_logits = _prefill(target, prompt_ids, stats)
    drafter.reset()
    drafter.observe_prefill(prompt_ids, prefill_logits)
    done = False
    while not done:
        # 1. draft: a tree rooted at the last committed token
        t0 = time.perf_counter()
        budget = max_new_tokens - len(out) - 1
        tree = drafter.propose(committed, budget) if budget > 0 else TokenTree(committed[-1])
        t1 = time.perf_counter()
        # 2. verify: one target forward over every node, the acceptance rule, and the
        #    target cache pruned to the accepted path
        verdict, new = verify_round(target, tree, verify, params, generator,
                                    typical_epsilon, typical_delta)
        t2 = time.perf_counter()
        # 3. commit: the drafter keeps the accepted path too
        if budget > 0:
            drafter.accept(tree, verdict.path)
        committed += new
        done = commit_tokens(out, new, max_new_tokens, eos)
        # 4. stats
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.add_round(tree.num_drafted, verdict.accepted, verdict.evaluated, len(new))
    stats.new_tokens = len(out)
    stats.draft_calls = drafter.calls - draft_calls0
    stats.wall_s = time.perf_counter() - t_start
    return out, stats
