"""Verification rules: pure functions of (tree, target logits, sampling, rng, params) ->
accepted path + one corrected/bonus token, collected in a registry (:mod:`.registry`).

``p`` is the target distribution at a node (over that node's children), ``q`` the draft's.

* ``greedy`` (:func:`verify_greedy`): exact match against the target argmax; lossless at
  temperature 0, refused above it.
* ``sample`` (:func:`verify_speculative`): speculative sampling; lossless at any
  temperature (at temperature 0 it is exactly ``greedy``).
* ``typical`` (:func:`verify_typical_relaxed`): Medusa typical acceptance with
  ``epsilon``/``delta``. RELAXED.
* ``conditional`` (:func:`verify_conditional`): AASD conditional verification with
  ``alpha``/``beta`` (eq. 4-6), greedy-based. RELAXED. Requested by the ``aasd`` method.
"""

from typing import Literal

from pydantic import Field

from speclab.config.base import StrictModel
from speclab.decoding.rules.conditional import (
    conditional_inputs,
    conditional_on_host,
    conditional_threshold,
    verify_conditional,
)
from speclab.decoding.rules.greedy import follow_argmax, verify_greedy
from speclab.decoding.rules.registry import (
    RULES,
    Rule,
    RuleSpec,
    apply_rule,
    default_rule,
    judge_rule,
    prepare_rule,
    register_rule,
    request_rule,
    resolve_rule,
)
from speclab.decoding.rules.speculative import (
    speculative_inputs,
    speculative_on_host,
    verify_speculative,
)
from speclab.decoding.rules.typical import (
    typical_inputs,
    typical_on_host,
    verify_typical_relaxed,
)
from speclab.decoding.rules.verdict import Verdict
from speclab.decoding.sampling import warp_probs


class TypicalParams(StrictModel):
    """Medusa typical acceptance: accept ``x`` if ``p(x) > min(epsilon, delta exp(-H(p)))``
    under ``p = softmax(logits / T)``; the bonus token is the target's argmax (Medusa) or,
    with ``bonus: sample``, a draw from the request's warped distribution."""

    epsilon: float = Field(0.09, gt=0.0, allow_inf_nan=False)
    delta: float = Field(0.3, gt=0.0, allow_inf_nan=False)
    bonus: Literal["greedy", "sample"] = "greedy"


class ConditionalParams(StrictModel):
    """AASD eq. 5: threshold ``min(alpha * H(p) + beta, max p)``."""

    alpha: float = Field(0.1, ge=0.0, allow_inf_nan=False)
    beta: float = Field(0.1, allow_inf_nan=False)


def _argmax(tree, logits, sampling, params):
    return logits.argmax(-1)


def _greedy(tree, best, sampling, generator, params) -> Verdict:
    return follow_argmax(tree, best.tolist())


def _sample_prepare(tree, logits, sampling, params):
    if sampling.greedy:  # identical outcome, no random draws
        return logits.argmax(-1)
    return speculative_inputs(tree, warp_probs(logits, sampling))


def _sample(tree, host, sampling, generator, params) -> Verdict:
    if sampling.greedy:
        return follow_argmax(tree, host.tolist())
    return speculative_on_host(tree, host[0], dict(zip(sorted(tree.q_dist), host[1:],
                                                       strict=True)), generator)


def _typical_prepare(tree, logits, sampling, params):
    return logits.argmax(-1) if sampling.greedy else typical_inputs(logits, sampling,
                                                                     params.bonus)


def _typical(tree, host, sampling, generator, params) -> Verdict:
    if sampling.greedy:
        return follow_argmax(tree, host.tolist())
    return typical_on_host(tree, host[0], generator, params.epsilon, params.delta, *host[1:])


def _conditional_prepare(tree, logits, sampling, params):
    return conditional_inputs(tree, logits, params.alpha, params.beta)


def _conditional(tree, host, sampling, generator, params) -> Verdict:
    if params.alpha < 0:
        raise ValueError(f"aasd_alpha: must be >= 0, got {params.alpha}")
    return conditional_on_host(tree, *(t.tolist() for t in host))


register_rule(Rule("greedy", _greedy, greedy_only=True, doc="target argmax; lossless",
                   prepare=_argmax))
register_rule(Rule("sample", _sample, doc="speculative sampling; lossless",
                   prepare=_sample_prepare))
register_rule(Rule("typical", _typical, TypicalParams, relaxed=True,
                   doc="Medusa typical acceptance; relaxed", prepare=_typical_prepare))
register_rule(Rule("conditional", _conditional, ConditionalParams, greedy_only=True,
                   relaxed=True, doc="AASD conditional verification; relaxed",
                   prepare=_conditional_prepare))

__all__ = [
    "RULES", "ConditionalParams", "Rule", "RuleSpec", "TypicalParams", "Verdict",
    "apply_rule", "conditional_threshold", "default_rule", "judge_rule", "prepare_rule",
    "register_rule", "request_rule",
    "resolve_rule",
    "verify_conditional", "verify_greedy", "verify_speculative", "verify_typical_relaxed",
]
