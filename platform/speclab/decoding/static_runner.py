r"""The opt-in fast path: a static KV cache and a compiled forward with repeating shapes.

:class:`FastPath` holds, for one model, a preallocated cache of fixed shape
``[rows, heads, capacity, D]`` per layer and the model's forward compiled by
``torch.compile(dynamic=False)``. :class:`StaticBatchRunner` is a
:class:`~speclab.decoding.batch_runner.BatchRunner` over it: every forward is padded to
``rows`` rows and to a power-of-two number of new tokens (1, 2, 4, ... : the tree-size
buckets), and attends over the whole ``capacity`` with a mask, so the compiled graph
sees only a handful of shapes and is reused across rounds, requests and
:meth:`Decoder.generate` calls. Writes go in place to fixed addresses (on CUDA the
compiled step can then capture CUDA graphs: ``mode="reduce-overhead"``).

A logical row (what the engine calls row ``b``) lives in a physical row of the buffer;
rows that leave free their physical row, rows that join take a free one (prefilled
eagerly, then copied in). Garbage slots are reclaimed by an in-place gather when the
shared write frontier reaches ``capacity``.

Feature drafters run here too. A runner that :meth:`~StaticBatchRunner.track_hidden`\ s
makes the compiled step return the hidden states they read beside the logits (HF's
``output_hidden_states``, the indices of :mod:`speclab.decoding.features`: no hook
inside the compiled graph); a drafter whose model takes more inputs than tokens (an
EAGLE drafter's features) subclasses :class:`StaticBatchRunner` with its own
:attr:`~StaticBatchRunner.stepper`, :meth:`~StaticBatchRunner.extra_inputs` and
:meth:`~StaticBatchRunner.take_outputs`.

Cost: each new shape compiles once (about 10-30 s on a 2-core CPU); ``warmup_s``
accumulates the time of forwards that compiled. Without compiling (``compile=False``)
the same static layout runs eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from speclab.decoding.batch_runner import BatchRunner, batch_inputs
from speclab.decoding.features import FeatureSpec, concat_states, layer_ids, num_decoder_layers
from speclab.decoding.host import synchronize, to_device
from speclab.decoding.tree import additive_mask

#: a fast path's step: ``(ids [rows, T], pos [rows, T], mask [rows, 1, T, capacity],
#: *extra)`` -> ``(logits [rows, T, V], *outputs)``
Step = Callable[..., tuple[torch.Tensor, ...]]


def bucket(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1): the padded number of new tokens."""
    return 1 << max(n - 1, 0).bit_length()


class _FixedLayer(DynamicLayer):
    """A cache layer over fixed buffers: ``update`` writes the new ``[R, heads, T, D]``
    states at the slots ``positions[T]`` (set before each forward) and returns the whole
    buffers."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor,
                 positions: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.buf_k, self.buf_v, self.positions = keys, values, positions
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        at = self.positions[key_states.shape[2]]
        self.buf_k.index_copy_(2, at, key_states)
        self.buf_v.index_copy_(2, at, value_states)
        return self.buf_k, self.buf_v

    def get_seq_length(self) -> int:
        return 0


@torch.inference_mode()
def kv_shapes(model: PreTrainedModel) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per layer, the (heads, head_dim) of the keys and of the values the model caches,
    read from one probe forward of one token: a config's ``num_key_value_heads`` or
    ``head_dim`` may be absent or not used by its family (GPT-2 keeps every head)."""
    device = next(model.parameters()).device
    probe = DynamicCache()
    # a model that takes more than tokens (an EAGLE drafter) names the rest: cost_inputs
    extra = model.cost_inputs(1) if hasattr(model, "cost_inputs") else {}
    model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
          past_key_values=probe, use_cache=True, **extra)
    return [((int(layer.keys.shape[1]), int(layer.keys.shape[-1])),
             (int(layer.values.shape[1]), int(layer.values.shape[-1])))
            for layer in probe.layers]


def lm_step(model: PreTrainedModel, cache: DynamicCache, layers: tuple[int, ...] = ()
            ) -> Step:
    """A causal LM's one forward over the static ``cache``: ``[rows, T]`` ids and
    positions, ``[rows, 1, T, capacity]`` mask -> ``([rows, T, V] logits, *[rows, T, H]
    hidden states layers)``, ``layers`` indexed as in :mod:`speclab.decoding.features`
    (HF's ``output_hidden_states``: the input of decoder layer ``i``; ``L`` the LM head's
    input)."""

    def step(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor
             ) -> tuple[torch.Tensor, ...]:
        out = model(input_ids=ids, position_ids=pos, attention_mask=mask,
                    past_key_values=cache, use_cache=True, output_hidden_states=bool(layers))
        return (out.logits, *(out.hidden_states[i] for i in layers))

    return step


class FastPath:
    """A model's static cache (``rows`` x ``capacity`` slots) and its compiled step.

    One per model and batch shape, kept for the lifetime of a
    :class:`~speclab.api.Decoder` so compiled graphs are reused across calls.
    """

    def __init__(self, model: PreTrainedModel, rows: int, capacity: int = 1024,
                 compile: bool = True, mode: str | None = None,
                 stepper: Callable[..., Step] = lm_step) -> None:
        """``mode``: ``torch.compile``'s (default on CUDA: ``"reduce-overhead"``, which
        captures CUDA graphs; on CPU: the default mode). ``stepper(model, cache, layers)``
        builds the step (:func:`lm_step`; a feature drafter's runner gives its own)."""
        cfg = model.config
        self.model, self.rows, self.capacity = model, rows, capacity
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.positions: dict[int, torch.Tensor] = {}
        t = 1
        while t <= capacity:
            self.positions[t] = torch.zeros(t, dtype=torch.long, device=self.device)
            t *= 2
        shapes = kv_shapes(model)  # what each layer really caches (configs can mislead)
        self.keys = [torch.zeros(rows, h, capacity, d, dtype=self.dtype, device=self.device)
                     for (h, d), _ in shapes]
        self.values = [torch.zeros(rows, h, capacity, d, dtype=self.dtype, device=self.device)
                       for _, (h, d) in shapes]
        self.cache = DynamicCache(config=cfg)
        self.cache.layers = [_FixedLayer(k, v, self.positions)
                             for k, v in zip(self.keys, self.values, strict=True)]
        if self.device.type == "cuda":  # fixed addresses, so CUDA graphs can be captured
            for t in [*self.keys, *self.values, *self.positions.values()]:
                torch._dynamo.mark_static_address(t)
            mode = mode or "reduce-overhead"
        self.compiled, self.mode, self.stepper = compile, mode, stepper
        if compile:  # every FastPath shares the step's code: room for all their shapes
            dyn = torch._dynamo.config
            dyn.recompile_limit = max(dyn.recompile_limit, 256)
            dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 4096)
        #: the hidden states the step returns beside the logits (:meth:`track`)
        self.layers: tuple[int, ...] = ()
        self.shapes: set[tuple] = set()
        self._build()
        self.warmup_s = 0.0  # wall time of the forwards that warmed a new shape up
        #: hears of each warm-up (its seconds), e.g. to keep it out of timed figures
        self.on_warmup: Callable[[float], None] | None = None

    def _build(self) -> None:
        """The step for :attr:`layers`, compiled anew (its shapes warm up again)."""
        step = self.stepper(self.model, self.cache, self.layers)  # holds the model and
        # cache, never self: a replaced FastPath is freed at once (no cycle waiting for
        # the cyclic collector)
        self.step = (torch.compile(step, dynamic=False, mode=self.mode) if self.compiled
                     else step)
        self.shapes = set()

    def track(self, layers: tuple[int, ...]) -> None:
        """Also return the hidden states ``layers`` from now on (a feature drafter's rows
        arrived): the step is rebuilt, once, over the union of what was asked."""
        if not set(layers) <= set(self.layers):
            self.layers = tuple(sorted(set(self.layers) | set(layers)))
            self._build()

    def run(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, start: int,
            *extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """ONE forward of ``[rows, T]`` tokens written at slots ``start .. start+T-1``
        (``T`` a power of two), with the step's ``extra`` inputs; returns ``([rows, T, V]
        logits, *outputs)`` (the hidden states :attr:`layers`, or the step's own)."""
        t = ids.shape[1]
        self.positions[t].copy_(torch.arange(start, start + t, device=self.device))
        shape = (self.rows, t, *(tuple(x.shape) for x in extra))
        if self.compiled and shape not in self.shapes:
            self.warm(ids, pos, mask, *extra)
        self.shapes.add(shape)
        outs = self.step(ids, pos, mask, *extra)
        if self.compiled and self.device.type == "cuda":
            # a captured graph reuses its output buffers
            outs = tuple(o.clone() for o in outs)
        return outs

    def warm(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
             *extra: torch.Tensor) -> float:
        """Warm a new shape up before its first real forward, untimed by the runners.

        The first forward of a ``[rows, T]`` shape compiles it; on CUDA (``mode=
        "reduce-overhead"``) the next records its CUDA graph and the one after ends the
        recording (CUDA-graph trees finish a recording lazily, at the next call). They
        run one after another on the same inputs (a forward writes its keys and values
        at fixed slots, so repeating it changes nothing), timed with the device waited
        for, into :attr:`warmup_s` and :attr:`on_warmup`. Returns the seconds spent."""
        synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(3 if self.device.type == "cuda" else 1):
            self.step(ids, pos, mask, *extra)
        synchronize(self.device)
        spent = time.perf_counter() - t0
        self.warmup_s += spent
        if self.on_warmup is not None:
            self.on_warmup(spent)
        return spent


class StaticBatchRunner(BatchRunner):
    """:class:`BatchRunner` over a :class:`FastPath` (same interface and semantics).

    A subclass for a model with other inputs (a feature drafter) names its step
    (:attr:`stepper`), its eager runner for prefills (:attr:`eager`), and overrides
    :meth:`extra_inputs` / :meth:`take_outputs`."""

    #: builds the :class:`FastPath`'s step for this runner's model
    stepper: Callable[..., Step] = staticmethod(lm_step)
    #: the eager runner class that prefills new rows (:meth:`add_rows`)
    eager: type[BatchRunner] = BatchRunner

    def __init__(self, fast: FastPath) -> None:
        super().__init__(fast.model)
        self.fast = fast
        self.specs: list[FeatureSpec] = []  # what track_hidden was asked for
        self.states: dict[int, torch.Tensor] = {}  # the last forward's, logical rows
        self.phys: list[int] = []  # physical row of each logical row
        self.live = torch.zeros(fast.rows, fast.capacity, dtype=torch.bool)
        # the position id each physical slot was written with (sliding-window masks)
        self.slot_pos = torch.zeros(fast.rows, fast.capacity, dtype=torch.long)
        self.width = 0  # the write frontier, shared by all physical rows

    @property
    def capacity(self) -> int:
        return self.fast.capacity

    def track_hidden(self, spec: FeatureSpec = None) -> None:
        """Keep the final hidden states and those ``spec`` names from every forward on:
        the fast path's step returns them (no hook inside the compiled graph)."""
        top = num_decoder_layers(self.model.config)
        self.fast.track((top, *layer_ids(spec, top)))
        self.specs.append(spec)

    def _tracked(self, spec: FeatureSpec) -> torch.Tensor | None:
        if not self.specs:
            return None
        return concat_states(self.states, layer_ids(spec, num_decoder_layers(self.model.config)))

    def extra_inputs(self, phys: list[int], t_new: int) -> tuple[torch.Tensor, ...]:
        """The step's inputs beyond ids, positions and mask for this forward, over the
        physical rows (``phys[b]``: logical row ``b``'s) and ``t_new`` padded tokens: none
        for a causal LM."""
        del phys, t_new
        return ()

    def take_outputs(self, outputs: tuple[torch.Tensor, ...], idx: torch.Tensor) -> None:
        """Keep what the step returned beyond the logits (``[rows, T, ...]`` over the
        physical rows; ``idx`` selects the logical rows): the tracked hidden states."""
        self.states = {i: o.index_select(0, idx)
                       for i, o in zip(self.fast.layers, outputs, strict=True)}

    def release_rows(self) -> None:
        """Every row leaves; the static cache stays allocated for the next ones."""
        super().release_rows()
        self.phys = []
        self.live = torch.zeros(self.fast.rows, self.fast.capacity, dtype=torch.bool)
        self.slot_pos = torch.zeros(self.fast.rows, self.fast.capacity, dtype=torch.long)

    @torch.inference_mode()
    def forward(self, tokens, positions=None, allowed=None, last_only=False,
                logits_at=None) -> torch.Tensor:
        del last_only  # every position's logits: the step's shapes stay few
        if len(tokens) != self.rows:
            raise ValueError(f"tokens: {len(tokens)} rows given, the batch has {self.rows}")
        self.clock.start()
        n = [int(t.shape[0]) for t in tokens]
        t_new = bucket(max(n, default=1))
        if self.width + t_new > self.capacity:
            self.compact()
            if self.width + t_new > self.capacity:
                raise ValueError(f"capacity: {self.capacity} cache slots per row cannot hold "
                                 f"{self.width} live + {t_new} new positions")
        s, rows = self.width, self.fast.rows
        phys = torch.tensor(self.phys, dtype=torch.long)
        # the logical rows' inputs, scattered into their physical rows; free physical
        # rows are all padding (each query sees its own slot only)
        ids_l, pos_l, seen_l, _ = batch_inputs(tokens, positions, allowed, self.slots,
                                               self.live[phys], s, t_new, self.capacity)
        ids = torch.zeros(rows, t_new, dtype=torch.long)
        pos = torch.zeros(rows, t_new, dtype=torch.long)
        seen = torch.zeros(rows, t_new, self.capacity, dtype=torch.bool)
        cols = torch.arange(t_new)
        seen[:, cols, s + cols] = True
        ids[phys], pos[phys], seen[phys] = ids_l, pos_l, seen_l
        self.slot_pos[:, s:s + t_new] = pos  # padding queries: position 0 at their own slot
        if self.layout.window is None:
            mask = additive_mask(to_device(seen, self.device), self.dtype)[0, 0][:, None]
        else:
            mask = self.layout.model_mask(seen, pos, self.slot_pos, self.dtype, self.device)
        logits, *outputs = self.fast.run(to_device(ids, self.device),
                                         to_device(pos, self.device), mask, s,
                                         *self.extra_inputs(self.phys, t_new))
        idx = to_device(phys, logits.device)
        self.take_outputs(tuple(outputs), idx)
        new_slots = torch.arange(s, s + t_new)
        for b, p in enumerate(self.phys):
            self.slots[b] = torch.cat([self.slots[b], new_slots[:n[b]]])
            self.live[p, s:s + n[b]] = True
        self.width = s + t_new
        self.clock.stop()
        self.calls += 1
        logits = logits.index_select(0, idx).float()
        if logits_at is not None:  # (computed at every position: the shapes stay few)
            at = to_device(torch.tensor(logits_at, dtype=torch.long), logits.device)
            logits = logits[torch.arange(len(at), device=logits.device), at][:, None]
        return logits

    @torch.inference_mode()
    def add_rows(self, sequences: list[list[int]], logits: bool = True,
                 **per_row: list) -> torch.Tensor | None:
        """Prefill the new rows eagerly (a plain :class:`BatchRunner`; ``per_row`` as
        there), then copy their cache into free physical rows, just below the write
        frontier."""
        free = [p for p in range(self.fast.rows) if p not in self.phys]
        if len(sequences) > len(free):
            raise ValueError(f"batch_size: {len(self.phys) + len(sequences)} rows exceed the "
                             f"fast path's {self.fast.rows}")
        pre = self.eager(self.model)
        for spec in self.specs:
            pre.track_hidden(spec)
        out = pre.add_rows(sequences, logits, **per_row)
        self.take_prefill(pre)
        pre.compact()
        longest = pre.width
        if max(self.width, longest) + 1 > self.capacity:
            self.compact()
        self.width = max(self.width, longest)
        base = self.width - longest
        for r, p in enumerate(free[:len(sequences)]):
            n = pre.length(r)
            for layer, k, v in zip(pre.cache.layers, self.fast.keys, self.fast.values,
                                   strict=True):
                k[p, :, base:base + n] = layer.keys[r, :, :n]
                v[p, :, base:base + n] = layer.values[r, :, :n]
            self.live[p] = False
            self.live[p, base:base + n] = True
            self.slot_pos[p, base:base + n] = pre.slot_pos[r, :n]
            self.phys.append(p)
            self.slots.append(torch.arange(base, base + n))
        pre.release()
        return out

    def take_prefill(self, pre: BatchRunner) -> None:
        """Keep what the eager prefill ``pre`` computed beside its logits (the new rows'
        hidden states, in their order) as this runner's last forward's."""
        self.states = dict(pre._hook.values) if pre._hook is not None else {}

    @torch.inference_mode()
    def drop(self, rows: list[int]) -> None:
        gone = set(rows)
        for b in sorted(gone, reverse=True):
            self.live[self.phys[b]] = False
            self.phys.pop(b)
            self.slots.pop(b)
        if not self.phys:
            self.width = 0

    @torch.inference_mode()
    def keep(self, row: int, positions: list[int]) -> None:
        p = self.phys[row]
        self.slots[row] = self.slots[row][torch.tensor(positions, dtype=torch.long)]
        self.live[p] = False
        self.live[p, self.slots[row]] = True

    @torch.inference_mode()
    def crop(self, row: int, length: int) -> None:
        self.live[self.phys[row], self.slots[row][length:]] = False
        self.slots[row] = self.slots[row][:length]

    def maybe_compact(self) -> None:
        """Nothing: the static cache compacts only when its frontier is full."""

    @torch.inference_mode()
    def compact(self) -> None:
        """Gather every row's live slots to the front of its physical row, in place."""
        if not self.phys:
            self.width = 0
            return
        width = max(self.length(b) for b in range(self.rows))
        idx = torch.zeros(len(self.phys), max(width, 1), dtype=torch.long)
        for b, sl in enumerate(self.slots):
            idx[b, :sl.shape[0]] = sl
        phys = torch.tensor(self.phys, dtype=torch.long)
        d_idx, d_phys = to_device(idx, self.device), to_device(phys, self.device)
        for k, v in zip(self.fast.keys, self.fast.values, strict=True):
            g = d_idx[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
            k[d_phys, :, :idx.shape[1]] = k[d_phys].gather(2, g)
            v[d_phys, :, :idx.shape[1]] = v[d_phys].gather(2, g)
        self.slot_pos[phys, :idx.shape[1]] = self.slot_pos[phys].gather(1, idx)
        self.live.zero_()
        for b, p in enumerate(self.phys):
            self.live[p, :self.length(b)] = True
            self.slots[b] = torch.arange(self.length(b))
        self.width = width
