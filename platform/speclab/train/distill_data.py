"""What distillation losses need from the target, computed with the engine (no Ray).

One function per example kind; each returns a plain dict of lists (a Parquet row):

* :func:`kd_example` — a corpus window and the target's top-k next-token distribution at
  every position (``word_kd``, ``tvd_kd``, ``hass_topk``; ``sft`` uses the window only);
* :func:`feat_example` — a corpus window, the target's last-layer features and its top-k
  at every position (the EAGLE feature drafter, :mod:`speclab.families.eagle.training`); with
  ``eagle.data: target`` the feature kinds' windows are first rewritten as the target's
  own text (:func:`target_windows`);
* :func:`feat_forest_example` — a ``feat`` window plus a target-built beam tree rooted at
  every position (TALF on the EAGLE drafter, :func:`speclab.families.eagle.training.talf_loss`);
* :func:`seq_examples` — prompts and the target's greedy continuation (``seq_kd``);
* :func:`medusa_examples` — :func:`feat_example` windows over prompts and the target's
  greedy continuations, decoded in batches (self-distillation data for Medusa heads,
  :mod:`speclab.families.medusa.training`);
* :func:`tree_example` — a context and a target-built EAGLE-2 draft tree (top-k children,
  depth d, as in TALF Algorithm 1) with the target's top-k distribution at every node
  (``talf``);
* :func:`accept_example` — a prompt, the target's response ``X``, a draft token ``Y_i`` per
  position and its acceptance probability ``P_i`` (SpecDec++ section 3.3; the
  acceptance head, needs the drafter too); :func:`accept_examples` for a chunk, its greedy
  responses decoded in batches.

Top-k entries are stored with the target's own probabilities, not renormalised (k from
the config bounds disk use instead of storing the full vocabulary): HASS's top-K loss
weighs by the true ``p``, and the losses that need a distribution renormalise themselves
(:mod:`speclab.losses`).

Data kinds: each kind of signal is ONE registry entry, :class:`DataKind` (the length of
its inputs and how a generation actor turns a chunk of inputs into rows), so the
generation stage (:mod:`speclab.pipelines.signals`) looks kinds up instead of
dispatching on their names. The built-ins (``kd``, ``seq``, ``tree``, ``accept``,
``feat``, ``feat_tree``, ``medusa``) are registered at the end of this module;
:func:`register_data_kind` adds one from a plugin module (``$SPECLAB_PLUGINS``, see
:mod:`speclab.plugins`), and a loss names the kind it needs (:class:`speclab.losses.Loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from speclab.decoding.batch_loop import generate_batch, new_rows
from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.loop import autoregressive_generate
from speclab.decoding.row_pool import TargetPool
from speclab.decoding.rules import resolve_rule
from speclab.decoding.runner import ModelRunner, forward_tree_nodes
from speclab.decoding.sampling import SamplingParams, draw, warp_probs
from speclab.drafters.eagle2 import build_eagle2_tree
from speclab.families.eagle.training import encode_features
from speclab.plugins import load_plugins


def _topk(logits: torch.Tensor, k: int) -> tuple[list, list]:
    """``logits [N, V]`` -> (ids ``[N][k]``, the target's probabilities there ``[N][k]``)."""
    probs, ids = torch.topk(logits.float().softmax(-1), k, dim=-1)
    return ids.tolist(), probs.tolist()


def kd_example(target: ModelRunner, window: list[int], k: int) -> dict:
    """``window`` of L+1 tokens: inputs ``window[:L]`` and target top-k at each input."""
    target.reset()
    logits = target.forward(torch.tensor(window[:-1], dtype=torch.long))  # [L, V]
    ids, probs = _topk(logits, k)
    return {"tokens": window, "topk_ids": ids, "topk_probs": probs}


def feat_example(target: ModelRunner, window: list[int], k: int, spec=None) -> dict:
    """``window`` of L+1 tokens: the target's features ``[L, F]`` (float16 bytes) and
    top-k at each of the inputs ``window[:L]``. ``spec``: which features
    (:mod:`speclab.decoding.features`; None: the last layer's, ``F = H``; EAGLE-3's
    fused layers: ``F = k * H``)."""
    row, _ = _feat_forward(target, window, k, spec)
    return row


def _feat_forward(target: ModelRunner, window: list[int], k: int, spec=None
                  ) -> tuple[dict, torch.Tensor]:
    """:func:`feat_example`'s row and the target's logits ``[L, V]`` (the cache then holds
    the ``L`` inputs)."""
    target.track_hidden(spec)
    target.reset()
    logits = target.forward(torch.tensor(window[:-1], dtype=torch.long))  # [L, V]
    ids, probs = _topk(logits, k)
    feats = target.features(spec)
    return {"tokens": window, "features": encode_features(feats),
            "hidden": int(feats.shape[-1]), "topk_ids": ids,
            "topk_probs": probs}, logits


def feat_forest_example(target: ModelRunner, window: list[int], k: int, top_k: int,
                        depth: int, spec=None, roots: int = 0,
                        generator: torch.Generator | None = None) -> dict:
    """A :func:`feat_example` plus, for TALF (SALF & TALF, Algorithm 1), a tree built by
    the target rooted at EVERY input ``x_r``, ``r = 1..L-1`` (``R = L - 1`` roots), or,
    with ``roots`` ``n`` in ``(0, L - 1)``, at ``n`` of them drawn uniformly at random
    (``generator``), stored ascending as ``forest_roots`` (int32 bytes ``[R]``: each root's
    pair index ``r - 1``). A tree depends only on its root's prefix, so a drawn root's
    tree is the one the full forest holds there, at ``n / (L - 1)`` of the cost: the
    target's tree forwards are ``R * top_k`` tokens each (on SmolLM2 a window of 256 with
    every root cost about 12 s on 2 cores).

    Each tree is EAGLE-2's beam (the method the TALF paper trains with): depth 1 holds
    the root's ``top_k`` most probable children; depth ``d`` the ``top_k`` children of
    depth ``d - 1`` nodes with the highest path probability. All ``R`` trees of a depth
    go through the target in ONE forward with tree attention over the window's cache (a
    node sees ``x_0..x_r`` and its ancestors), so a window costs ``depth`` extra
    forwards. Stored (bytes, shapes ``[R, depth, top_k]``): ``forest_tokens`` (int32),
    ``forest_parents`` (int8: the parent's beam slot at ``d - 1``; -1 at depth 1 = the
    root) and the target's top-``k`` distribution after each node, ``forest_ids`` (int32)
    and ``forest_probs`` (float16), ``[R, depth, top_k, k]``.
    """
    row, logits = _feat_forward(target, window, k, spec)
    length = len(window) - 1
    at = torch.arange(1, length)  # the roots' input positions
    if 0 < roots < length - 1:
        at = at[torch.randperm(length - 1, generator=generator)[:roots].sort().values]
        row["forest_roots"] = (at - 1).to(torch.int32).numpy().tobytes()
    n_roots = len(at)
    logp = torch.log_softmax(logits[at].float(), -1)  # [R, V] after each root
    # per-root ancestry: allowed cache columns of every beam slot, grown depth by depth
    seen = torch.zeros(n_roots, 1, length, dtype=torch.bool)
    seen[:, 0] = torch.arange(length)[None, :] <= at[:, None]  # x_0..x_r
    score = torch.zeros(n_roots, 1)  # path log-probability of each beam slot
    toks, pars, ids, probs = [], [], [], []
    for d in range(1, depth + 1):
        width = logp.shape[1] if logp.ndim == 3 else 1
        cand = (score[..., None] + logp.view(n_roots, width, -1)).view(n_roots, -1)
        best, flat = cand.topk(top_k, dim=-1)  # [R, top_k]
        vocab = logp.shape[-1]
        parent, token = flat // vocab, flat % vocab
        n_new = n_roots * top_k
        cols = target.length
        allowed = torch.zeros(n_new, cols + n_new, dtype=torch.bool)
        rows = seen.gather(1, parent[..., None].expand(-1, -1, seen.shape[-1]))  # [R, k, C]
        allowed[:, : rows.shape[-1]] = rows.reshape(n_new, -1)
        allowed[torch.arange(n_new), cols + torch.arange(n_new)] = True
        positions = (at[:, None] + d).expand(-1, top_k).reshape(-1)
        out = target.forward(token.reshape(-1), positions, allowed)  # [R*k, V]
        seen = allowed.view(n_roots, top_k, -1)
        score = best
        logp = torch.log_softmax(out.float(), -1).view(n_roots, top_k, -1)
        toks.append(token)
        pars.append(parent if d > 1 else torch.full_like(parent, -1))
        p, i = torch.topk(out.float().softmax(-1), k, dim=-1)
        ids.append(i.view(n_roots, top_k, k))
        probs.append(p.view(n_roots, top_k, k))
    return {**row, "forest_shape": [n_roots, depth, top_k, k],
            "forest_tokens": torch.stack(toks, 1).to(torch.int32).numpy().tobytes(),
            "forest_parents": torch.stack(pars, 1).to(torch.int8).numpy().tobytes(),
            "forest_ids": torch.stack(ids, 1).to(torch.int32).numpy().tobytes(),
            "forest_probs": torch.stack(probs, 1).to(torch.float16).numpy().tobytes()}


def seq_examples(target: ModelRunner, prompts: list[list[int]], response_len: int,
                 eos: int | None, batch: int = 16) -> list[dict]:
    """Each prompt + the target's greedy continuation (up to ``response_len`` tokens or
    EOS); ``loss_from`` marks the response start. Decoded ``batch`` rows at a time by the
    batched engine (each row equals the prompt decoded alone)."""
    outs = greedy_continuations(target, prompts, response_len, eos, batch)
    return [{"tokens": p + o, "loss_from": len(p)} for p, o in zip(prompts, outs, strict=True)]


def greedy_continuations(target: ModelRunner, prompts: list[list[int]], response_len: int,
                         eos: int | None, batch: int) -> list[list[int]]:
    """The target's greedy continuations of ``prompts`` (batched engine, plain decoding,
    ``batch`` rows at a time; ``eos`` None: always ``response_len`` tokens)."""
    if not prompts:
        return []
    params = SamplingParams(0.0)
    side = TargetPool(BatchRunner(target.model))
    outs, _, _ = generate_batch(side, None, new_rows(prompts, params,
                                                     resolve_rule(None, None, params)),
                                response_len, batch, eos)
    return outs


@torch.no_grad()
def medusa_examples(target: ModelRunner, prompts: list[list[int]], response_len: int, k: int,
                    batch: int = 64) -> list[dict]:
    """Each prompt + the target's greedy continuation of exactly ``response_len`` tokens
    (EOS does not stop it, so rows have one length) as a :func:`feat_example` window: the
    target's features and top-k at every input of ``prompt + continuation``.

    The continuations come from the batched engine, ``batch`` rows at a time (the cheap
    way to make self-distillation data); the feature pass needs prompts of one length per
    ``batch`` (the corpus windows are)."""
    model = target.model
    device = next(model.parameters()).device
    outs = greedy_continuations(target, prompts, response_len, None, batch)
    rows: list[dict] = []
    for start in range(0, len(prompts), batch):
        window = torch.tensor([p + o for p, o in zip(prompts[start: start + batch],
                                                     outs[start: start + batch], strict=True)],
                              dtype=torch.long, device=device)  # [B, P + R]
        hidden = model.model(input_ids=window[:, :-1]).last_hidden_state  # [B, L, H]
        probs, top = torch.topk(model.lm_head(hidden).float().softmax(-1), k, dim=-1)
        for b in range(window.shape[0]):
            rows.append({"tokens": window[b].tolist(), "features": encode_features(hidden[b]),
                         "hidden": int(hidden.shape[-1]), "topk_ids": top[b].tolist(),
                         "topk_probs": probs[b].tolist()})
    return rows


def tree_example(target: ModelRunner, context: list[int], top_k: int, depth: int, nodes: int,
                 k: int) -> dict:
    """A target-built tree rooted at ``context[-1]`` and the target's top-k at every node."""
    target.reset()
    root_logits = target.forward(torch.tensor(context, dtype=torch.long))[-1]
    base = target.length
    slot: dict[int, int] = {}
    tree, _ = build_eagle2_tree(
        context[-1], root_logits.softmax(-1),
        lambda t, ids: forward_tree_nodes(target, t, ids, base, slot).softmax(-1),
        top_k, depth, nodes)
    # the kept tree's own distributions (leaves included) in one forward over the context
    target.crop(base)
    kept = list(range(1, len(tree)))
    node_logits = forward_tree_nodes(target, tree, kept, base, {}) if kept else root_logits[:0]
    ids, probs = _topk(torch.cat([root_logits[None], node_logits]), k)
    return {"tokens": context, "tree_tokens": tree.tokens, "tree_parents": tree.parents,
            "topk_ids": ids, "topk_probs": probs}


def accept_example(target: ModelRunner, draft: ModelRunner, prompt: list[int],
                   response_len: int, temperature: float, seed: int,
                   eos: int | None, response: list[int] | None = None) -> dict:
    """SpecDec++ training data for one prompt (section 3.3).

    ``x``: the target's response (greedy at ``temperature == 0``, else sampled; given as
    ``response`` when already generated, e.g. batched by :func:`accept_examples`);
    ``y[i]``: the drafter's token at position i given ``prompt + x[:i]`` (its argmax, or
    a sample from ``q_i``); ``p[i]``: P(y_i accepted) = ``1[y_i == argmax p_i]`` (greedy)
    or ``min(1, p_i(y_i) / q_i(y_i))`` with both distributions warped by ``temperature``.
    """
    params = SamplingParams(temperature)
    g = torch.Generator().manual_seed(seed)
    if response is None:
        x, _ = autoregressive_generate(target, prompt, response_len, params, eos, g)
    else:
        x = list(response)
    seq = torch.tensor(prompt + x, dtype=torch.long)
    rows = slice(len(prompt) - 1, len(prompt) - 1 + len(x))  # positions predicting x
    target.reset()
    draft.reset()
    p_logits, q_logits = target.forward(seq)[rows], draft.forward(seq)[rows]  # [N, V]
    if params.greedy:
        y = q_logits.argmax(-1)
        acc = (y == p_logits.argmax(-1)).float()
    else:
        p, q = warp_probs(p_logits, params), warp_probs(q_logits, params)
        y = draw(q, 1, g)[:, 0]
        ratio = p.gather(1, y[:, None])[:, 0] / q.gather(1, y[:, None])[:, 0].clamp_min(1e-30)
        acc = ratio.clamp(max=1.0)
    return {"prompt": prompt, "x": x, "y": y.tolist(), "p": acc.tolist()}


# --- the registry of data kinds (the signals the target generates) ---


@dataclass
class SignalContext:
    """What a data kind's ``make`` gets on a generation actor: the target (and drafter)
    replicas, the job's ``distill`` group and the other settings kinds read."""

    target: ModelRunner
    draft: ModelRunner | None
    eos: int | None
    distill: Any  # speclab.config.schema.DistillConfig
    seed: int  # train.seed
    eagle: Any = None  # the job's ``eagle`` group, where it has one (feat_tree trees)
    head_temperature: float = 0.0  # the temperature an acceptance head is trained for


@dataclass(frozen=True)
class DataKind:
    """One kind of target signal, written to ``<data>/<name>/shard-NNNNN.parquet``.

    ``input_len(distill)``: tokens of each input (a corpus window, prompt or context cut
    from the corpus); ``make(ctx, inputs, first)``: the rows (one per input, in order) of
    a chunk of inputs whose first is example number ``first``; ``needs_draft``: ``make``
    uses ``ctx.draft`` (the job must pass a drafter); ``settings(eagle)``: the job settings
    the rows depend on, stamped into the shards' plan (shards made otherwise are refused);
    ``draw``: kinds naming the same draw cut the same inputs from the corpus."""

    name: str
    input_len: Callable[[Any], int]
    make: Callable[[SignalContext, list[list[int]], int], list[dict]]
    needs_draft: bool = False
    doc: str = ""
    settings: Callable[[Any], dict] | None = None  # job's eagle group -> the plan's extras
    #: kinds of one draw cut the same inputs (same seed; None: a draw of its own)
    draw: str | None = None


_DATA_KINDS: dict[str, DataKind] = {}


def register_data_kind(kind: DataKind) -> DataKind:
    """Add ``kind`` to the registry (a name may be registered once; the same definition
    imported again replaces itself)."""
    old = _DATA_KINDS.get(kind.name)
    if old is not None and (old.make.__module__, old.make.__qualname__) != (
            kind.make.__module__, kind.make.__qualname__):
        raise ValueError(f"data kind: {kind.name!r} is already registered")
    _DATA_KINDS[kind.name] = kind
    return kind


def data_kind(name: str) -> DataKind:
    """The registry entry of data kind ``name`` (plugins loaded first); ``ValueError``
    listing the known kinds."""
    load_plugins()
    if name not in _DATA_KINDS:
        raise ValueError(f"data kind: unknown kind {name!r}; known: {sorted(_DATA_KINDS)}")
    return _DATA_KINDS[name]


def _window(d) -> int:
    return d.seq_len + 1


def _prompt(d) -> int:
    return d.prompt_len


def _context(d) -> int:
    return d.context_len


def _make_kd(ctx: SignalContext, inputs: list[list[int]], first: int) -> list[dict]:
    return [kd_example(ctx.target, x, ctx.distill.top_k) for x in inputs]


def target_windows(target: ModelRunner, windows: list[list[int]], keep: int,
                   batch: int = 64) -> list[list[int]]:
    """``windows`` (each ``L + 1`` tokens) rewritten as the target's own text: each keeps
    its first ``keep`` tokens and the target continues them greedily to ``L + 1`` tokens
    (past EOS, so every window keeps its length; batched engine, ``batch`` rows at a
    time). ``eagle.data: target``, the data EAGLE-3 trainers regenerate with the
    target."""
    if not windows:
        return []
    if not 0 < keep < len(windows[0]) - 1:
        raise ValueError(f"eagle.data_prompt ({keep}) must be in [1, {len(windows[0]) - 2}] "
                         f"for windows of {len(windows[0])} tokens")
    prompts = [w[:keep] for w in windows]
    outs = greedy_continuations(target, prompts, len(windows[0]) - keep, None, batch)
    return [p + o for p, o in zip(prompts, outs, strict=True)]


def _target_data(eagle) -> bool:
    """Whether feature windows are the target's own text (``eagle.data: target``)."""
    return eagle is not None and getattr(eagle, "data", "corpus") == "target"


def _feat_windows(ctx: SignalContext, inputs: list[list[int]]) -> list[list[int]]:
    """The windows a feature kind's rows hold: the corpus's, or (``eagle.data: target``)
    the target's continuations of their first ``eagle.data_prompt`` tokens."""
    if not _target_data(ctx.eagle):
        return inputs
    return target_windows(ctx.target, inputs, ctx.eagle.data_prompt)


def _data_settings(eagle) -> dict:
    """The plan's record of ``eagle.data`` (nothing for corpus windows, so the plans of
    shards made before the setting existed still match)."""
    if not _target_data(eagle):
        return {}
    return {"data": eagle.data, "data_prompt": eagle.data_prompt}


def _tree_settings(eagle) -> dict:
    """The plan's record of the target-built trees' shape (``eagle.talf_top_k`` /
    ``talf_depth``: they change every row; ``talf_data_roots`` where set, so the plans of
    shards made before it existed still match) and of ``eagle.data``."""
    drawn = getattr(eagle, "talf_data_roots", 0)
    return {"talf_top_k": eagle.talf_top_k, "talf_depth": eagle.talf_depth,
            **({"talf_data_roots": drawn} if drawn else {}), **_data_settings(eagle)}


def _make_windows(ctx: SignalContext, inputs: list[list[int]], first: int) -> list[dict]:
    return [{"tokens": x} for x in _feat_windows(ctx, inputs)]


def _make_feat(ctx: SignalContext, inputs: list[list[int]], first: int) -> list[dict]:
    return [feat_example(ctx.target, x, ctx.distill.top_k) for x in _feat_windows(ctx, inputs)]


def _forest_roots(ctx: SignalContext, first: int) -> dict:
    """``feat_forest_example``'s root draw: ``eagle.talf_data_roots`` trees per window at
    positions drawn with a generator seeded by the shard (``seed + first``)."""
    n = getattr(ctx.eagle, "talf_data_roots", 0)
    return {"roots": n, "generator": torch.Generator().manual_seed(ctx.seed + first)} \
        if n else {}


def _make_feat_tree(ctx: SignalContext, inputs: list[list[int]], first: int) -> list[dict]:
    e, draw = ctx.eagle, _forest_roots(ctx, first)
    return [feat_forest_example(ctx.target, x, ctx.distill.top_k, e.talf_top_k, e.talf_depth,
                                **draw) for x in _feat_windows(ctx, inputs)]


def fused_spec(eagle) -> object:
    """The features EAGLE-3 data holds: ``eagle.feature_layers`` or the paper's default."""
    layers = getattr(eagle, "feature_layers", None)
    return tuple(layers) if layers else "eagle3"


def _fused_settings(eagle) -> dict:
    return {"feature_layers": list(fused_spec(eagle)) if eagle is not None and
            getattr(eagle, "feature_layers", None) else "eagle3", **_data_settings(eagle)}


def _fused_tree_settings(eagle) -> dict:
    return {**_fused_settings(eagle), **_tree_settings(eagle)}


def _make_feat3(ctx: SignalContext, inputs: list[list[int]], first: int) -> list[dict]:
    return [feat_example(ctx.target, x, ctx.distill.top_k, fused_spec(ctx.eagle))
            for x in _feat_windows(ctx, inputs)]


def _make_feat3_tree(ctx: SignalContext, inputs: list[list[int]], first: int) -> list[dict]:
    e = ctx.eagle
    draw = _forest_roots(ctx, first)
    return [feat_forest_example(ctx.target, x, ctx.distill.top_k, e.talf_top_k, e.talf_depth,
                                fused_spec(e), **draw) for x in _feat_windows(ctx, inputs)]


def _make_medusa(ctx: SignalContext, inputs: list[list[int]], first: int) -> list[dict]:
    d = ctx.distill
    return medusa_examples(ctx.target, inputs, d.response_len, d.top_k)


def _make_medusa_windows(ctx: SignalContext, inputs: list[list[int]], first: int
                         ) -> list[dict]:
    outs = greedy_continuations(ctx.target, inputs, ctx.distill.response_len, None, 64)
    return [{"tokens": p + o} for p, o in zip(inputs, outs, strict=True)]


def _make_seq(ctx: SignalContext, inputs: list[list[int]], first: int) -> list[dict]:
    return seq_examples(ctx.target, inputs, ctx.distill.response_len, ctx.eos)


def _make_tree(ctx: SignalContext, inputs: list[list[int]], first: int) -> list[dict]:
    d = ctx.distill
    return [tree_example(ctx.target, x, d.tree_top_k, d.tree_depth, d.tree_nodes, d.top_k)
            for x in inputs]


def accept_examples(target: ModelRunner, draft: ModelRunner, prompts: list[list[int]],
                    response_len: int, temperature: float, seed: int, eos: int | None,
                    batch: int = 64) -> list[dict]:
    """:func:`accept_example` for each of ``prompts`` (prompt ``j`` seeded ``seed + j``).
    Greedy (``temperature == 0``): the target's responses come from the batched engine,
    ``batch`` rows at a time (plain decoding, stopping at ``eos``: the same tokens as one
    row at a time, up to near ties in bfloat16 / float16, and several times faster on a
    real target); sampled: one prompt at a time."""
    responses: list[list[int] | None] = [None] * len(prompts)
    if temperature == 0 and prompts:
        responses = greedy_continuations(target, prompts, response_len, eos, batch)
    return [accept_example(target, draft, x, response_len, temperature, seed + j, eos, r)
            for j, (x, r) in enumerate(zip(prompts, responses, strict=True))]


def _make_accept(ctx: SignalContext, inputs: list[list[int]], first: int) -> list[dict]:
    return accept_examples(ctx.target, ctx.draft, inputs, ctx.distill.response_len,
                           ctx.head_temperature, ctx.seed + first, ctx.eos)


BUILTIN_KINDS: tuple[DataKind, ...] = (
    DataKind("kd", _window, _make_kd, draw="window", doc="corpus windows + the target's top-k"),
    DataKind("seq", _prompt, _make_seq, doc="prompts + the target's greedy continuation"),
    DataKind("tree", _context, _make_tree,
             doc="contexts + a target-built EAGLE-2 tree with top-k at every node"),
    DataKind("accept", _prompt, _make_accept, needs_draft=True,
             doc="SpecDec++ acceptance data (needs the drafter)"),
    DataKind("windows", _window, _make_windows, draw="window", settings=_data_settings,
             doc="the token windows alone (online features: the target runs in the step)"),
    DataKind("feat", _window, _make_feat, draw="window", settings=_data_settings,
             doc="windows + the target's features and top-k"),
    DataKind("feat_tree", _window, _make_feat_tree, draw="window", settings=_tree_settings,
             doc="feat windows + a target-built beam tree at every position (TALF)"),
    DataKind("feat3", _window, _make_feat3, draw="window", settings=_fused_settings,
             doc="windows + the target's fused layer features (EAGLE-3) and top-k"),
    DataKind("feat3_tree", _window, _make_feat3_tree, draw="window", settings=_fused_tree_settings,
             doc="feat3 windows + a target-built beam tree at every position (EAGLE-3 TALF)"),
    DataKind("medusa", _prompt, _make_medusa, draw="medusa",
             doc="prompts + greedy continuations with the target's features (Medusa)"),
    DataKind("medusa_windows", _prompt, _make_medusa_windows, draw="medusa",
             doc="prompts + greedy continuations, tokens only (Medusa, online features)"),
)
for _kind in BUILTIN_KINDS:
    register_data_kind(_kind)
