"""``reference-large``: a memory-bound reference target, grown from the reference pair.

Why: the reference target (6 x 192, 3M parameters) is overhead-bound on a CPU, so a
forward of 8 tokens costs little more than one only because both are mostly Python and
kernel-launch overhead, and a drafter's cost is a fixed overhead too. Large models on a
GPU at batch 1 are MEMORY-bound instead: a forward reads every weight once, whatever the
number of tokens, so verifying a tree of 8 costs about as much as one token, and a
one-layer EAGLE drafter costs about one layer's share of the target. Speed claims are
made in that regime; ``reference-large`` reproduces it on a 2-core CPU with native
bfloat16 (see "Which dtype" below for the CPUs without).

What it is (built by :func:`ensure_reference_large`, cached under
``$SPECLAB_HOME/models/reference-large-<hash>``, the hash covering :class:`LargeSpec`
and the base pair's own hash):

* ``target/``: the trained reference target WIDENED ``k``x (default 6: hidden 1152,
  24 heads of the same head_dim 48, intermediate 4608; :func:`widen_llama`) and DEEPENED
  to ``depth`` layers (default 16; :func:`deepen_llama`) by inserting layers whose
  ``o_proj`` and ``down_proj`` are zero, saved in bfloat16 with the tokenizer (342M
  parameters, 653 MB). Depth 16: a one-layer EAGLE drafter reads about 1.2 layers'
  worth of weights (its layer, ``fc`` and the LM head), so 1/10 of a target forward
  needs 12 or more layers; 16 leaves room for per-forward overhead. It computes the
  reference target's function EXACTLY (up to bfloat16 rounding of the stored weights):
  we neither perturb it nor train it further.
  That is the honest, simple choice: every hardware-independent figure (tau, acceptance
  per position) of a method on ``reference-large`` is the one it has on ``reference``
  (up to that rounding), and only the cost model changes, which is what the model is for.
  It is NOT a better language model than ``reference``; do not read quality into it.
* ``draft/``: the reference pair's 1 x 64 draft, copied. It was distilled from the
  reference target's function, which is the large target's function: it IS a standalone
  draft distilled from this target.
* ``eagle/``: a 1-layer EAGLE drafter for the large target. It is trained in process
  against the SMALL target with the project's EAGLE code (:mod:`speclab.families.eagle.training`,
  the ``experiments/distill_eagle.yaml`` recipe: corpus windows, the target's features
  and top-16, ``eagle_loss``), kept as ``eagle-small/`` (a drafter for ``reference``), then
  widened the same way (:func:`widen_eagle`). The large target's features are the small
  target's repeated ``k`` times, so the widened drafter proposes what the small one
  proposes on the small target; the build checks that.
* ``cost.json``: forward cost at batch 1 after a 128-token prefix (median of 10,
  :func:`measure_cost`) for 1/4/8/16 new tokens, and the EAGLE drafter's and the
  draft's forward relative to the target's, in bfloat16 and float32, on the CPU that
  built it (:func:`record_cost`; ``speclab reference --large --check`` measures again).
  Goals: 8 tokens <= 1.25x one token, the EAGLE drafter <= 1/10 of a target forward.
* ``reference_large.json``: the spec, the base pair, the build's timings and checks.

Which dtype (:func:`run_dtype`): bfloat16 where it is native (a CPU with AVX512-BF16 or
AMX, a GPU): the issue's measurement of the 6-layer widening on such a CPU gave 1 token
24 ms, 4 tokens 1.03x, 8 tokens 1.18x. On an AVX2-only CPU PyTorch emulates bfloat16
matmuls and they are compute-bound (8 tokens 5x one), so there it runs in float32,
an exact upcast of the stored weights, the most memory-bound it gets there (the
compute/bandwidth balance of such a CPU misses the 1.25x goal in every dtype; see the
README's table).

Widening (the function is preserved exactly in exact arithmetic; checked to ~1e-5 in
float32): write ``tile(x)`` for ``k`` copies of ``x`` side by side. Every hidden state of
the wide model is ``tile`` of the small one's. Embedding rows are tiled; every linear map
``W [out, in]`` becomes ``k x k`` blocks of ``W / k``, so ``W' tile(x) = tile(W x)``; the
LM head's ``[V, H]`` becomes ``k`` blocks of ``W / k`` (logits unchanged); RMSNorm weights
are tiled, and ``mean(tile(x)^2) = mean(x^2)`` keeps the norm. Attention: with head_dim
kept, ``tile(q)`` is the small model's heads repeated ``k`` times (head ``c*h + j`` is a
copy of head ``j``), the same for k/v with ``k * kv`` KV heads, so GQA's group size is
unchanged and query head ``c*h + j`` reads KV head ``c*kv + j // g``, a copy of the one
head ``j`` read; rotary embeddings act per head on head_dim and are unchanged; the heads'
concatenation is ``tile`` of the small one, which ``o_proj`` maps as any linear map. A
tied LM head cannot be both tiled (embedding) and scaled by ``1/k`` (head), so the wide
model is untied. Only the ``llama`` family is widened (other families scale embeddings by
``sqrt(H)`` or add biases and norms that would need their own rules).

    speclab reference --large        # build if missing, print the folders
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from speclab.data.corpus import function_header_prompts, read_text, split_files
from speclab.decoding.runner import ModelRunner
from speclab.families.eagle.model import EagleMeta, EagleModel, build_eagle, load_eagle, save_eagle
from speclab.families.eagle.training import (
    collate_feat,
    eagle_loss,
    engine_acceptance,
    top1_agreement,
)
from speclab.models.loading import DTYPES, load_model, load_tokenizer
from speclab.models.reference import ensure_reference_pair
from speclab.paths import speclab_home
from speclab.timing import now
from speclab.train.distill_data import feat_example
from speclab.train.lm import make_optimizer, random_windows

#: the dtype the large target is stored in; it runs in :func:`run_dtype`
DTYPE = "bfloat16"
#: new-token counts :func:`measure_cost` times after the prefix
COST_TOKENS = (1, 4, 8, 16)


def native_bfloat16(device: str = "cpu") -> bool:
    """Whether bfloat16 matmuls run natively: a CUDA device that supports them, or a CPU
    with AVX512-BF16 or AMX-BF16 (Linux ``/proc/cpuinfo`` flags). Elsewhere (an AVX2-only
    CPU) PyTorch emulates them and a bfloat16 forward is compute-bound: measured on such
    a 2-core EPYC, 8 new tokens cost 5.05x one in bfloat16 against 2.05x in float32.
    ``device``: ``cpu``, ``cuda[:i]`` or ``auto``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda"):
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def run_dtype(device: str = "cpu") -> str:
    """The dtype to run ``reference-large`` in on ``device``: bfloat16 where it is native
    (a forward then reads 2 bytes per weight: memory-bound), float32 elsewhere (an exact
    upcast of the stored weights; twice the bytes, but no emulated arithmetic)."""
    return "bfloat16" if native_bfloat16(device) else "float32"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class LargeSpec:
    """Everything that determines ``reference-large`` beyond the base pair."""

    widen: int = 6
    depth: int = 16
    eagle_layers: int = 1
    eagle_windows: int = 2048  # corpus windows with the small target's features
    # 257-token windows (batch 4: the tokens per step of 16 x 65), as distill_eagle.yaml:
    # the drafter attends over the whole context, and evaluation contexts reach 233 tokens
    eagle_seq_len: int = 256
    eagle_top_k: int = 16
    eagle_steps: int = 1500
    eagle_batch: int = 4
    eagle_lr: float = 3e-3
    eagle_warmup: int = 50
    eagle_w_reg: float = 1.0
    eagle_w_cls: float = 0.1
    seed: int = 0

    def digest(self, base: str) -> str:
        """The cache key: this spec and the base pair's folder name (its own hash)."""
        blob = json.dumps({"spec": asdict(self), "base": base}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:10]


@dataclass(frozen=True)
class ReferenceLarge:
    """Folders of ``reference-large`` (target and draft also hold the tokenizer)."""

    target: str
    draft: str
    eagle: str
    eagle_small: str  # the EAGLE drafter for the small reference target it was widened from
    folder: str

    @property
    def cost(self) -> dict:
        """The recorded ``cost.json`` (:func:`record_cost`)."""
        return json.loads((Path(self.folder) / "cost.json").read_text())

    @property
    def grown_from(self) -> tuple[str, int]:
        """``(the small reference target's folder, the widening k)``, as recorded in
        ``reference_large.json`` at build."""
        built = json.loads((Path(self.folder) / "reference_large.json").read_text())
        return built["base_pair"]["target"], int(built["spec"]["widen"])


def build_log(msg: str) -> None:
    """Print a ``[reference-large]`` progress line to stderr."""
    print(f"[reference-large] {msg}", file=sys.stderr, flush=True)


# --- widening and deepening (pure functions of models) ---------------------------------


def tile_linear(w: torch.Tensor, k: int, device: torch.device | str | None = None
                ) -> torch.Tensor:
    """``[out, in]`` -> ``[k*out, k*in]``: ``k x k`` blocks of ``w / k``, on ``device``
    (default ``w``'s). The division is done on ``w`` where it lives, before it moves and
    is tiled: the result does not depend on how ``device`` divides (a GPU multiplies by
    the reciprocal), so a host and a GPU build the same bits."""
    return (w / k).to(device or w.device).repeat(k, k)


def tile(t: torch.Tensor, reps: tuple[int, ...], device: torch.device | str | None = None
         ) -> torch.Tensor:
    """``t`` moved to ``device`` (default its own), then ``t.repeat(*reps)``."""
    return t.to(device or t.device).repeat(*reps)


def _check_llama(config) -> None:
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"widen: only llama models are widened, got "
                         f"{getattr(config, 'model_type', None)!r}")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("widen: llama models with attention or MLP biases are not handled")


def widened_config(config, k: int):
    """The config of :func:`widen_llama`'s model: hidden, intermediate, heads and KV heads
    times ``k``, head_dim kept, LM head untied."""
    _check_llama(config)
    cfg = copy.deepcopy(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    cfg.hidden_size = config.hidden_size * k
    cfg.intermediate_size = config.intermediate_size * k
    cfg.num_attention_heads = config.num_attention_heads * k
    cfg.num_key_value_heads = kv * k
    cfg.head_dim = head_dim
    cfg.tie_word_embeddings = False
    return cfg


def _build_like(model: torch.nn.Module, config, state: dict[str, torch.Tensor]):
    """A model of ``model``'s class with ``config``, loaded with ``state`` (float32)."""
    new = type(model)(config).float()
    missing, unexpected = new.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.endswith("inv_freq")]:
        raise RuntimeError(f"widen: state mismatch, missing {missing}, unexpected {unexpected}")
    new.generation_config = copy.deepcopy(model.generation_config)
    return new.eval()


@torch.no_grad()
def widened_tensors(model: torch.nn.Module, k: int, device: torch.device | str | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The state of :func:`widen_llama`'s model, one float32 tensor at a time, each made
    on ``device`` (default ``model``'s) from ``model``'s tensor where it lives (so a
    GPU-scale model is grown on the GPU from a small one on the host, without a full-size
    copy anywhere else, and with the bits a host would compute: :func:`tile_linear`):
    ``(name, tensor)`` in ``model.state_dict()`` order, the LM head last."""
    head = model.get_output_embeddings().weight.float()
    for name, t in model.state_dict().items():
        t = t.float()
        if name.endswith("embed_tokens.weight"):
            yield name, tile(t, (1, k), device)  # [V, kH]: each row tiled
        elif name == "lm_head.weight":
            continue  # set below (also when tied to the embedding)
        elif t.ndim == 1:  # RMSNorm weights
            yield name, tile(t, (k,), device)
        elif t.ndim == 2:  # q/k/v/o, gate/up/down
            yield name, tile_linear(t, k, device)
        else:
            raise ValueError(f"widen: unexpected tensor {name} of shape {tuple(t.shape)}")
    yield "lm_head.weight", tile(head / k, (1, k), device)  # [V, kH]: logits unchanged


@torch.no_grad()
def widen_llama(model: torch.nn.Module, k: int):
    """A LLaMA causal LM ``k`` times as wide that computes ``model``'s function (the
    module docstring): its hidden states are ``k`` copies of ``model``'s side by side.
    Returns a float32 model; ``model`` is left unchanged."""
    if k < 1:
        raise ValueError(f"widen: k must be >= 1, got {k}")
    cfg = widened_config(model.config, k)
    return _build_like(model, cfg, dict(widened_tensors(model, k)))


def deepened_layout(layers: int, depth: int) -> list[tuple[int, bool]]:
    """Where each of ``depth`` layers comes from: ``(source layer, inserted)``. The
    ``depth - layers`` inserted layers are spread evenly, each after a copy of its
    source layer (original layers keep their order)."""
    if depth < layers:
        raise ValueError(f"deepen: depth {depth} < the model's {layers} layers")
    extra = depth - layers
    out = []
    for i in range(layers):
        out.append((i, False))
        n = (extra * (i + 1)) // layers - (extra * i) // layers
        out += [(i, True)] * n
    return out


@torch.no_grad()
def deepen_llama(model: torch.nn.Module, depth: int):
    """``model`` with layers inserted up to ``depth`` layers that add nothing: each is a
    copy of the layer before it (attention, MLP and norms: a layer's full cost) with its
    ``o_proj`` and ``down_proj`` zero, so both residual branches add exactly 0. Returns a
    float32 model computing ``model``'s function (bit for bit in exact arithmetic)."""
    n = model.config.num_hidden_layers
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = depth
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [model.config.layer_types[src] for src, _ in deepened_layout(n, depth)]
    old = model.state_dict()
    state = {name: t.float() for name, t in old.items() if ".layers." not in name}
    for dst, (src, inserted) in enumerate(deepened_layout(n, depth)):
        prefix = f"model.layers.{src}."
        for name, t in old.items():
            if name.startswith(prefix):
                rest = name[len(prefix):]
                t = t.float().clone()
                if inserted and rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                    t.zero_()
                state[f"model.layers.{dst}.{rest}"] = t
    return _build_like(model, cfg, state)


def deepened_index(index: int, layers: int, depth: int) -> int:
    """The hidden-state index (:mod:`speclab.decoding.features`: ``i < L`` the input of
    decoder layer ``i``, ``L`` the LM head's input) of the model deepened from ``layers``
    to ``depth`` layers (:func:`deepen_llama`) that holds the original's state ``index``:
    the input of the copy of original layer ``index`` (the inserted layers before it add
    nothing), ``depth`` for ``layers``."""
    if not 0 <= index <= layers:
        raise ValueError(f"feature_layers: index {index} outside [0, {layers}]")
    if index == layers:
        return depth
    return deepened_layout(layers, depth).index((index, False))


@torch.no_grad()
def widen_eagle(model, k: int, target_config=None, layers: int | None = None,
                device: torch.device | str | None = None):
    """An EAGLE drafter (EAGLE-1/2 :class:`~speclab.families.eagle.model.EagleModel` or EAGLE-3
    :class:`~speclab.families.eagle.model3.Eagle3Model`) for the ``k``x wide target: features and
    embeddings are ``k`` copies side by side, so every map over concatenated inputs
    (``fc`` over ``concat(f, e)`` or EAGLE-3's fused layers, EAGLE-3's q/k/v over
    ``concat(e, h)``) has each input part tiled as a linear map and everything else is
    tiled as in :func:`widen_llama`; EAGLE-3's draft-vocabulary maps are kept. Its
    outputs are ``k`` copies of ``model``'s and its logits are ``model``'s. ``layers``:
    the small target's depth (required for EAGLE-3 with ``target_config``): EAGLE-3's
    ``feature_layers`` move to the states of the wide target, deepened to
    ``target_config``'s depth, that hold the same features (:func:`deepened_index`). With
    ``target_config`` (the wide target's) the new meta is checked to be exactly that of a
    drafter for it. The wide drafter is built on ``device`` (default ``model``'s), each
    tensor tiled there from ``model``'s where it lives (:func:`widened_tensors`). An
    EAGLE-3 variant (a meta variant field of :mod:`speclab.families.eagle.model3` other
    than its default) is refused by name: its norms, biases and fused widths are not
    tiled here."""
    m = model.meta
    changed = m.variant()
    if changed:
        raise ValueError(f"widen_eagle: the drafter is an EAGLE-3 variant ("
                         f"{', '.join(f'{f}={v!r}' for f, v in changed.items())}); only "
                         f"drafters with the default {', '.join(m.VARIANT_FIELDS)} are "
                         f"widened")
    feature_layers = m.feature_layers
    if m.version == 3 and target_config is not None and layers is None:
        raise ValueError("widen_eagle: an EAGLE-3 drafter's feature layers move with the "
                         "depth: give the small target's (layers)")
    if m.version == 3 and target_config is not None:
        depth = target_config.num_hidden_layers
        feature_layers = tuple(deepened_index(i, layers, depth) for i in m.feature_layers)
    meta = EagleMeta(**{**asdict(m), "hidden_size": m.hidden_size * k, "heads": m.heads * k,
                        "intermediate_size": m.intermediate_size * k,
                        "feature_layers": feature_layers})
    if target_config is not None:
        want = EagleMeta.for_target(target_config, m.layers)
        if m.version == 3:  # the same meta but the version's own fields
            want = replace(want, version=3, feature_layers=feature_layers,
                           draft_vocab_size=m.draft_vocab_size, fc_bias=m.fc_bias)
        if want != meta:
            raise ValueError(f"widen_eagle: widened meta {meta} is not {want}")
    h = m.hidden_size
    concat_inputs = (("layer.self_attn.q_proj.weight", "layer.self_attn.k_proj.weight",
                      "layer.self_attn.v_proj.weight") if m.version == 3 else ())
    dev = device or next(model.parameters()).device
    state = {}
    for name, t in model.state_dict().items():
        if name in ("d2t", "t2d"):  # EAGLE-3's draft vocabulary: ids, unchanged
            state[name] = t.to(dev, copy=True)
            continue
        t = t.float()
        if name == "embed.weight":
            state[name] = tile(t, (1, k), dev)
        elif name == "lm_head.weight":
            state[name] = tile(t / k, (1, k), dev)
        elif name == "fc.weight" or name in concat_inputs:  # [H, n*H] over n parts
            state[name] = torch.cat([tile_linear(part, k, dev) for part in t.split(h, 1)], 1)
        elif t.ndim == 1:  # fc bias, norms
            state[name] = tile(t, (k,), dev)
        elif t.ndim == 2:
            state[name] = tile_linear(t, k, dev)
        else:
            raise ValueError(f"widen_eagle: unexpected tensor {name} of shape {tuple(t.shape)}")
    with torch.device(dev):
        wide = build_eagle(meta).float()
    missing, unexpected = wide.load_state_dict(state, strict=False)
    if unexpected or [x for x in missing if not x.endswith("inv_freq")]:
        raise RuntimeError(f"widen_eagle: state mismatch, missing {missing}, "
                           f"unexpected {unexpected}")
    return wide.eval()


# --- the EAGLE drafter, trained against the small target --------------------------------


def train_small_eagle(target_dir: str, spec: LargeSpec,
                      log: Callable[[str], None] = build_log) -> tuple[torch.nn.Module, dict]:
    """A ``spec.eagle_layers``-layer EAGLE drafter for the reference target, trained in
    process with :func:`speclab.families.eagle.training.eagle_loss` on ``eagle_windows`` random
    train-split windows (the target's float16 features and top-k, as the distill_eagle
    job stores them), AdamW with warm-up and cosine decay, gradient clipping at 1 (the
    Ray Train loop's settings). Returns the drafter (float32, eval) and its figures."""
    t0 = time.perf_counter()
    target = load_model(target_dir)
    tok = load_tokenizer(target_dir)
    runner = ModelRunner(target)
    g = torch.Generator().manual_seed(spec.seed)

    def windows(split: str, chars: int, n: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(tok.encode(read_text(split_files(split), chars)), dtype=torch.long)
        rows = random_windows(ids, n, spec.eagle_seq_len, g)
        return collate_feat([feat_example(runner, w.tolist(), spec.eagle_top_k) for w in rows])

    data = windows("train", 1_500_000, spec.eagle_windows)
    val = windows("validation", 200_000, 64)
    runner.release()
    log(f"eagle data: {spec.eagle_windows} windows x {spec.eagle_seq_len} tokens with the "
        f"target's features ({time.perf_counter() - t0:.0f}s)")
    torch.manual_seed(spec.seed)
    model = EagleModel.from_target(target, spec.eagle_layers).float()
    opt, sched = make_optimizer(model, spec.eagle_lr, 0.01, spec.eagle_warmup, spec.eagle_steps)
    model.train()
    t1, recent = time.perf_counter(), []
    for step in range(spec.eagle_steps):
        idx = torch.randint(0, spec.eagle_windows, (spec.eagle_batch,), generator=g)
        batch = {key: v[idx] for key, v in data.items()}
        loss = eagle_loss(model, batch, "eagle", spec.eagle_w_reg, spec.eagle_w_cls)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        recent.append(loss.item())
        if (step + 1) % 250 == 0 or step + 1 == spec.eagle_steps:
            log(f"eagle step {step + 1}/{spec.eagle_steps} loss {statistics.mean(recent):.3f} "
                f"({time.perf_counter() - t1:.0f}s)")
            recent = []
    model.eval()
    with torch.no_grad():
        val_loss = float(eagle_loss(model, val, "eagle", spec.eagle_w_reg, spec.eagle_w_cls))
    figures = {"val_loss": val_loss, "val_top1": top1_agreement(model, val),
               "train_s": time.perf_counter() - t1, "data_s": t1 - t0}
    log(f"eagle: val loss {val_loss:.3f}, val top-1 agreement {figures['val_top1']:.3f} "
        f"in {figures['train_s']:.0f}s")
    return model, figures


# --- checks and cost ---------------------------------------------------------------------


def eagle_engine_figures(target: torch.nn.Module, drafter: torch.nn.Module, target_dir: str,
                         prompts: int = 8, max_new_tokens: int = 64) -> dict[str, float]:
    """:func:`~speclab.families.eagle.training.engine_acceptance` (greedy EAGLE-2, top-4,
    depth 5, 16 nodes) on held-out stdlib function-header prompts: tau and acceptance per
    position, the hardware-independent figures the large pair shares with the small one."""
    tok = load_tokenizer(target_dir)
    ids = [tok.encode(p.text) for p in function_header_prompts("test", prompts)]
    return engine_acceptance(target, drafter, ids, max_new_tokens)


def held_out_ids(target_dir: str, n: int) -> list[int]:
    """The first ``n`` token ids of the stdlib validation split, with ``target_dir``'s
    tokenizer."""
    tok = load_tokenizer(target_dir)
    return tok.encode(read_text(split_files("validation"), 50_000))[:n]


@torch.no_grad()
def logits_and_features(model: torch.nn.Module, ids: list[int]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [T, V], features [T, H])`` of one causal forward (features: the LM
    head's input), float32."""
    grabbed = []
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda _m, args: grabbed.append(args[0][0].detach()))
    try:
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    finally:
        hook.remove()
    return logits, grabbed[0].float()


@torch.no_grad()
def check_function(small: torch.nn.Module, large: torch.nn.Module, eagle_small,
                   eagle_large, ids: list[int], k: int) -> dict:
    """How exactly the large target and drafter reproduce the small ones on ``ids``:
    the largest logit difference (in ``large``'s dtype and in float32 when ``large`` is
    float32), the fraction of positions where the greedy token agrees, and the same for
    the drafters' proposals (each fed its own target's features)."""
    s_logits, s_feat = logits_and_features(small, ids)
    l_logits, l_feat = logits_and_features(large, ids)
    x = torch.tensor([ids[1:]])
    _, s_draft = eagle_small(s_feat[None, :-1], x)
    _, l_draft = eagle_large(l_feat[None, :-1].to(next(eagle_large.parameters()).dtype), x)
    s_draft, l_draft = s_draft[0].float(), l_draft[0].float()
    return {
        "tokens": len(ids),
        "logits_max_abs_diff": float((s_logits - l_logits).abs().max()),
        "logits_scale": float(s_logits.abs().max()),
        "features_are_tiled_max_abs_diff": float((s_feat.repeat(1, k) - l_feat).abs().max()),
        "greedy_agreement": float((s_logits.argmax(-1) == l_logits.argmax(-1)).float().mean()),
        "eagle_logits_max_abs_diff": float((s_draft - l_draft).abs().max()),
        "eagle_greedy_agreement": float((s_draft.argmax(-1) == l_draft.argmax(-1))
                                        .float().mean()),
    }


@torch.no_grad()
def drafter_logits(target: torch.nn.Module, drafter: torch.nn.Module, ids: list[int]
                   ) -> torch.Tensor:
    """``[T - 1, V]`` float32: an EAGLE drafter's (any version's) next-token logits at
    every pair of ``ids``, fed the features it reads (its ``feature_layers``) from one
    causal forward of ``target``."""
    spec = drafter.meta.feature_layers or None
    runner = ModelRunner(target)
    runner.track_hidden(spec)
    runner.reset()
    try:
        runner.forward(torch.tensor(ids[:-1]))
        feats = runner.features(spec)
    finally:
        runner.release()
    _, logits = drafter(feats[None], torch.tensor([ids[1:]], device=feats.device))
    return logits[0].float()


def widened_summary(check: dict, out: str, what: str) -> str:
    """The line ``speclab reference --large --widen`` prints for a widened drafter
    (``what``: the drafter, e.g. ``EAGLE-3, feature layers [0, 2, 7]``)."""
    return (f"{check['kind']}: {out} ({what} for reference-large; greedy agreement with "
            f"{check['source']} {check['greedy_agreement']:.3f})")


def widen_eagle_folder(src: str, out: str, large: ReferenceLarge | None = None,
                       log: Callable[[str], None] = build_log, ids: list[int] | None = None
                       ) -> dict:
    """``speclab reference --large --widen SRC --out DST``: an EAGLE drafter (EAGLE-1/2
    or EAGLE-3, a :func:`~speclab.families.eagle.model.save_eagle` folder, e.g. a
    ``distill_eagle`` run's) trained against the ``reference`` target, widened (and its
    feature layers moved, :func:`widen_eagle`) into a drafter for ``reference-large``,
    saved in bfloat16 to ``out`` with ``widened.json`` (the source and the check). A
    drafter for another target is refused by name (``--widen``). The check: on 128
    held-out tokens, both drafters fed their own target's features (the large target's
    bfloat16 weights in float32): the largest logit difference and the greedy agreement
    (1.0 up to the weights' rounding: the widened drafter proposes what the small one
    does, so its tau on ``reference-large`` is the small one's on ``reference``); ``ids``
    replaces those tokens."""
    large = large or ensure_reference_large()
    small_dir, k = large.grown_from
    small = load_model(small_dir)
    drafter = load_eagle(src, small.config, field="--widen")
    wide_target = load_model(large.target, dtype="float32")
    wide = widen_eagle(drafter, k, wide_target.config, small.config.num_hidden_layers)
    ids = ids or held_out_ids(small_dir, 128)
    s_logits, l_logits = drafter_logits(small, drafter, ids), drafter_logits(wide_target, wide, ids)
    finite = s_logits > torch.finfo(torch.float32).min / 2  # outside a draft vocabulary: min
    check = {"source": str(src), "reference_large": large.folder, "kind": "eagle",
             "version": wide.meta.version,
             "feature_layers": list(wide.meta.feature_layers or ()),
             "small_feature_layers": list(drafter.meta.feature_layers or ()),
             "tokens": len(ids),
             "logits_max_abs_diff": float((s_logits - l_logits)[finite].abs().max()),
             "greedy_agreement": float((s_logits.argmax(-1) == l_logits.argmax(-1))
                                       .float().mean())}
    check["summary"] = widened_summary(
        check, out, f"EAGLE-{check['version']}, feature layers "
                    f"{check['feature_layers'] or 'the last'}")
    folder = save_eagle(wide.to(torch.bfloat16), out)
    (folder / "widened.json").write_text(json.dumps(check, indent=2))
    log(f"widened {src} (EAGLE-{wide.meta.version}) -> {folder}: greedy agreement "
        f"{check['greedy_agreement']:.3f}, logits max |diff| {check['logits_max_abs_diff']:.3f}")
    return check


def _median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs)


@torch.no_grad()
def forward_cost(model: torch.nn.Module, ids: list[int], prefix: int = 128,
                 repeats: int = 10, tokens: tuple[int, ...] = COST_TOKENS,
                 eagle: torch.nn.Module | None = None, draft: torch.nn.Module | None = None
                 ) -> dict:
    """Forward cost of ``model`` at batch 1 on top of a ``prefix``-token cache of ``ids``
    (HF forward through the engine's :class:`~speclab.decoding.runner.ModelRunner`,
    ``DynamicCache``, this process's torch threads, on the model's device; every clock
    read after the device finished, :func:`speclab.timing.now`), median of ``repeats``,
    for each count in ``tokens``; the counts are interleaved round by round (A B C D A B
    C D) so drift hits them alike. With ``eagle`` (an EAGLE drafter of any version for
    ``model``, fed the features it reads on top of ``prefix`` pairs) / ``draft`` (a
    standalone draft LM): that drafter's 1-token forward, timed alternately with the
    target's 1-token forward, and the ratio of the medians. ``ids`` needs ``prefix +
    max(tokens)`` tokens. ``{"prefix", "repeats", "params", "target_ms": {n: ms},
    "target_ratio": {n: x one token}, "<drafter>_ms", "<drafter>_vs_target",
    "<drafter>_params"}``."""
    device = next(model.parameters()).device
    spec = (eagle.meta.feature_layers or None) if eagle is not None else None
    ctx, new = torch.tensor(ids[:prefix]), torch.tensor(ids[prefix:prefix + max(tokens)])
    t_run = ModelRunner(model)
    t_run.track_hidden(spec)  # the features the EAGLE drafter reads (EAGLE-3: fused layers)
    t_run.forward(ctx)
    feats = t_run.features(spec)  # [prefix, F]

    def time_target(n: int) -> float:
        t0 = now(device)
        t_run.forward(new[:n])
        dt = now(device) - t0
        t_run.crop(prefix)
        return dt

    for n in tokens:  # warm-up: first shapes, allocator
        time_target(n)
    times: dict[int, list[float]] = {n: [] for n in tokens}
    for _ in range(repeats):
        for n in tokens:
            times[n].append(time_target(n))
    one = _median_ms(times[1]) if 1 in times else _median_ms(times[tokens[0]])
    out: dict = {"prefix": prefix, "repeats": repeats,
                 "params": sum(p.numel() for p in model.parameters()),
                 "target_ms": {str(n): _median_ms(v) for n, v in times.items()},
                 "target_ratio": {str(n): _median_ms(v) / one for n, v in times.items()}}
    drafters = {}
    if eagle is not None:
        e_dtype = next(eagle.parameters()).dtype
        e_run = ModelRunner(eagle)
        e_run.run(ctx[1:], features=feats[None, :-1].to(e_dtype))
        f_one = feats[None, -1:].to(e_dtype)
        drafters["eagle"] = (e_run, lambda r: r.run(new[:1], features=f_one), prefix - 1)
    if draft is not None:
        d_run = ModelRunner(draft)
        d_run.forward(ctx)
        drafters["draft"] = (d_run, lambda r: r.forward(new[:1]), prefix)
    for name, (run, call, base) in drafters.items():
        pair: dict[str, list[float]] = {"target": [], name: []}
        for i in range(repeats + 2):  # A B A B; the first two rounds warm up
            for who in ("target", name):
                if who == "target":
                    dt = time_target(1)
                else:
                    t0 = now(device)
                    call(run)
                    dt = now(device) - t0
                    run.crop(base)
                if i >= 2:
                    pair[who].append(dt)
        out[f"{name}_ms"] = _median_ms(pair[name])
        out[f"{name}_vs_target"] = _median_ms(pair[name]) / _median_ms(pair["target"])
        out[f"{name}_params"] = sum(p.numel() for p in run.model.parameters())
        run.release()
    t_run.release()
    return out


def measure_cost(target_dir: str, eagle_dir: str | None = None, draft_dir: str | None = None,
                 dtype: str = "bfloat16", prefix: int = 128, repeats: int = 10,
                 tokens: tuple[int, ...] = COST_TOKENS) -> dict:
    """:func:`forward_cost` of the folders ``target_dir`` (with ``eagle_dir`` /
    ``draft_dir``) loaded in ``dtype`` on the CPU, on held-out stdlib tokens, with the
    machine's state around it (threads, load average before and after) and the goals
    (8 tokens <= 1.25x one token, the EAGLE drafter <= 1/10 of a target forward)."""
    target = load_model(target_dir, dtype=dtype)
    eagle = load_eagle(eagle_dir, target.config, dtype=DTYPES[dtype]) if eagle_dir else None
    draft = load_model(draft_dir, dtype=dtype) if draft_dir else None
    out: dict = {"dtype": dtype, "threads": torch.get_num_threads(),
                 "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "load_avg_1min_before": os.getloadavg()[0]}  # other work on the machine
    out.update(forward_cost(target, held_out_ids(target_dir, prefix + max(tokens) + 1),
                            prefix, repeats, tokens, eagle, draft))
    out["load_avg_1min_after"] = os.getloadavg()[0]
    out["goals"] = {
        "8_tokens_le_1.25x": out["target_ratio"].get("8", float("nan")) <= 1.25,
        "eagle_le_0.1": out.get("eagle_vs_target", float("nan")) <= 0.1,
    }
    return out


def record_cost(large: ReferenceLarge, dtypes: tuple[str, ...] | None = None) -> dict:
    """Measure the forward costs on this CPU now, in :func:`run_dtype` first, then in the
    other of bfloat16 / float32 (``dtypes`` to choose), and write them to ``cost.json``:
    ``{"cpu", "cpu_capability", "native_bfloat16", "run_dtype", "goals" (met in the run
    dtype), "by_dtype": {dtype: measure_cost(...)}}``."""
    best = run_dtype()
    dtypes = dtypes or (best, "float32" if best == "bfloat16" else "bfloat16")
    by_dtype = {d: measure_cost(large.target, large.eagle, large.draft, dtype=d)
                for d in dtypes}
    cost = {"cpu": _cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bfloat16": native_bfloat16(), "run_dtype": best,
            "goals": by_dtype.get(best, by_dtype[dtypes[0]])["goals"], "by_dtype": by_dtype}
    (Path(large.folder) / "cost.json").write_text(json.dumps(cost, indent=2))
    return cost


def format_cost(cost: dict) -> str:
    """Markdown tables of :func:`record_cost`'s figures, one per dtype."""
    lines = [f"CPU: {cost['cpu']} ({cost['cpu_capability']}; native bfloat16: "
             f"{cost['native_bfloat16']}; runs in {cost['run_dtype']})"]
    for dtype, c in cost["by_dtype"].items():
        ns = list(c["target_ms"])
        lines += ["", f"{dtype}, {c['threads']} threads, batch 1 after a {c['prefix']}-token "
                  f"prefix, median of {c['repeats']} ({c['measured_at']}, load average "
                  f"{c['load_avg_1min_before']:.1f}):",
                  "| new tokens | " + " | ".join(ns) + " |", "|---" * (len(ns) + 1) + "|",
                  "| target ms | " + " | ".join(f"{c['target_ms'][n]:.1f}" for n in ns) + " |",
                  "| x one token | " + " | ".join(f"{c['target_ratio'][n]:.2f}" for n in ns)
                  + " |"]
        for name in ("eagle", "draft"):
            if f"{name}_ms" in c:
                lines.append(f"{name}: {c[f'{name}_ms']:.2f} ms per 1-token forward = "
                             f"{c[f'{name}_vs_target']:.3f} of a target forward")
    return "\n".join(lines)


# --- the build ---------------------------------------------------------------------------


def build_reference_large(out: Path, spec: LargeSpec, pair) -> ReferenceLarge:
    """Widen, deepen, train and widen the EAGLE drafter, check and measure, into ``out``
    (about 5-10 minutes on 2 cores once the reference pair exists)."""
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    meta: dict = {"spec": asdict(spec), "base_pair": {"target": pair.target,
                                                      "draft": pair.draft}}
    small = load_model(pair.target)
    tok = load_tokenizer(pair.target)
    large = widen_llama(deepen_llama(small, spec.depth), spec.widen)  # deepen the small one:
    # the same model, without a second copy of the wide weights in memory
    c = large.config
    meta["target"] = {"params": sum(p.numel() for p in large.parameters()),
                      "layers": c.num_hidden_layers, "hidden": c.hidden_size,
                      "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
                      "head_dim": c.head_dim, "intermediate": c.intermediate_size}
    build_log(f"target: widened {spec.widen}x and deepened to {spec.depth} layers: "
         f"{meta['target']['params'] / 1e6:.0f}M parameters ({time.perf_counter() - t0:.0f}s)")

    eagle_small, meta["eagle_small"] = train_small_eagle(pair.target, spec)
    meta["eagle_small"].update(eagle_engine_figures(small, eagle_small, pair.target))
    build_log(f"eagle on the small target: EAGLE-2 tau {meta['eagle_small']['engine_tau']:.2f} "
         "(8 held-out prompts x 64 greedy tokens)")
    eagle_large = widen_eagle(eagle_small, spec.widen, large.config)
    ids = held_out_ids(pair.target, 128)
    meta["check_float32"] = check_function(small, large, eagle_small, eagle_large, ids,
                                           spec.widen)
    build_log(f"float32 check: logits max |diff| {meta['check_float32']['logits_max_abs_diff']:.2e}"
         f" (scale {meta['check_float32']['logits_scale']:.1f}), EAGLE logits max |diff| "
         f"{meta['check_float32']['eagle_logits_max_abs_diff']:.2e}")
    large = large.to(torch.bfloat16)
    eagle_large = eagle_large.to(torch.bfloat16)
    meta["check_bfloat16"] = check_function(small, large, eagle_small, eagle_large, ids,
                                            spec.widen)
    build_log(f"bfloat16 check: greedy agreement {meta['check_bfloat16']['greedy_agreement']:.3f}, "
         f"EAGLE greedy agreement {meta['check_bfloat16']['eagle_greedy_agreement']:.3f}")
    # how an AVX2-only CPU runs it (run_dtype): the rounded weights in float32 (.float()
    # converts in place; bfloat16 -> float32 -> bfloat16 is exact)
    large_f32 = large.float()
    meta["check_bfloat16_weights_in_float32"] = check_function(
        small, large_f32, eagle_small, eagle_large.float(), ids, spec.widen)
    large, eagle_large = large_f32.to(torch.bfloat16), eagle_large.to(torch.bfloat16)
    large.save_pretrained(tmp / "target")
    tok.save_pretrained(tmp / "target")
    shutil.copytree(pair.draft, tmp / "draft")
    save_eagle(eagle_large, tmp / "eagle")
    save_eagle(eagle_small, tmp / "eagle-small")
    del large, eagle_large
    meta["build_s"] = time.perf_counter() - t0
    build_log(f"saved ({meta['build_s']:.0f}s); measuring forward cost")
    cost = record_cost(_folders(tmp))
    build_log("forward cost:\n" + format_cost(cost))
    meta["total_s"] = time.perf_counter() - t0
    (tmp / "reference_large.json").write_text(json.dumps(meta, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    build_log(f"built in {meta['total_s']:.0f}s -> {out}")
    return _folders(out)


def _folders(out: Path) -> ReferenceLarge:
    return ReferenceLarge(str(out / "target"), str(out / "draft"), str(out / "eagle"),
                          str(out / "eagle-small"), str(out))


def ensure_reference_large(spec: LargeSpec | None = None, root: Path | None = None,
                           force: bool = False) -> ReferenceLarge:
    """Return the cached ``reference-large``, building it (and the reference pair it
    grows from) first if missing, or if ``force``."""
    spec = spec or LargeSpec()
    root = root or speclab_home() / "models"
    pair = ensure_reference_pair(root=root)
    base = Path(pair.target).parent.name  # reference-<hash of the pair's spec>
    out = root / f"reference-large-{spec.digest(base)}"
    if force or not (out / "reference_large.json").exists():
        return build_reference_large(out, spec, pair)
    return _folders(out)
