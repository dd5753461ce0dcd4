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

from pydantic import Field

from speclab.config.base import StrictModel
from speclab.decoding.rules.conditional import conditional_threshold, verify_conditional
from speclab.decoding.rules.greedy import verify_greedy
from speclab.decoding.rules.registry import (
    RULES,
    Rule,
    RuleSpec,
    apply_rule,
    default_rule,
    register_rule,
    request_rule,
    resolve_rule,
)
from speclab.decoding.rules.speculative import verify_speculative
from speclab.decoding.rules.typical import verify_typical_relaxed
from speclab.decoding.rules.verdict import Verdict
from speclab.decoding.sampling import warp_probs


class TypicalParams(StrictModel):
    """Medusa typical acceptance: accept ``x`` if ``p(x) > min(epsilon, delta exp(-H(p)))``."""

    epsilon: float = Field(0.09, gt=0.0, allow_inf_nan=False)
    delta: float = Field(0.3, gt=0.0, allow_inf_nan=False)


class ConditionalParams(StrictModel):
    """AASD eq. 5: threshold ``min(alpha * H(p) + beta, max p)``."""

    alpha: float = Field(0.1, ge=0.0, allow_inf_nan=False)
    beta: float = Field(0.1, allow_inf_nan=False)


def _sample(tree, logits, sampling, generator, _params) -> Verdict:
    if sampling.greedy:  # identical outcome, no random draws
        return verify_greedy(tree, logits)
    return verify_speculative(tree, warp_probs(logits, sampling), generator)


register_rule(Rule("greedy", lambda tree, logits, s, g, p: verify_greedy(tree, logits),
                   greedy_only=True, doc="target argmax; lossless"))
register_rule(Rule("sample", _sample, doc="speculative sampling; lossless"))
register_rule(Rule("typical", lambda tree, logits, s, g, p: verify_typical_relaxed(
    tree, logits, s, g, p.epsilon, p.delta), TypicalParams, relaxed=True,
    doc="Medusa typical acceptance; relaxed"))
register_rule(Rule("conditional", lambda tree, logits, s, g, p: verify_conditional(
    tree, logits, p.alpha, p.beta), ConditionalParams, greedy_only=True, relaxed=True,
    doc="AASD conditional verification; relaxed"))

__all__ = [
    "RULES", "ConditionalParams", "Rule", "RuleSpec", "TypicalParams", "Verdict",
    "apply_rule", "conditional_threshold", "default_rule", "register_rule", "request_rule",
    "resolve_rule",
    "verify_conditional", "verify_greedy", "verify_speculative", "verify_typical_relaxed",
]
