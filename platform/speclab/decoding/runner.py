"""A causal LM plus its KV cache: plain and tree-masked forwards, and pruning by gather.

The cache holds ``length`` processed positions. Tree forwards append nodes at the end of
the cache; after verification :meth:`ModelRunner.keep` gathers the positions to keep
along the sequence axis (never a recompute), :meth:`ModelRunner.crop` drops a tail.
"""

from __future__ import annotations

import bisect

import torch
from transformers import DynamicCache, PreTrainedModel

from speclab.decoding.attention import attention_layout
from speclab.decoding.features import FeatureHooks, FeatureSpec, TracksFeatures
from speclab.decoding.host import ForwardClock, inference, longs, to_device
from speclab.decoding.tree import TokenTree, additive_mask, visibility_mask


class ModelRunner(TracksFeatures):
    """Runs one HF causal LM over a single sequence with a persistent ``DynamicCache``.

    ``calls`` counts forwards and ``seconds`` their wall time (CUDA events on a GPU: no
    forward waits for the device; :class:`~speclab.decoding.host.ForwardClock`).
    A model with sliding-window layers keeps a full cache and gets explicit windowed
    masks (:mod:`speclab.decoding.attention`); ``key_pos`` ``[length]`` holds the position
    id each cached key was written with.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.layout = attention_layout(model.config)  # UnsupportedModel: refused here
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache: DynamicCache | None = None
        self.length = 0
        self.key_pos = torch.zeros(0, dtype=torch.long)
        self.calls = 0
        self.clock = ForwardClock(self.device)
        self._hook: FeatureHooks | None = None

    @property
    def hidden(self) -> torch.Tensor | None:
        """``[T, H]``: the LM head's input in the last forward (when tracked)."""
        return self.features(None)

    def features(self, spec: FeatureSpec = None) -> torch.Tensor | None:
        """``[T, F]``: the hidden states ``spec`` names in the last forward, concatenated
        (``spec`` must have been passed to :meth:`track_hidden`)."""
        out = self._tracked(spec)
        return None if out is None else out[0]

    def release(self) -> None:
        """Drop the cache and the hidden-state hooks: the model may be shared by many
        runners (one per served request), and a hook left behind would fire forever."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.cache, self.length = None, 0
        self.key_pos = torch.zeros(0, dtype=torch.long)

    @property
    def seconds(self) -> float:
        """Wall time of every forward so far."""
        return self.clock.seconds

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def reset(self) -> None:
        """Forget the cache (start a new sequence); counters are kept. Sliding layers get
        full cache layers too (transformers' rolling ones cannot roll back a draft)."""
        self.cache = DynamicCache() if self.layout.window else \
            DynamicCache(config=self.model.config)
        self.length = 0
        self.key_pos = torch.zeros(0, dtype=torch.long)

    def forward(  # no inference_mode of its own: run's covers the model call
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        allowed: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Process ``tokens`` on top of the cache and append them to it.

        Args:
            tokens: ``[T]`` token ids.
            positions: ``[T]`` position ids; default ``length .. length+T-1`` (causal).
            allowed: ``[T, length + T]`` bool attention pattern; ``None`` means causal.
            last_only: compute the last token's logits only (a prefill whose logits
                nobody reads: no ``[T, V]`` tensor), unless hidden states are tracked.
        Returns:
            ``[T, V]`` float32 logits (``[1, V]`` with ``last_only``).
        """
        extra = {"logits_to_keep": 1} if last_only and self._hook is None else {}
        return self.run(tokens, positions, allowed, **extra).logits[0].float()

    @inference
    def run(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
            allowed: torch.Tensor | None = None, **inputs):
        """:meth:`forward`'s model call, returning the model's raw output (batch of 1);
        ``inputs`` are extra model arguments (``[1, T, ...]`` tensors)."""
        if self.cache is None:
            self.reset()
        self.clock.start()
        n = tokens.shape[0]
        if positions is None:
            positions = torch.arange(self.length, self.length + n)
        positions = positions.cpu()
        mask = None
        if self.layout.window is not None:  # explicit masks: the window by position ids
            if allowed is None:
                allowed = torch.ones(n, self.length + n, dtype=torch.bool).tril(self.length)
            k_pos = torch.cat([self.key_pos, positions])
            mask = self.layout.model_mask(allowed.cpu()[None], positions[None], k_pos[None],
                                          self.dtype, self.device)
        elif allowed is not None:
            mask = additive_mask(to_device(allowed, self.device), self.dtype)
        out = self.model(
            input_ids=to_device(tokens, self.device)[None],
            position_ids=to_device(positions, self.device)[None],
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            **inputs,
        )
        self.length += n
        self.key_pos = torch.cat([self.key_pos, positions])
        self.clock.stop()
        self.calls += 1
        return out

    @inference
    def keep(self, keep: list[int]) -> None:
        """Keep only cache positions ``keep`` (ascending), in that order.

        Only the tail after the longest unchanged prefix moves (a tree round keeps the
        committed prefix and a few accepted nodes: those few are copied into place and
        the rest cropped, never the whole cache)."""
        # ascending and distinct, so keep[i] == i holds exactly up to the first move
        same = bisect.bisect_left(range(len(keep)), True, key=lambda i: keep[i] != i)
        if same < len(keep):
            src = longs(keep[same:])
            idx = to_device(src, self.device)
            for layer in self.cache.layers:
                layer.keys[..., same:len(keep), :] = layer.keys.index_select(-2, idx)
                layer.values[..., same:len(keep), :] = layer.values.index_select(-2, idx)
            self.key_pos[same:len(keep)] = self.key_pos[src]
        self.crop(len(keep))

    @inference
    def crop(self, length: int) -> None:
        """Drop every cache position from ``length`` on."""
        if length < self.length:
            self.cache.crop(length - self.length)  # crop(-n) removes n positions
        self.key_pos = self.key_pos[:length]
        self.length = length


def tree_node_inputs(length: int, tree: TokenTree, nodes: list[int], base: int,
                     slot: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor,
                                                    torch.Tensor | None]:
    """Tokens ``[n]``, positions ``[n]`` and the attention pattern ``[n, length + n]``
    (None when plainly causal) to append tree ``nodes`` to a cache of ``length``
    positions: see :func:`forward_tree_nodes`. Updates ``slot`` with the new nodes."""
    n = len(nodes)
    for row, node in enumerate(nodes):
        slot[node] = length + row
    seen: list[list[int]] = []  # per node: the cache positions of itself and its ancestors
    parents = tree.parents
    for node in nodes:
        cols = []
        while node > 0:
            cols.append(slot[node])
            node = parents[node]
        seen.append(cols)
    # one node that sees every position after the prefix (e.g. the next node of a chain)
    causal = n == 1 and set(range(base, length + 1)) <= set(seen[0])
    allowed = None if causal else visibility_mask(length + n, base, seen)
    tokens = longs([tree.tokens[i] for i in nodes])
    positions = longs([base - 1 + tree.depths[i] for i in nodes])
    return tokens, positions, allowed


def forward_tree_nodes(runner: ModelRunner, tree: TokenTree, nodes: list[int], base: int,
                       slot: dict[int, int]) -> torch.Tensor:
    """Process tree ``nodes`` in ONE forward with tree attention, appended to the cache.

    The cache holds ``base`` committed positions (the tree's root is the last of them)
    followed by nodes processed earlier; ``slot`` maps node -> cache position and is
    updated with the new nodes. Each node sees the committed prefix, its ancestors
    (earlier or in this batch; nodes must come parent-first) and itself; its position
    is ``base - 1 + depth``.

    Returns ``[len(nodes), V]`` logits (each node's distribution over its children).
    """
    return runner.forward(*tree_node_inputs(runner.length, tree, nodes, base, slot))
