"""Batched EAGLE drafting: every row's tree step in ONE drafter forward (method ``eagle``
in the batched engine and in Serve's draft replica).

:class:`BatchEagleDrafter` is the batched :class:`~speclab.families.eagle.drafter.EagleDrafter`:
the same pairs, positions and trees row by row (see that module's docstring), with the
rows' drafter forwards shared the way :class:`~speclab.drafters.batched.BatchTreeDrafter`
shares a draft LM's:

* a sync forward feeds each row the committed tokens its cache lacks, each with the
  target's feature of the position before it (queued by ``propose``'s ``features``), and
  gives every row's root distribution and root output ``f_hat``;
* each tree step expands every row's chosen nodes in one forward, a node's input
  feature being its parent's output ``f_hat`` (per row and node, kept by the node's
  logical cache position, so it survives the builders' renumbering and compaction);
* after a verdict a row's cache is cropped back to its committed pairs (the accepted
  tokens come back with the target's features), and drafting ahead on a guessed
  verdict uses the drafter's own outputs on the guessed path in their place
  (:meth:`rewind` forgets them), as the per-row drafter does.

EAGLE-3 drafters read the target's fused ``[k * H]`` features in a sync and their own
``[H]`` outputs in tree steps (and in a sync on a guessed path): a sync whose rows carry
both widths runs one forward per width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from speclab.decoding.batch_runner import BatchRunner, last_indices
from speclab.decoding.drafting import TopChildren, TreeSteps
from speclab.decoding.runner import tree_node_inputs
from speclab.decoding.static_runner import StaticBatchRunner, Step
from speclab.decoding.tree import TokenTree
from speclab.drafters.batched import BatchTreeDrafter
from speclab.families.eagle.drafter import checked_features, owed_features


class TakesFeatures:
    """What both runners over an EAGLE drafter (``model(features, input_ids, ...)``
    returning ``(f_hat, logits)``) share: :meth:`forward` takes one ``[n_b, F]`` feature
    tensor per row with the tokens, and the outputs of the last forward are
    :attr:`f_hat`. Mixed in before a :class:`BatchRunner` (eager or static)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._features: list[torch.Tensor | None] | None = None
        self.f_hat: torch.Tensor | None = None  # [B, T, H] of the last forward

    def forward(self, tokens: list[torch.Tensor],
                positions: list[torch.Tensor | None] | None = None,
                allowed: list[torch.Tensor | None] | None = None,
                last_only: bool = False,
                features: list[torch.Tensor | None] | None = None,
                logits_at: list[int] | None = None) -> torch.Tensor:
        """:meth:`BatchRunner.forward` with ``features[b]`` ``[n_b, F]`` the input feature
        of each of row ``b``'s tokens (None or absent: a row with no tokens; every row's
        must have the same width ``F``). Returns ``[B, T, V]`` float32 logits (every
        position's; ``[B, 1, V]`` at ``logits_at``, or with ``last_only`` at each row's
        last token); the outputs ``[B, T, H]`` are :attr:`f_hat` (every position's)."""
        if last_only and logits_at is None:  # a prefill: the outputs, not the logits
            logits_at = last_indices(tokens)
        self._features = features
        try:
            return super().forward(tokens, positions, allowed, last_only=False,
                                   logits_at=logits_at)
        finally:
            self._features = None


class FeatureBatchRunner(TakesFeatures, BatchRunner):
    """The eager :class:`BatchRunner` over an EAGLE drafter (:class:`TakesFeatures`)."""

    def call_model(self, ids, pos, mask, keep):
        feats = padded_features(self.model, self._features, list(range(ids.shape[0])),
                                *ids.shape, self.device)
        f_hat, logits = self.model(features=feats, input_ids=ids,
                                   position_ids=pos, attention_mask=mask,
                                   past_key_values=self.cache, use_cache=True,
                                   logits_to_keep=keep)
        self.f_hat = f_hat
        return logits.float()


def padded_features(model: torch.nn.Module, features: list[torch.Tensor | None] | None,
                    rows: list[int], batch: int, t: int, device) -> torch.Tensor:
    """``[batch, t, F]`` float32 on ``device``: ``features[b]`` (``[n_b, F]``, None or
    empty for a row with no tokens) at ``[rows[b], :n_b]``, zeros elsewhere; ``F`` the
    rows' one feature width (the drafter's own ``H`` when no row carries any). Built on
    the device: a tree step's features are the drafter's own outputs, already there, so
    copying them costs no wait for the device."""
    widths = {int(f.shape[-1]) for f in features or () if f is not None and len(f)}
    if len(widths) > 1:
        raise ValueError(f"eagle: one forward's rows carry features of widths "
                         f"{sorted(widths)}")
    width = widths.pop() if widths else int(model.meta.hidden_size)
    feats = torch.zeros(batch, t, width, device=device)
    for b, f in enumerate(features or ()):
        if f is not None and len(f):
            feats[rows[b], :f.shape[0]] = f.to(device, torch.float32)
    return feats


def eagle_step(model: torch.nn.Module, cache, layers: tuple[int, ...] = ()) -> Step:
    """An EAGLE drafter's fast-path step (:class:`~speclab.decoding.static_runner.FastPath`):
    ``(ids, pos [rows, T], mask [rows, 1, T, capacity], features [rows, T, F])`` ->
    ``(logits [rows, T, V], f_hat [rows, T, H])``. ``layers`` must be empty (a drafter
    exposes no target features)."""
    if layers:
        raise ValueError("eagle: an EAGLE drafter's runner keeps no hidden states")

    def step(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
             feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f_hat, logits = model(features=feats, input_ids=ids, position_ids=pos,
                              attention_mask=mask, past_key_values=cache, use_cache=True)
        return logits, f_hat

    return step


class StaticFeatureBatchRunner(TakesFeatures, StaticBatchRunner):
    """:class:`FeatureBatchRunner` on the static, compiled fast path (``Decoder(...,
    compile=True)``, a :class:`~speclab.decoding.static_runner.FastPath` built with
    :func:`eagle_step`): the same :meth:`forward` with ``features`` (``T`` padded to a
    power of two), the outputs kept as :attr:`f_hat`; new rows are prefilled by a
    :class:`FeatureBatchRunner`."""

    stepper = staticmethod(eagle_step)
    eager = FeatureBatchRunner

    def extra_inputs(self, phys: list[int], t_new: int) -> tuple[torch.Tensor, ...]:
        return (padded_features(self.model, self._features, phys, self.fast.rows, t_new,
                                self.device),)

    def take_outputs(self, outputs: tuple[torch.Tensor, ...], idx: torch.Tensor) -> None:
        self.f_hat = outputs[0].index_select(0, idx)

    def take_prefill(self, pre: BatchRunner) -> None:
        self.f_hat = pre.f_hat


class BatchEagleDrafter(BatchTreeDrafter):
    """EAGLE-2 / optimal / SALF trees from an EAGLE drafter for many rows (module
    docstring). ``steps`` builds one row's tree as a generator (as for
    :class:`BatchTreeDrafter`), ``k`` children are read per expanded node."""

    def __init__(self, model: torch.nn.Module, steps: Callable[[int, TopChildren, int, int],
                                                               TreeSteps],
                 k: int, score_temperature: float = 1.0,
                 runner: FeatureBatchRunner | StaticFeatureBatchRunner | None = None) -> None:
        """``runner``: the drafter's batched runner (default: an eager
        :class:`FeatureBatchRunner`; the compiled fast path's :class:`StaticFeatureBatchRunner`)."""
        super().__init__(runner or FeatureBatchRunner(model), "eagle", steps, k,
                         score_temperature)
        self.width = int(model.meta.feature_width)  # the target's features: H or k * H
        #: per row: the target features ``[c, F]`` owed, in the chunks that came (a row
        #: waiting for its first draft collects one per step; joined when read)
        self.pending: list[list[torch.Tensor]] = []
        self.f_hat: list[dict[int, torch.Tensor]] = []  # per row: logical position -> [H]
        self.guess: list[list[torch.Tensor] | None] = []  # per row: own outputs on a path

    def join(self, prompts, generators, prefill_tops, features) -> None:
        """New rows with their prompts' features; the pairs wait for the rows' first
        draft (:meth:`prefill`)."""
        del prefill_tops
        for p, g, f in zip(prompts, generators, features, strict=True):
            self.committed.append(list(p))
            self.generators.append(g)
            self.last.append(None)
            self.base.append(0)
            self.slots.append({})
            self.pending.append([])
            self.f_hat.append({})
            self.guess.append(None)
            self.observe(len(self.committed) - 1, f)

    def prefill(self, rows: list[int]) -> None:
        """Feed waiting rows ``rows`` their committed pairs (token ``i + 1`` with the
        target's feature ``i``), all but the last, which the first :meth:`sync` feeds for
        the root's logits. :meth:`BatchRunner.add_rows` prefills rows of similar lengths
        together, where a first sync over whole prompts padded every row to the longest
        (16 ShareGPT prompts of 35 to 1,465 tokens: 0.8 s of EAGLE-3 on SmolLM2, mostly
        padding)."""
        owed = [self.owed(b) for b in rows]
        ready = [max(min(len(self.committed[b]) - 1, len(f)) - 1, 0)
                 for b, f in zip(rows, owed, strict=True)]
        self.runner.add_rows([list(self.committed[b][1:1 + k]) for b, k in zip(rows, ready,
                                                                                strict=True)],
                             logits=False,
                             features=[f[:k] for f, k in zip(owed, ready, strict=True)])
        for b, f, k in zip(rows, owed, ready, strict=True):
            self.pending[b] = [f[k:]]

    def owed(self, b: int) -> torch.Tensor:
        """Row ``b``'s queued target features ``[c, F]`` as one tensor (kept so)."""
        chunks = self.pending[b]
        out = (chunks[0] if len(chunks) == 1 else torch.cat(chunks) if chunks
               else torch.zeros(0, self.width))
        self.pending[b] = [out] if len(out) else []
        return out

    def drop(self, rows: list[int]) -> None:
        super().drop(rows)
        for b in sorted(rows, reverse=True):
            for state in (self.pending, self.f_hat, self.guess):
                state.pop(b)

    def observe(self, b: int, features: torch.Tensor | None) -> None:
        """Queue the target's features ``[n, F]`` of row ``b``'s next committed positions."""
        if features is not None and len(features):
            self.pending[b].append(checked_features(features, self.width))

    def rewind(self, row: int, keep: int) -> None:
        """Keep row ``row``'s pairs of its first ``keep`` committed tokens (at most
        ``keep - 1``) and the target features still owed for them; what was drafted on
        the drafter's own outputs (drafting ahead) goes."""
        runner, held = self.runner, row < self.held
        if held:
            runner.crop(row, min(runner.length(row), max(keep - 1, 0)))
        length = runner.length(row) if held else 0
        self.pending[row] = [self.owed(row)[:max(keep - 1 - length, 0)]]
        self.committed[row] = self.committed[row][:keep]
        self.last[row], self.guess[row], self.f_hat[row] = None, None, {}
        self.base[row], self.slots[row] = length, {}

    def accept(self, paths: list[list[int] | None]) -> None:
        """Crop each verified row to its committed pairs; keep the drafter's own outputs
        at the root and the accepted path's inner nodes (a guessed verdict's features)."""
        for b, (tree, path) in enumerate(zip(self.last, paths, strict=True)):
            if tree is None or path is None:
                continue
            self.runner.crop(b, self.base[b])
            pos = [self.slots[b].get(node) for node in (0, *path[1:-1])]
            own = [self.f_hat[b].get(p) for p in pos]
            self.guess[b] = None if any(f is None for f in own) else own

    def bare_tree(self, b: int) -> TokenTree | None:
        """Row ``b``'s root alone when it has no target feature yet (a 1-token prompt:
        the target goes first), else None (it drafts, on :meth:`_inputs`)."""
        if self._inputs(b) is not None:
            return None
        self.f_hat[b], self.slots[b] = {}, {}
        return TokenTree(self.committed[b][-1])

    def _inputs(self, b: int) -> torch.Tensor | None:
        """Row ``b``'s features for the committed tokens its cache lacks: the target's,
        or on a guessed path the drafter's own outputs; None when it has none yet (a
        1-token prompt: the target goes first)."""
        guess, self.guess[b] = self.guess[b], None
        owed = owed_features(self.owed(b), guess, len(self.committed[b]),
                             self.runner.length(b))
        self.pending[b] = [owed] if len(owed) else []
        return owed if len(owed) else None

    def sync(self, rows: list[int]) -> torch.Tensor:
        """Feed rows ``rows`` their owed pairs (one forward per feature width, usually
        one); returns their ``[len(rows), V]`` root logits."""
        by_width: dict[int, list[int]] = {}
        for b in rows:
            by_width.setdefault(int(self.owed(b).shape[-1]), []).append(b)
        roots: dict[int, torch.Tensor] = {}
        for group in by_width.values():
            tokens = [torch.zeros(0, dtype=torch.long) for _ in range(self.runner.rows)]
            features: list[torch.Tensor | None] = [None] * self.runner.rows
            for b in group:
                m, n = self.runner.length(b), len(self.committed[b])
                tokens[b] = torch.tensor(self.committed[b][m + 1:n], dtype=torch.long)
                features[b] = self.owed(b)
            last = last_indices(tokens)
            logits = self.runner.forward(tokens, features=features, logits_at=last)
            for b in group:
                roots[b] = logits[b, 0]
                self.pending[b] = []
                self.base[b] = self.runner.length(b)
                self.slots[b] = {0: self.base[b] - 1}
                self.f_hat[b] = {self.base[b] - 1: self.runner.f_hat[b, last[b]]}
        return torch.stack([roots[b] for b in rows])

    def expand(self, requests: dict[int, tuple[TokenTree, list[int]]]) -> dict[int, torch.Tensor]:
        """Expand ``requests[b] = (tree, nodes)`` of several rows in ONE forward, each
        node fed its parent's output; returns ``{b: [len(nodes), V] logits}``."""
        rows = self.runner.rows
        tokens = [torch.zeros(0, dtype=torch.long) for _ in range(rows)]
        positions: list[torch.Tensor | None] = [None] * rows
        allowed: list[torch.Tensor | None] = [None] * rows
        features: list[torch.Tensor | None] = [None] * rows
        for b, (tree, nodes) in requests.items():
            features[b] = torch.stack([self.f_hat[b][self.slots[b][tree.parents[i]]]
                                       for i in nodes])
            tokens[b], positions[b], allowed[b] = tree_node_inputs(
                self.runner.length(b), tree, nodes, self.base[b], self.slots[b])
        logits = self.runner.forward(tokens, positions, allowed, features=features)
        for b, (_tree, nodes) in requests.items():
            for j, node in enumerate(nodes):
                self.f_hat[b][self.slots[b][node]] = self.runner.f_hat[b, j]
        return {b: logits[b, :len(nodes)] for b, (_tree, nodes) in requests.items()}
