"""Which target features a feature drafter reads, and the hooks that keep them.

A feature spec names hidden states of the target by HF ``output_hidden_states`` index:
``i < L`` is the INPUT of decoder layer ``i`` (``0``: the embeddings) and ``L`` (the
number of decoder layers) the LM head's input, i.e. the last layer's output after the
final norm. Specs:

* ``None``: ``(L,)``, the last-layer feature EAGLE-1/2, HASS, TALF and Medusa read;
* a tuple of indices, e.g. EAGLE-3's low / middle / high layers: the states concatenated
  in that order, ``[T, len(spec) * H]``;
* ``"eagle3"``: EAGLE-3's default for a target of ``L`` layers, ``(2, L // 2, L - 3)``
  (the EAGLE authors' and vLLM's choice; distinct layers spread alike for ``L < 7``,
  :func:`eagle3_layers`).

:class:`FeatureHooks` registers forward pre-hooks on a target (the LM head always, the
decoder layers a spec names on request) and keeps what the last forward fed them; the
runners (:mod:`.runner`, :mod:`.batch_runner`) expose it as ``hidden`` and
``features(spec)``. Several specs can be tracked at once (a Serve target shared by an
EAGLE and an EAGLE-3 draft replica).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FeatureSpec = Any  # None | "eagle3" | tuple[int, ...]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a HF causal LM (``model.model.layers`` and its relatives);
    ``ValueError`` naming the class when it has none that speclab can find."""
    base = getattr(model, "model", None) or getattr(model, "transformer", None) or model
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is not None and isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        return decoder.layers
    raise ValueError(f"models.target: cannot find the decoder layers of "
                     f"{type(model).__name__} (needed for layer features)")


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high feature layers for a target of ``L = num_layers``
    layers: ``(2, L // 2, L - 3)`` (the EAGLE authors' and vLLM's choice) from ``L = 7`` on;
    a shallower target, where those repeat a layer (public runtimes concatenate each state
    once, in ascending order), gets three distinct layer inputs spread the same way,
    ``(1, L // 2, L - 1)`` (``(0, 1, 2)`` for ``L = 3``; the ``L + 1`` states for ``L < 3``)."""
    if num_layers >= 7:
        return (2, num_layers // 2, num_layers - 3)
    if num_layers >= 4:
        return (1, num_layers // 2, num_layers - 1)
    return tuple(range(min(num_layers + 1, 3)))


def layer_ids(spec: FeatureSpec, num_layers: int, field: str = "feature_layers"
              ) -> tuple[int, ...]:
    """The hidden-state indices a spec names for a target of ``num_layers`` layers;
    ``ValueError`` naming ``field`` for an index outside ``[0, L]`` or a bad spec."""
    if spec is None:
        return (num_layers,)
    if spec == "eagle3":
        return eagle3_layers(num_layers)
    if isinstance(spec, str) or not spec:
        raise ValueError(f"{field}: a list of layer indices or 'eagle3', got {spec!r}")
    ids = tuple(int(i) for i in spec)
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"{field}: layer indices {bad} outside [0, {num_layers}] for a "
                         f"target of {num_layers} layers")
    return ids


def num_decoder_layers(config) -> int:
    """``num_hidden_layers`` of a target's HF config (``n_layer`` for GPT-2 style)."""
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    raise ValueError(f"models.target: {type(config).__name__} names no layer count")


def _states(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def concat_states(values: dict[int, torch.Tensor], ids: tuple[int, ...]
                  ) -> torch.Tensor | None:
    """``[B, T, len(ids) * H]``: the kept hidden states ``values[i]`` (``[B, T, H]``) of
    ``ids``, concatenated in that order; None when one of them is not kept."""
    if any(i not in values for i in ids):
        return None
    parts = [values[i] for i in ids]
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


class FeatureHooks:
    """Forward pre-hooks on a target that keep its hidden states of the last forward.

    ``values[i]``: ``[B, T, H]`` hidden state ``i`` (the module docstring's indexing); the
    LM head's input (``i = L``) is always tracked, decoder-layer inputs once a spec
    :meth:`add`\\ s them. :meth:`get` concatenates a spec's states.

    ``head_positions`` (``[K]`` indices along ``T``, or None): the LM head then computes
    the logits at those positions only (``[B, K, V]``), its input kept whole. What
    ``logits_to_keep`` does without hooks, which would cut the kept input too (a
    prefill's or a catch-up's logits over SmolLM2's 49,152 tokens at every prompt
    position, for one position read)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.num_layers = num_decoder_layers(model.config)
        self.handles: dict[int, Any] = {}
        self.head_positions: torch.Tensor | None = None
        #: the last forward's concatenations, by layer ids: every row of a batch reads
        #: its own from one (16 rows re-concatenated the batch's 16 times a step)
        self._joined: dict[tuple[int, ...], torch.Tensor | None] = {}
        self.values = {}
        self._hook(self.num_layers, model.get_output_embeddings())

    @property
    def values(self) -> dict[int, torch.Tensor]:
        """The kept states of the last forward, by index."""
        return self._values

    @values.setter
    def values(self, values: dict[int, torch.Tensor]) -> None:
        self._values, self._joined = values, {}

    def _hook(self, index: int, module: nn.Module) -> None:
        def grab(_module, args, kwargs):
            self.values[index] = _states(args, kwargs).detach()
            self._joined = {}
            if index == self.num_layers and self.head_positions is not None and args:
                return (args[0][:, self.head_positions], *args[1:]), kwargs
            return None

        self.handles[index] = module.register_forward_pre_hook(grab, with_kwargs=True)

    def add(self, spec: FeatureSpec) -> None:
        """Also keep the hidden states ``spec`` names (from the next forward on)."""
        for i in layer_ids(spec, self.num_layers):
            if i not in self.handles:
                self._hook(i, decoder_layers(self.model)[i])

    def get(self, spec: FeatureSpec = None) -> torch.Tensor | None:
        """``[B, T, len(ids) * H]``: the states ``spec`` names, concatenated (None before
        the first forward)."""
        ids = layer_ids(spec, self.num_layers)
        if ids not in self._joined:
            self._joined[ids] = concat_states(self.values, ids)
        return self._joined[ids]

    def clear(self) -> None:
        """Forget the kept states (the hooks stay)."""
        self.values = {}

    def remove(self) -> None:
        """Remove every hook (a model may be shared by many runners)."""
        for handle in self.handles.values():
            handle.remove()
        self.handles, self.values = {}, {}


class TracksFeatures:
    """What both runners (:mod:`.runner`, :mod:`.batch_runner`) share: ``track_hidden``
    (install :class:`FeatureHooks` on ``self.model``) and the kept states of the last
    forward, ``[B, T, F]`` (:meth:`_tracked`). The runner sets ``_hook = None`` first."""

    model: nn.Module
    _hook: FeatureHooks | None

    def track_hidden(self, spec: FeatureSpec = None) -> None:
        """Keep every forward's final hidden states (the LM head's input; SpecDec++'s
        acceptance head, EAGLE, Medusa) and, with ``spec``, the layer states it names."""
        if self._hook is None:
            self._hook = FeatureHooks(self.model)
        self._hook.add(spec)

    def _tracked(self, spec: FeatureSpec) -> torch.Tensor | None:
        return self._hook.get(spec) if self._hook is not None else None
