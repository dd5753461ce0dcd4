"""The registry of verification rules: each rule is a pure function with its own
parameter model, registered under a name that requests and configs use.

A request names a rule (``verify``) and its parameters (``verify_params``);
:func:`resolve_rule` validates both against the sampling settings ONCE per generation
and returns a :class:`RuleSpec`; :func:`apply_rule` runs it on one tree. Nothing swaps a
requested rule for another: a combination a rule cannot honour (e.g. a greedy-only
rule at temperature > 0) is a ``ValueError`` naming the field.

A new rule: a module in this package with its pure function and its parameter model,
plus one :func:`register_rule` line in ``rules/__init__.py``. Every surface reads the
rule names and parameter models from here: YAML (``decoding.verify`` /
``decoding.verify_params``), the CLI (``--verify`` / ``--verify-param``), the Python API
and every decoding route of the Serve app (``verify`` / ``verify_params``, listed in its
``/openapi.json``).

Plugins: a rule outside the package registers itself with :func:`register_rule` in a
module named in ``$SPECLAB_PLUGINS`` (:mod:`speclab.plugins`). :func:`rules` imports the
plugin modules before it answers, and every lookup by name (:func:`get_rule`, used by
:func:`resolve_rule`, :func:`apply_rule` and :func:`request_rule`) does so when the name
is not registered yet, so the CLI, jobs, Ray workers and Serve replicas (which inherit
the variable; :func:`speclab.raylib.project_runtime_env` forwards it to a cluster) all
know the rule. Decision: the rules reuse the one generic plugin variable that the loss
and data-kind registries read, rather than a variable of their own or
``$SPECLAB_METHODS`` (which stays the method registry's): a module that registers a
method and the rule its drafts need is named in both (Python imports it once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from speclab.config.base import ConfigError, StrictModel
from speclab.decoding.host import fetch_nested
from speclab.decoding.rules.verdict import Verdict
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.tree import TokenTree
from speclab.plugins import load_plugins

#: ``fn(tree, host, sampling, generator, params) -> Verdict``: ``host`` is what the rule's
#: ``prepare`` returned, copied to the host (by default the ``[T, V]`` target logits)
RuleFn = Callable[[TokenTree, Any, SamplingParams, torch.Generator | None, Any], Verdict]
#: ``prepare(tree, target_logits [T, V], sampling, params) -> tensor or tuple of tensors``,
#: on the logits' device: the (small) part of the logits the rule reads
PrepareFn = Callable[[TokenTree, torch.Tensor, SamplingParams, Any],
                     torch.Tensor | tuple[torch.Tensor, ...]]


def _all_logits(tree, logits, sampling, params):
    return logits


class NoParams(StrictModel):
    """A rule without parameters."""


@dataclass(frozen=True)
class Rule:
    """One verification rule.

    A rule runs in two steps so that a batch of rows waits for the device ONCE
    (:mod:`speclab.decoding.host`): ``prepare`` reduces the target logits on their
    device to what the rule reads (greedy: the argmax per node), then every row's
    prepared tensors travel to the host together and ``fn`` judges the tree there. The
    default ``prepare`` hands ``fn`` the whole ``[T, V]`` logits (correct for any rule;
    a rule of a plugin may keep it).

    ``greedy_only``: defined at temperature 0 only (refused otherwise);
    ``relaxed``: changes the output distribution (not lossless), said in its name/docs.
    """

    name: str
    fn: RuleFn
    params: type[StrictModel] = NoParams
    greedy_only: bool = False
    relaxed: bool = False
    doc: str = ""
    prepare: PrepareFn = _all_logits


RULES: dict[str, Rule] = {}

def rules() -> dict[str, Rule]:
    """Every registered rule, name -> :class:`Rule` (plugin modules imported first)."""
    load_plugins()
    return dict(RULES)


def get_rule(name: str) -> Rule:
    """The rule called ``name`` (plugin modules imported first when it is not registered
    yet); ValueError naming ``verify`` if there is none."""
    if name not in RULES:
        load_plugins()
    if name not in RULES:
        raise ValueError(f"verify: must be one of {sorted(RULES)}, got {name!r}")
    return RULES[name]


def register_rule(rule: Rule) -> Rule:
    """Add ``rule`` to the registry (a name may be registered once)."""
    if rule.name in RULES and RULES[rule.name] is not rule:
        raise ValueError(f"verify: a rule named {rule.name!r} is already registered")
    RULES[rule.name] = rule
    return rule


@dataclass(frozen=True)
class RuleSpec:
    """A resolved rule request: the rule's name and its validated parameters."""

    name: str
    params: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain form (what travels between Serve deployments)."""
        return {"name": self.name, "params": dict(self.params)}

    @classmethod
    def from_dict(cls, data: dict) -> RuleSpec:
        return cls(str(data["name"]), dict(data.get("params") or {}))


def default_rule(sampling: SamplingParams) -> str:
    """``greedy`` at temperature 0, ``sample`` (lossless speculative sampling) otherwise."""
    return "greedy" if sampling.greedy else "sample"


def resolve_rule(name: str | None, params: dict | None,
                 sampling: SamplingParams) -> RuleSpec:
    """Validate a rule request (``None``: the default rule) against ``sampling``."""
    name = name or default_rule(sampling)
    rule = get_rule(name)
    if rule.greedy_only and not sampling.greedy:
        raise ValueError(f"verify: {name!r} needs temperature 0, got temperature "
                         f"{sampling.temperature} (use 'sample' or 'typical')")
    try:
        parsed = rule.params.from_dict(params or {})
    except ConfigError as err:
        raise ConfigError(f"verify_params ({name}): {err}") from None
    return RuleSpec(name, parsed.model_dump())


def apply_rule(spec: RuleSpec, tree: TokenTree, target_logits: torch.Tensor,
               sampling: SamplingParams, generator: torch.Generator | None) -> Verdict:
    """Run the rule of ``spec`` on ``tree`` (``target_logits``: ``[T, V]``, one row per
    node, on any device): prepare, ONE fetch, judge."""
    prepared = prepare_rule(spec, tree, target_logits, sampling)
    return judge_rule(spec, tree, fetch_nested([prepared])[0], sampling, generator)


def prepare_rule(spec: RuleSpec, tree: TokenTree, target_logits: torch.Tensor,
                 sampling: SamplingParams) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The rule's ``prepare`` step, on the logits' device (see :class:`Rule`)."""
    rule = get_rule(spec.name)
    return rule.prepare(tree, target_logits, sampling, rule.params(**spec.params))


def judge_rule(spec: RuleSpec, tree: TokenTree, host: Any, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
    """The rule's ``fn`` over ``host``: :func:`prepare_rule`'s output on the host."""
    rule = get_rule(spec.name)
    return rule.fn(tree, host, sampling, generator, rule.params(**spec.params))


def request_rule(requested: str | None, params: dict | None, sampling: SamplingParams,
                 needed: RuleSpec | None) -> RuleSpec:
    """The rule of one generation: the requested one, or the rule a drafter's trees need
    (``needed``, e.g. AASD's conditional verification). A request the needed rule cannot
    honour is an error naming ``verify``, never a silent swap."""
    if needed is None:
        return resolve_rule(requested, params, sampling)
    rule = get_rule(needed.name)
    if requested not in (None, needed.name, "greedy", "sample"):
        raise ValueError(f"verify: this method's drafts are verified with the {needed.name!r} "
                         f"rule ({rule.doc}); it cannot honour verify={requested!r} (leave "
                         f"verify unset, or turn the method's relaxed verification off, "
                         f"e.g. aasd: conditional=false)")
    if rule.greedy_only and not sampling.greedy:
        raise ValueError(f"verify: this method's drafts are verified with the {needed.name!r} "
                         f"rule ({rule.doc}), defined at temperature 0 only; got temperature "
                         f"{sampling.temperature} (use temperature 0, or turn the method's "
                         f"relaxed verification off, e.g. aasd: conditional=false)")
    return resolve_rule(needed.name, needed.params, sampling)
