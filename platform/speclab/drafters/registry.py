"""The method registry: every decoding method speclab offers, each from its own module.

A method is one module in ``speclab/drafters/`` holding its drafter and its config class
(a :class:`~speclab.config.method.MethodSpec` with ``name: Literal[...]``, its knobs and
``build``), plus ONE line in :data:`BUILTIN` below. From there follow: its YAML ``method:``
group (validated by name), its ``speclab generate`` flags, its ``Decoder.generate``
keywords and its Serve draft deployment. Methods can also be registered at run time
with :func:`~speclab.config.method.register` (modules named in ``$SPECLAB_METHODS`` are
imported on first use, in every process, Serve replicas included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from speclab.config.method import (
    MethodConfig,
    MethodSpec,
    method_class,
    methods,
    parse_method,
    register,
)
from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.drafting import BatchDrafter, Drafter, PerRowDrafters
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.drafters.ar import ArConfig
from speclab.drafters.chain import ChainConfig
from speclab.drafters.eagle2 import TreeConfig
from speclab.drafters.optimal import OptimalConfig, SalfConfig
from speclab.drafters.pld import AasdConfig, PldConfig
from speclab.drafters.rest import RestConfig
from speclab.families.eagle.drafter import EagleConfig
from speclab.families.medusa.drafter import MedusaConfig
from speclab.families.specdecpp.drafter import SpecDecPPConfig

BUILTIN: tuple[type[MethodSpec], ...] = (
    ArConfig, ChainConfig, TreeConfig, OptimalConfig, SalfConfig, SpecDecPPConfig,
    PldConfig, RestConfig, AasdConfig, EagleConfig, MedusaConfig,
)
for _cls in BUILTIN:
    register(_cls)


def eager_batch_runner(model: Any, eager: type[BatchRunner] = BatchRunner,
                       static: type | None = None) -> BatchRunner:
    """The batched runner without the fast path: ``eager(model)`` (``static`` unused)."""
    del static
    return eager(model)


@dataclass
class BuildContext:
    """What a method's ``build`` may use: a runner over the draft model (None when
    none is loaded), the sampling settings and rng of the sequence, ``resources``:
    things loaded once per Decoder / Serve replica (acceptance heads, datastores), and
    the target's HF config and model when the drafter runs next to the target (feature
    drafters check they were trained for it; None in a Serve draft replica), and the
    ``device`` / ``dtype`` a drafter's own weights load in (the target's in process, the
    draft replica's in Serve: feature drafters read the target's features there)."""

    draft: ModelRunner | None
    sampling: SamplingParams
    generator: torch.Generator | None = None
    resources: dict = field(default_factory=dict)
    target_config: Any = None
    target_model: Any = None
    #: the batched engine's runner over a model: ``batch_runner(model, eager=BatchRunner,
    #: static=StaticBatchRunner)``, the static class on the compiled fast path (a feature
    #: drafter names its own pair of classes)
    batch_runner: Callable[..., BatchRunner] = eager_batch_runner
    device: Any = "cpu"
    dtype: Any = torch.float32

    def make_batch_runner(self) -> BatchRunner:
        """A batched runner over the draft model (the static fast path when enabled)."""
        return self.batch_runner(self.draft.model)

    def cached(self, key: Any, load: Callable[[], Any]) -> Any:
        """``load()`` once per ``key`` for the lifetime of ``resources``."""
        if key not in self.resources:
            self.resources[key] = load()
        return self.resources[key]


def build_drafter(cfg: MethodSpec, ctx: BuildContext) -> Drafter | None:
    """The drafter of ``cfg`` for one sequence (None: plain decoding)."""
    if cfg.needs_draft_model and ctx.draft is None:
        raise ValueError(f"draft: method {cfg.name!r} needs a draft model")
    return cfg.build(ctx)


def make_batch_drafter(cfg: MethodSpec, ctx: BuildContext,
                       per_row: Callable[[torch.Generator | None], Drafter | None]
                       ) -> BatchDrafter | None:
    """The batched engine's draft side for ``cfg`` (None: plain decoding): the method's
    batched drafter when its traits say it has one (``MethodSpec.build_batch``), else one
    ``per_row(rng)`` drafter per row."""
    if cfg.needs_draft_model and ctx.draft is None:
        raise ValueError(f"draft: method {cfg.name!r} needs a draft model")
    traits = cfg.traits()
    if not traits.drafting:
        return None
    return cfg.build_batch(ctx) if traits.batched else PerRowDrafters(per_row)


__all__ = ["BUILTIN", "BuildContext", "MethodConfig", "MethodSpec", "build_drafter",
           "make_batch_drafter", "method_class", "methods", "parse_method", "register"]
