"""A causal LM over a batch of rows, each with its own length, in one KV cache.

:class:`BatchRunner` is :class:`~speclab.decoding.runner.ModelRunner` for ``B`` sequences
at once. Every row sees its own *logical* positions ``0 .. length_b - 1`` (what a
single-row runner would hold); the shared cache stores them at *physical* slots
``slots[b]`` of a ``[B, heads, S, D]`` tensor. A forward appends the same number of
physical slots ``T`` to every row (the longest row's input; shorter rows are padded with
tokens nobody sees), so rows may process different numbers of tokens, with their own
position ids and their own tree pattern, in ONE model call. Pruning a row
(:meth:`keep`) only re-points its logical positions at the kept slots; the slots left
behind are garbage that no query attends to, and :meth:`compact` gathers the live
slots to the front once garbage takes more than half the cache (a gather, never a
recompute).

Rows can leave (:meth:`drop`) and join (:meth:`add_rows`, which prefills them as a
padded batch and merges their cache) between forwards: the shape continuous batching
needs. A row decoded here sees exactly the keys and values it would see alone, so at
temperature 0 its tokens equal the single-row engine's.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from speclab.decoding.attention import attention_layout
from speclab.decoding.features import FeatureHooks, FeatureSpec, TracksFeatures
from speclab.decoding.host import ForwardClock, inference, to_device
from speclab.decoding.tree import additive_mask


class BatchRunner(TracksFeatures):
    """Runs one HF causal LM over ``B`` rows with per-row lengths and one shared cache.

    ``calls`` counts model forwards and ``seconds`` their wall time (CUDA events on a
    GPU: no forward waits for the device).
    ``hidden`` (after :meth:`track_hidden`): ``[B, T, H]`` final hidden states of the
    last forward. Sliding-window layers get windowed masks over the position id each
    slot was written with (``slot_pos`` ``[B, S]``; :mod:`speclab.decoding.attention`).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.layout = attention_layout(model.config)  # UnsupportedModel: refused here
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache: DynamicCache | None = None
        self.slots: list[torch.Tensor] = []  # per row: [length_b] physical slot of each position
        self.width = 0  # S, physical slots per row
        self.slot_pos = torch.zeros(0, 0, dtype=torch.long)  # [B, S]: each slot's position id
        self.live = torch.zeros(0, 0, dtype=torch.bool)  # [B, S]: slot holds one of the row's
        self.calls = 0
        self.clock = ForwardClock(self.device)
        self._hook: FeatureHooks | None = None

    # ------------------------------------------------------------------ state
    @property
    def rows(self) -> int:
        """Number of rows in the batch."""
        return len(self.slots)

    def length(self, row: int) -> int:
        """Logical positions row ``row`` holds."""
        return int(self.slots[row].shape[0])

    @property
    def seconds(self) -> float:
        """Wall time of every forward so far."""
        return self.clock.seconds

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def hidden(self) -> torch.Tensor | None:
        """``[B, T, H]``: the LM head's input in the last forward (when tracked)."""
        return self.features(None)

    def features(self, spec: FeatureSpec = None) -> torch.Tensor | None:
        """``[B, T, F]``: the hidden states ``spec`` names in the last forward,
        concatenated (``spec`` must have been passed to :meth:`track_hidden`)."""
        return self._tracked(spec)

    def release(self) -> None:
        """Drop the cache, the rows and the hidden-state hook."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.release_rows()

    # ------------------------------------------------------------------ forwards
    @inference
    def forward(self, tokens: list[torch.Tensor],
                positions: list[torch.Tensor | None] | None = None,
                allowed: list[torch.Tensor | None] | None = None,
                last_only: bool = False, logits_at: list[int] | None = None) -> torch.Tensor:
        """Process ``tokens[b]`` on top of row ``b``'s cache and append them to it.

        Args:
            tokens: one ``[n_b]`` tensor of token ids per row (``n_b`` may be 0).
            positions: per row ``[n_b]`` position ids, or None: ``length_b ..`` (causal).
            allowed: per row the bool attention pattern of the new tokens, one of
                ``[n_b, length_b + n_b]`` over the row's logical positions (as
                :meth:`ModelRunner.forward` takes it); ``[n_b, n_b]`` over the new tokens
                only, each also seeing everything the row holds (a tree over a committed
                prefix); or None: causal over everything the row holds.
            last_only: compute logits at the last padded position only (a prefill whose
                logits nobody reads; tracked hidden states are kept whole).
            logits_at: per row, the one index among its new tokens whose logits are
                wanted (a drafter's catch-up over many tokens reads its last one's): the
                LM head runs at those positions only.
        Returns:
            ``[B, T, V]`` float32 logits, ``T = max n_b``; row ``b``'s are ``[b, :n_b]``
            (``[B, 1, V]`` with ``last_only``; with ``logits_at``, ``[B, 1, V]`` holding
            row ``b``'s at ``logits_at[b]``).
        """
        if len(tokens) != self.rows:
            raise ValueError(f"tokens: {len(tokens)} rows given, the batch has {self.rows}")
        self.clock.start()
        s = self.width
        n = [int(t.shape[0]) for t in tokens]
        t_new = max(max(n, default=0), 1)
        ids, pos, seen, query = batch_inputs(tokens, positions, allowed, self.slots, self.live,
                                             s, t_new, s + t_new)
        if self.cache is None:
            self.cache = preallocated_cache(self.model.config)
        if self.layout.window is None:
            mask = additive_mask(to_device(seen, self.device), self.dtype)[0, 0][:, None]
        else:
            k_pos = torch.cat([self.slot_pos, pos], dim=1)
            mask = self.layout.model_mask(seen, pos, k_pos, self.dtype, self.device)
        keep: int | torch.Tensor | None = None
        if logits_at is not None:
            at = torch.tensor(logits_at, dtype=torch.long)
            cols = torch.unique(at)  # sorted: the positions any row wants
            keep = to_device(cols, self.device)
        elif last_only:
            keep = 1 if self._hook is None else to_device(torch.tensor([t_new - 1]), self.device)
        if self._hook is not None:  # the hooks keep every position's states; the LM head
            self._hook.head_positions, keep = keep, None  # computes the wanted ones
        try:
            logits = self.call_model(to_device(ids, self.device), to_device(pos, self.device),
                                     mask, keep)
        finally:
            if self._hook is not None:
                self._hook.head_positions = None
        if logits_at is not None:
            idx = torch.searchsorted(cols, at) if logits.shape[1] == len(cols) else at
            logits = logits[torch.arange(self.rows), to_device(idx, logits.device)][:, None]
        new_slots = torch.arange(s, s + t_new)
        self.slots = [torch.cat([sl, new_slots[:nb]]) for sl, nb in zip(self.slots, n)]
        self.live = torch.cat([self.live, query], dim=1)
        self.slot_pos = torch.cat([self.slot_pos, pos], dim=1)
        self.width = s + t_new
        self.clock.stop()
        self.calls += 1
        return logits

    def call_model(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                   keep: int | torch.Tensor | None) -> torch.Tensor:
        """The model call of :meth:`forward` on its padded inputs (``ids`` / ``pos``
        ``[B, T]``, the additive ``mask``) over the cache; returns
        ``[B, T, V]`` float32 logits, or ``[B, K, V]`` at the positions ``keep`` names
        (Hugging Face's ``logits_to_keep``: an int, the last ``K``; a ``[K]`` tensor,
        those). A runner over a model with other inputs (a feature drafter) overrides it."""
        extra = {"logits_to_keep": keep} if keep is not None else {}
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask,
                         past_key_values=self.cache, use_cache=True, **extra)
        return out.logits.float()

    # ------------------------------------------------------------------ rows
    @inference
    def add_rows(self, sequences: list[list[int]], logits: bool = True,
                 **per_row: list) -> torch.Tensor | None:
        """Append rows holding ``sequences`` (prefilled in one forward per group of
        :func:`prefill_groups`, then merged into the cache, in the order given). Returns
        their ``[R, T, V]`` logits (row ``r``'s are ``[r, :len(sequences[r])]``), or None
        when ``logits`` is False (then no ``[R, T, V]`` tensor is computed). Tracked
        features read afterwards are ``[R, T, F]`` in the same order. ``per_row``: other
        inputs of :meth:`forward`, one entry per sequence (an EAGLE drafter's
        ``features``), split with the groups.

        One padded forward over prompts of very different lengths costs the longest
        prompt's tokens in every row: one 2,000-token prompt among 15 of 40 tokens took
        34 s to prefill at SmolLM2-135M in bfloat16 on 2 cores, where the groups cost
        what the real tokens cost."""
        if not sequences:
            return torch.zeros(0, 0, self.vocab_size) if logits else None
        groups = prefill_groups([len(q) for q in sequences])
        if len(groups) == 1:
            return self._add_group(sequences, logits, **per_row)
        first = self.rows
        outs, feats = [], []
        for g in groups:
            outs.append(self._add_group([sequences[i] for i in g], logits,
                                        **{k: [v[i] for i in g] for k, v in per_row.items()}))
            if self._hook is not None:
                feats.append(dict(self._hook.values))
        order = [i for g in groups for i in g]  # the row at first + p holds sequence order[p]
        back = torch.tensor(sorted(range(len(order)), key=order.__getitem__))
        self._reorder_tail(first, back)
        if self._hook is not None:
            self._hook.values = {k: _rows_in_order([f[k] for f in feats], back)
                                 for k in feats[0]}
        return _rows_in_order(outs, back) if logits else None

    @inference
    def add_empty_rows(self, k: int) -> None:
        """Append ``k`` rows that hold nothing yet: the next :meth:`forward` gives them
        their prompts (rows of length 0 take causal tokens from position 0), so a short
        prompt's prefill rides in a forward the batch runs anyway instead of one of its
        own (:meth:`speclab.decoding.row_pool.TargetPool.start` with ``ride``)."""
        if k < 1:
            return
        empty = [torch.zeros(0, dtype=torch.long) for _ in range(k)]
        if self.cache is None:  # no forward yet: every row is empty
            self.slots, self.width = self.slots + empty, 0
            self.live = torch.zeros(self.rows, 0, dtype=torch.bool)
            self.slot_pos = torch.zeros(self.rows, 0, dtype=torch.long)
            return
        kv = []
        for layer in self.cache.layers:
            shape = (k, layer.keys.shape[1], 0, layer.keys.shape[3])
            kv.append((layer.keys.new_zeros(shape), layer.values.new_zeros(
                k, layer.values.shape[1], 0, layer.values.shape[3])))
        self._append(kv, empty, torch.zeros(k, 0, dtype=torch.bool),
                     torch.zeros(k, 0, dtype=torch.long), 0)

    def _reorder_tail(self, first: int, order: torch.Tensor) -> None:
        """Row ``first + j`` takes what row ``first + order[j]`` held (``order``: ``[R]``,
        a permutation of the rows from ``first`` on), cache and all."""
        dev = to_device(order, self.device)
        for layer in self.cache.layers:
            layer.reorder_rows(first, dev)
        self.slots = self.slots[:first] + [self.slots[first + int(j)] for j in order]
        self.live[first:] = self.live[first:][order]
        self.slot_pos[first:] = self.slot_pos[first:][order]

    def _add_group(self, sequences: list[list[int]], logits: bool,
                   **per_row: list) -> torch.Tensor | None:
        """:meth:`add_rows` for sequences prefilled in ONE forward."""
        old_cache, old_slots, old_width, old_live = self.cache, self.slots, self.width, self.live
        old_pos = self.slot_pos
        self.cache, self.slots, self.width = None, [torch.zeros(0, dtype=torch.long)
                                                    for _ in sequences], 0
        self.live = torch.zeros(len(sequences), 0, dtype=torch.bool)
        self.slot_pos = torch.zeros(len(sequences), 0, dtype=torch.long)
        # rows with nothing to prefill get one hidden padding slot, so the cache exists
        out = self.forward([torch.tensor(q, dtype=torch.long) for q in sequences],
                           last_only=not logits, **per_row)
        logits = out if logits else None
        if old_cache is None or not old_slots:
            return logits
        new = ([(layer.keys, layer.values) for layer in self.cache.layers], self.slots,
               self.live, self.slot_pos, self.width)
        self.cache, self.slots, self.width = old_cache, old_slots, old_width
        self.live, self.slot_pos = old_live, old_pos
        self._append(*new)
        return logits

    def _append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], slots: list[torch.Tensor],
                live: torch.Tensor, slot_pos: torch.Tensor, width: int) -> None:
        """Append rows given as their cache (``kv``: per layer ``[R, heads, width, D]``
        keys and values), slots, ``live`` / ``slot_pos`` ``[R, width]``, to this batch's
        (which has rows and a cache)."""
        both = max(self.width, width)
        for layer, (k, v) in zip(self.cache.layers, kv, strict=True):
            layer.merge_rows(k, v, both)
        self.live = torch.cat([_pad_cols(self.live, both), _pad_cols(live, both)])
        self.slot_pos = torch.cat([_pad_cols(self.slot_pos, both), _pad_cols(slot_pos, both)])
        self.slots, self.width = self.slots + slots, both

    @inference
    def take_rows(self, other: BatchRunner, rows: list[int]) -> None:
        """Move rows ``rows`` of ``other`` (a runner over the same model) to the end of
        this batch, with their cache: a prompt prefilled in a batch of its own (chunk by
        chunk, without padding the verified rows) joins the rows that decode."""
        if not rows:
            return
        idx = to_device(torch.tensor(rows), other.device)
        kv = [(layer.keys.index_select(0, idx), layer.values.index_select(0, idx))
              for layer in other.cache.layers]
        slots = [other.slots[b] for b in rows]
        live, slot_pos, width = other.live[rows], other.slot_pos[rows], other.width
        other.drop(rows)
        if self.cache is None or not self.slots:
            self.cache = preallocated_cache(self.model.config)
            for layer, (k, v) in zip(self.cache.layers, kv, strict=True):
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
            self.slots, self.live, self.slot_pos, self.width = slots, live, slot_pos, width
        else:
            self._append(kv, slots, live, slot_pos, width)
        self.maybe_compact()

    @inference
    def drop(self, rows: list[int]) -> None:
        """Remove rows ``rows`` from the batch (their cache goes)."""
        if not rows:
            return
        gone = set(rows)
        keep = [b for b in range(self.rows) if b not in gone]
        if not keep:
            self.release_rows()
            return
        for layer in self.cache.layers:  # always PreallocatedLayer s (preallocated_cache)
            layer.select_rows(keep)
        self.slots = [self.slots[b] for b in keep]
        self.live = self.live[keep]
        self.slot_pos = self.slot_pos[keep]
        self.maybe_compact()

    def release_rows(self) -> None:
        """Drop every row and the cache (the hidden-state hook stays)."""
        self.cache, self.slots, self.width = None, [], 0
        if self._hook is not None:
            self._hook.clear()
        self.live = torch.zeros(0, 0, dtype=torch.bool)
        self.slot_pos = torch.zeros(0, 0, dtype=torch.long)

    @inference
    def keep(self, row: int, positions: list[int]) -> None:
        """Row ``row`` keeps only its logical positions ``positions`` (ascending), in order."""
        self.slots[row] = self.slots[row][torch.tensor(positions, dtype=torch.long)]
        self.live[row] = False
        self.live[row, self.slots[row]] = True

    @inference
    def crop(self, row: int, length: int) -> None:
        """Row ``row`` drops every logical position from ``length`` on."""
        self.live[row, self.slots[row][length:]] = False
        self.slots[row] = self.slots[row][:length]

    def maybe_compact(self) -> None:
        """:meth:`compact` once garbage slots outnumber the longest row's live ones."""
        longest = max((self.length(b) for b in range(self.rows)), default=0)
        if self.width > 2 * longest + 16:
            self.compact()

    @inference
    def compact(self) -> None:
        """Gather every row's live slots to the front of the cache (width = longest row)."""
        if self.cache is None or not self.slots:
            return
        width = max(max(self.length(b) for b in range(self.rows)), 1)
        idx = torch.zeros(self.rows, width, dtype=torch.long)
        for b, sl in enumerate(self.slots):
            idx[b, :sl.shape[0]] = sl
        dev_idx = to_device(idx, self.device)
        for layer in self.cache.layers:
            g = dev_idx[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, g), layer.values.gather(2, g)
        lengths = torch.tensor([sl.shape[0] for sl in self.slots])
        self.slot_pos = self.slot_pos.gather(1, idx)
        self.slots = [torch.arange(sl.shape[0]) for sl in self.slots]
        self.live = torch.arange(width)[None, :] < lengths[:, None]
        self.width = width


def batch_inputs(tokens: list[torch.Tensor], positions: list[torch.Tensor | None] | None,
                 allowed: list[torch.Tensor | None] | None, slots: list[torch.Tensor],
                 live: torch.Tensor, s: int, t_new: int, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The padded inputs of one batched forward that writes its new tokens at slots
    ``s .. s + t_new - 1`` (see :meth:`BatchRunner.forward` for ``tokens``, ``positions``
    and ``allowed``; ``slots[b]``: row ``b``'s live slots, ``live`` ``[B, >= s]`` the same
    as a bool map).

    Returns ids and position ids ``[B, t_new]`` (padding: token 0 at position 0), the
    attention pattern ``[B, t_new, width]`` over the slots, and the real (not padding)
    queries ``[B, t_new]``.
    """
    b_rows = len(tokens)
    n = torch.tensor([int(t.shape[0]) for t in tokens], dtype=torch.long)
    lengths = torch.tensor([int(sl.shape[0]) for sl in slots], dtype=torch.long)
    cols = torch.arange(t_new)
    query = cols[None, :] < n[:, None]
    ids = torch.zeros(b_rows, t_new, dtype=torch.long)
    if b_rows:
        ids[query] = torch.cat(list(tokens))
    pos = torch.where(query, lengths[:, None] + cols[None, :], 0)
    for b, p in enumerate(positions if positions is not None else ()):
        if p is not None:
            pos[b, :p.shape[0]] = p
    # every real query sees the row's live slots and, causally, the new ones
    seen = torch.zeros(b_rows, t_new, width, dtype=torch.bool)
    seen[:, :, :s] = live[:, None, :s] & query[:, :, None]
    seen[:, :, s:s + t_new] = torch.ones(t_new, t_new, dtype=torch.bool).tril() & query[:, :, None]
    # padded queries see their own slot only (a fully masked row would give NaN)
    seen[:, cols, s + cols] = True
    for b, a in enumerate(allowed if allowed is not None else ()):
        if a is None:
            continue
        nb, lb = a.shape[0], int(lengths[b])
        if a.shape[1] == nb + lb and lb:
            seen[b, :nb, :s] = False
            seen[b, :nb, slots[b]] = a[:, :lb]
        seen[b, :nb, s:s + nb] = a[:, -nb:]
    return ids, pos, seen, query


def last_indices(tokens: list[torch.Tensor]) -> list[int]:
    """Each row's last new-token index (0 for a row with none): the ``logits_at`` of a
    catch-up forward, which reads each row's last logits only."""
    return [max(int(t.shape[0]) - 1, 0) for t in tokens]


def prefill_groups(lengths: list[int], floor: int = 64) -> list[list[int]]:
    """The rows of a prefill (``lengths``: tokens per row) split so one padded forward
    per group wastes at most half its tokens on padding: longest first, a group takes
    every row at least half as long as its longest one (and, once its longest is at
    most ``floor`` tokens, every row left: short prompts cost the forward's fixed
    overhead more than their padding). Returns lists of row indices."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        top = lengths[groups[-1][0]] if groups else 0
        if groups and (2 * lengths[i] >= top or top <= floor):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _rows_in_order(parts: list[torch.Tensor], order: torch.Tensor) -> torch.Tensor:
    """``[R, T, F]``: the rows of ``parts`` (``[R_g, T_g, F]`` each, stacked in turn)
    taken in ``order``, padded with zeros to the longest ``T_g``."""
    t = max(x.shape[1] for x in parts)
    flat = torch.cat([torch.nn.functional.pad(x, (0, 0, 0, t - x.shape[1])) for x in parts])
    return flat.index_select(0, to_device(order, flat.device))


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, S]`` (bool or positions) padded with zeros (False) to ``[B, width]``."""
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1])], dim=1)


def _capacity(held: int, new: int = 0) -> int:
    """The slots a :class:`PreallocatedLayer` buffer gets when it holds ``held`` and must
    take ``new`` more: twice what it holds (at least 64), so the forwards after it write
    in place."""
    return max(2 * held, held + new, 64)


class PreallocatedLayer(DynamicLayer):
    """A cache layer whose keys and values live in a preallocated buffer
    ``[B, heads, capacity, D]``: a forward writes its new slots in place (no per-round
    reallocation of the whole cache, as concatenation costs); the buffer doubles when full.
    ``keys`` / ``values`` are the live views ``[B, heads, S, D]``; assigning them (gather,
    row drop, merge) replaces the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._len = 0

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, :self._len]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._k = value
        self._len = 0 if value is None else int(value.shape[2])

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, :self._len]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._v = value

    def select_rows(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` (ascending indices), buffer and all: each kept row's live
        slots move down in place to its new index, and the buffer becomes its first
        ``len(keep)`` rows (a view: no allocation, the spare capacity stays for the next
        forward). An ``index_select`` of the whole buffer allocated and copied every row's
        full capacity instead: 5-8 ms per leaving row at 4 rows of the reference target
        with a capacity of 800 slots, most of a step; assigning the live views' rows left
        a buffer with no spare room, and the next forward reallocated and copied it all."""
        if self._k is None:
            return
        n = self._len
        for j, b in enumerate(keep):  # ascending: a row's source is never overwritten first
            if j != b:
                self._k[j, :, :n].copy_(self._k[b, :, :n])
                self._v[j, :, :n].copy_(self._v[b, :, :n])
        self._k, self._v = self._k[:len(keep)], self._v[:len(keep)]

    def reorder_rows(self, first: int, order: torch.Tensor) -> None:
        """Row ``first + j`` takes the live slots row ``first + order[j]`` held, in place
        (``order``: ``[R]`` on the buffer's device, a permutation of the rows from
        ``first`` on)."""
        n = self._len
        for buf in (self._k, self._v):
            buf[first:, :, :n] = buf[first:, :, :n].index_select(0, order)

    def merge_rows(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
        """Append rows given as ``[R, heads, S_new, D]`` keys and values after this
        layer's, both sides zero-padded to ``width`` slots, into ONE new buffer with spare
        capacity (as :meth:`update` grows it): a concatenation left a buffer with none,
        so the first forward after every join reallocated and copied the whole cache
        again."""
        old_k, old_v, n = self._k, self._v, self._len
        rows = old_k.shape[0] + keys.shape[0]
        cap = _capacity(width)
        k = old_k.new_empty(rows, old_k.shape[1], cap, old_k.shape[3])
        v = old_v.new_empty(rows, old_v.shape[1], cap, old_v.shape[3])
        b, s = old_k.shape[0], keys.shape[2]
        for buf, old, new in ((k, old_k, keys), (v, old_v, values)):
            buf[:b, :, :n] = old[:, :, :n]
            buf[b:, :, :s] = new
            buf[:b, :, n:width] = 0.0  # padding nobody attends to, but finite
            buf[b:, :, s:width] = 0.0
        self._k, self._v, self._len = k, v, width

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, heads, T, D]`` new states after the live ones; returns the live views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self._len, key_states.shape[2]
        if self._k is None or n + t > self._k.shape[2]:
            cap = _capacity(n, t)
            k = key_states.new_empty(*key_states.shape[:2], cap, key_states.shape[3])
            v = value_states.new_empty(*value_states.shape[:2], cap, value_states.shape[3])
            if n:
                k[:, :, :n] = self._k[:, :, :n]
                v[:, :, :n] = self._v[:, :, :n]
            self._k, self._v = k, v
        self._k[:, :, n:n + t] = key_states
        self._v[:, :, n:n + t] = value_states
        self._len = n + t
        return self.keys, self.values


def preallocated_cache(config) -> DynamicCache:
    """A ``DynamicCache`` whose layers are :class:`PreallocatedLayer` s."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer() for _ in cache.layers]
    return cache
