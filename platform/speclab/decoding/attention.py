"""Which keys each layer of a model may attend to: full causal attention, a sliding
window, or a mix of both (local and global layers), read from the model's config.

The runners keep every layer's keys and values (a full cache, never the rolling cache
transformers gives sliding layers, which cannot roll back a rejected draft) and hand
the model explicit masks: the tree pattern of the round (a node sees the committed
prefix and its ancestors) and, for a sliding layer, only the keys whose position is
within the window of the query's: ``q_pos - k_pos < window``, as transformers' own
sliding masks (``kv_idx > q_idx - sliding_window``). Positions are the LOGICAL
position ids the keys were written with (``prefix + depth`` for a tree node), so a
tree node's window is the one it will have once committed.

A model whose layers mix kinds gets a dict ``{"full_attention": mask,
"sliding_attention": mask}`` (what transformers' hybrid models take as a prepared
``attention_mask``); a model whose every layer slides (Mistral, Starcoder2) gets the
windowed mask alone. Layer kinds other than these two (chunked attention, linear
attention, ...) are refused by name: :func:`attention_layout` raises
:class:`UnsupportedModel` rather than decode them wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speclab.decoding.host import to_device
from speclab.decoding.tree import additive_mask

#: the layer kinds the runners honour
KINDS = ("full_attention", "sliding_attention")


class UnsupportedModel(ValueError):
    """A model the engine cannot decode correctly (the message names its type and why)."""


@dataclass(frozen=True)
class AttentionLayout:
    """A model's attention: ``window`` (None: no sliding layer) and ``layer_types`` (the
    per-layer kinds when the model mixes full and sliding layers, else None)."""

    window: int | None = None
    layer_types: tuple[str, ...] | None = None

    @property
    def mixed(self) -> bool:
        return self.window is not None and self.layer_types is not None

    def describe(self) -> str:
        """One line for reports: ``full``, ``sliding window 4096`` or ``mixed: ...``."""
        if self.window is None:
            return "full causal attention"
        if not self.mixed:
            return f"sliding window {self.window} on every layer"
        n = sum(t == "sliding_attention" for t in self.layer_types)
        return (f"{n} sliding-window ({self.window}) and {len(self.layer_types) - n} "
                f"full-attention layers")

    def model_mask(self, allowed: torch.Tensor, q_pos: torch.Tensor | None,
                   k_pos: torch.Tensor | None, dtype: torch.dtype,
                   device: torch.device | str = "cpu"
                   ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The ``attention_mask`` to hand the model.

        Args:
            allowed: ``[B, T, S]`` bool: which keys each query may see (causal / tree).
            q_pos: ``[B, T]`` position ids of the queries (needed with a window).
            k_pos: ``[B, S]`` position ids the keys were written with (likewise).
            dtype: the model's dtype (the additive mask's).
            device: where the model runs (the masks are built where the inputs are).
        Returns:
            ``[B, 1, T, S]`` additive mask on ``device``, or per layer kind for mixed
            models.
        """
        # the bool pattern travels (1 byte a key, without waiting); the additive mask is
        # built where the model runs
        allowed = to_device(allowed, torch.device(device))
        if self.window is None:
            return additive_mask(allowed, dtype)[0, 0][:, None]
        # within the window; a query's own key (distance 0) always is, so no row of the
        # mask is empty (a padded query sees its own slot)
        near = to_device((q_pos[:, :, None] - k_pos[:, None, :]) < self.window,
                         torch.device(device))
        windowed = additive_mask(allowed & near, dtype)[0, 0][:, None]
        if not self.mixed:  # every layer slides: no full-attention mask is built
            return windowed
        return {"full_attention": additive_mask(allowed, dtype)[0, 0][:, None],
                "sliding_attention": windowed}


def attention_layout(config) -> AttentionLayout:
    """The layout of a transformers config (``sliding_window``, ``use_sliding_window``,
    ``layer_types``); :class:`UnsupportedModel` for layer kinds the runners do not
    honour."""
    kind = getattr(config, "model_type", type(config).__name__)
    types = getattr(config, "layer_types", None)
    if types is not None:
        other = sorted({t for t in types if t not in KINDS})
        if other:
            raise UnsupportedModel(
                f"model type {kind!r}: layer kind(s) {other} are not supported by the "
                f"engine (it honours {list(KINDS)}); refusing rather than decode wrongly")
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False or not window:
        window = None
    if window is not None and types is not None and "sliding_attention" not in types:
        window = None  # a window configured but no layer uses it (e.g. Qwen2 defaults)
    if window is None:
        return AttentionLayout()
    if types is not None and "full_attention" in types:
        return AttentionLayout(int(window), tuple(types))
    return AttentionLayout(int(window))
