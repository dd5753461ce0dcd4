"""The EAGLE feature drafter: ``f_hat_{t+1} = g(f_t, Embed(x_{t+1}))`` (pure PyTorch).

``f_t`` is the target's last-layer feature at position ``t`` (the LM head's input, i.e.
after the final norm) and ``x_{t+1}`` the token one step ahead. ``g`` is a linear
``fc: [2H] -> [H]`` over ``concat(f_t, Embed(x_{t+1}))`` followed by ``layers`` LLaMA
decoder layers (one by default) and a final RMS norm; the next-token logits are the
target's LM head applied to ``f_hat``. The embedding and the LM head are COPIES of the
target's, frozen: the drafter folder is then self-contained (a Serve draft replica does
not need the target's weights), at the price of storing ``2 * V * H`` extra numbers.

A deviation from EAGLE-1/2 and HASS, whose drafter has no input norm in its first layer
and no final norm: speclab's keeps both by default (every saved drafter has their
weights, so the architecture stays). The meta's layout flags ``input_norm``,
``final_norm`` (and ``fc_bias``) say otherwise: a drafter imported from the EAGLE
research code, HASS or the speculators format has ``input_norm = final_norm = False``
(its layer 0 reads ``fc``'s output directly, ``f_hat`` is the last layer's residual
stream). A ``config.json`` without these keys means today's layout (all True). The
training recipe's deviations are listed in :mod:`speclab.families.eagle.training`.

On disk (``save_pretrained`` style): ``config.json`` (an :class:`EagleMeta`: the target
it was trained for — architecture, hidden size, vocabulary — and the layer shape) and
``model.safetensors``. :func:`load_eagle` checks the meta against a target config; it
also loads the public formats (:mod:`speclab.models.formats`: EAGLE-1/2 / HASS research
checkpoints, speculators ``eagle``), which need the target's LM head (and embedding when
the checkpoint has none).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel

from speclab.decoding.gqa_attention import NAME as PACKED_ATTENTION
from speclab.decoding.gqa_attention import register as register_packed_attention

KIND = "speclab-eagle"


@dataclass(frozen=True)
class EagleMeta:
    """What an EAGLE drafter is and which target it belongs to."""

    target_architecture: str
    hidden_size: int
    vocab_size: int
    layers: int = 1
    heads: int = 4
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_positions: int = 2048
    embed_scale: float = 1.0  # the target family's input-embedding multiplier
    kv_heads: int = 0  # key/value heads of the layers (0: ``heads``, no grouping)
    head_dim: int = 0  # 0: hidden_size // heads
    rope_scaling: dict | None = None  # a LLaMA rope_scaling dict (None: plain RoPE)
    input_norm: bool = True  # RMS norm at layer 0's input (EAGLE-1/2, HASS: none)
    final_norm: bool = True  # RMS norm before the LM head (EAGLE-1/2, HASS: none)
    fc_bias: bool = True  # fc has a bias (speculators' fusion_bias, EAGLE's "bias")
    version: int = 1  # 1: EAGLE-1/2 (and HASS, TALF); 3: EAGLE-3 (speclab.families.eagle.model3)
    feature_layers: tuple[int, ...] | None = None  # EAGLE-3: the target states it fuses
    draft_vocab_size: int = 0  # EAGLE-3: the draft vocabulary (0: the target's)
    # EAGLE-3 variants (speclab.families.eagle.model3; the defaults are the EAGLE code's)
    target_hidden_size: int = 0  # width of each fused target state (0: hidden_size)
    residual_norm: bool = False  # residual is hidden_norm(h) (norm_before_residual)
    fc_input_norm: bool = False  # one RMS norm over the fused states (norm_before_fc)
    fc_state_norms: bool = False  # one RMS norm per fused state (fc_norm)
    feed_normed: bool = False  # norm(out) is fed back (speculators' norm_output)
    head_norm: bool = True  # the LM head reads norm(out) (SpecForge's norm_output)
    qkv_bias: bool = False  # q/k/v projections have biases (attention_bias / qkv_bias)
    o_bias: bool = False  # o_proj has a bias (attention_bias)
    kind: str = KIND

    #: the EAGLE-3 variant fields above (:mod:`speclab.families.eagle.model3`'s table)
    VARIANT_FIELDS = ("target_hidden_size", "residual_norm", "fc_input_norm",
                      "fc_state_norms", "feed_normed", "head_norm", "qkv_bias", "o_bias")

    def variant(self) -> dict:
        """The EAGLE-3 variant fields that differ from their defaults ({} for the EAGLE
        code's drafter)."""
        return {f: getattr(self, f) for f in self.VARIANT_FIELDS
                if getattr(self, f) != self.__dataclass_fields__[f].default}

    @property
    def feature_width(self) -> int:
        """Width of the target features the drafter reads: ``H``, or ``k * H_t`` for an
        EAGLE-3 drafter fusing ``k`` layers of the target's width ``H_t``
        (``target_hidden_size``, else ``H``)."""
        if not self.feature_layers:
            return self.hidden_size
        return (self.target_hidden_size or self.hidden_size) * len(self.feature_layers)

    @classmethod
    def for_target(cls, config, layers: int = 1, input_norm: bool = True,
                   final_norm: bool = True) -> EagleMeta:
        """The meta of a drafter for a target with HF ``config`` (speclab's layout by
        default; ``input_norm = final_norm = False``: EAGLE-1/2's)."""
        arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        rope = getattr(config, "rope_theta", None)
        if rope is None:  # transformers 5 keeps it in rope_parameters
            rope = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(target_architecture=arch, hidden_size=int(config.hidden_size),
                   embed_scale=embedding_scale(config),
                   vocab_size=int(config.vocab_size), layers=layers,
                   heads=int(config.num_attention_heads),
                   intermediate_size=int(getattr(config, "intermediate_size", 0)
                                         or 4 * config.hidden_size),
                   rope_theta=float(rope),
                   rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
                   max_positions=int(getattr(config, "max_position_embeddings", 2048)),
                   input_norm=input_norm, final_norm=final_norm)

    def check_target(self, config, name: str = "eagle_model") -> None:
        """A clear error naming the field ``name`` when ``config`` (a target's HF config)
        is not the target this drafter was trained for. An empty ``target_architecture``
        (an imported public checkpoint, which does not record it) is not compared."""
        want = EagleMeta.for_target(config, self.layers)
        mine = replace(self, hidden_size=self.target_hidden_size or self.hidden_size)
        for field in ("target_architecture", "hidden_size", "vocab_size"):
            if field == "target_architecture" and not self.target_architecture:
                continue
            if getattr(mine, field) != getattr(want, field):
                raise ValueError(
                    f"{name}: trained for a target with {field}="
                    f"{getattr(mine, field)!r}, but the target has {getattr(want, field)!r}")
        if self.feature_layers:  # EAGLE-3: the layers it fuses must exist in the target
            from speclab.decoding.features import layer_ids, num_decoder_layers

            layer_ids(self.feature_layers, num_decoder_layers(config), f"{name}: feature_layers")

    def layer_config(self) -> LlamaConfig:
        """The LLaMA config of the drafter's decoder layers (attention:
        :func:`speclab.decoding.gqa_attention.packed_sdpa`, sdpa without copying a
        grouped-query cache for a several-token query)."""
        register_packed_attention()
        extra = {"rope_scaling": dict(self.rope_scaling)} if self.rope_scaling else {}
        if self.head_dim:
            extra["head_dim"] = self.head_dim
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads or self.heads,
            max_position_embeddings=self.max_positions, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, tie_word_embeddings=False, attn_implementation=PACKED_ATTENTION,
            **extra)


class EagleModel(nn.Module):
    """The drafter ``g`` plus frozen copies of the target's embedding and LM head.

    ``meta.input_norm`` / ``meta.final_norm`` False replace layer 0's input norm / the
    final norm with identities (EAGLE-1/2's layout; their weights are then absent from
    the state dict); ``meta.fc_bias`` False drops ``fc``'s bias."""

    def __init__(self, meta: EagleMeta) -> None:
        super().__init__()
        self.meta = meta
        self.config = meta.layer_config()
        h, v = meta.hidden_size, meta.vocab_size
        self.embed = nn.Embedding(v, h)
        self.fc = nn.Linear(2 * h, h, bias=meta.fc_bias)
        self.decoder = LlamaModel(self.config)
        self.decoder.embed_tokens = None  # inputs come as embeddings (fc's output)
        if not meta.input_norm:  # EAGLE-1/2: layer 0 reads fc's output as it is
            self.decoder.layers[0].input_layernorm = nn.Identity()
        if not meta.final_norm:  # EAGLE-1/2: f_hat is the last layer's residual stream
            self.decoder.norm = nn.Identity()
        self.lm_head = nn.Linear(h, v, bias=False)
        for frozen in (self.embed, self.lm_head):
            frozen.weight.requires_grad_(False)

    @classmethod
    def from_target(cls, target: nn.Module, layers: int = 1, input_norm: bool = True,
                    final_norm: bool = True) -> EagleModel:
        """A fresh drafter for ``target`` (a HF causal LM): its embedding and LM head
        copied and frozen, ``g`` randomly initialised (``input_norm`` / ``final_norm``:
        the layout, :class:`EagleMeta`)."""
        model = cls(EagleMeta.for_target(target.config, layers, input_norm, final_norm))
        with torch.no_grad():
            model.embed.weight.copy_(target.get_input_embeddings().weight)
            model.lm_head.weight.copy_(target.get_output_embeddings().weight)
        return model.to(next(target.parameters()).dtype)

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False,
                logits_to_keep: int | torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``features [B, T, H]`` (``f_t``), ``input_ids [B, T]`` (``x_{t+1}``) ->
        ``(f_hat [B, T, H], logits [B, T, V])``. ``attention_mask``: None (causal), a
        ``[B, S]`` padding mask or a ``[B, 1, T, S]`` additive mask (tree attention).
        ``logits_to_keep``: logits at those positions only (:func:`kept_positions`)."""
        emb = self.embed(input_ids)
        if self.meta.embed_scale != 1.0:  # as the target family embeds (Gemma: sqrt(H))
            emb = emb * self.meta.embed_scale
        x = self.fc(torch.cat([features.to(self.fc.weight.dtype), emb], -1))
        out = self.decoder(inputs_embeds=x, position_ids=position_ids,
                           attention_mask=attention_mask, past_key_values=past_key_values,
                           use_cache=use_cache)
        f_hat = out.last_hidden_state
        return f_hat, self.lm_head(kept_positions(f_hat, logits_to_keep))

    def cost_inputs(self, n: int) -> dict[str, torch.Tensor]:
        """:func:`feature_inputs`: what a forward of ``n`` new tokens takes besides them."""
        return feature_inputs(self, n)


def feature_inputs(model: nn.Module, n: int) -> dict[str, torch.Tensor]:
    """The inputs an EAGLE-family drafter's forward of ``n`` new tokens takes besides the
    tokens (batch of one): ``{"features": [1, n, H]}`` zeros on its device, ``H`` its own
    width, what its tree steps read (an EAGLE-3 drafter's one forward per round over the
    target's fused ``[k * H]`` features also runs ``fc``, which these leave out). The
    forward cost curves (:mod:`speclab.forward_costs`) time its forwards with them."""
    p = next(model.parameters())
    return {"features": torch.zeros(1, n, model.meta.hidden_size, device=p.device,
                                    dtype=p.dtype)}


def embedding_scale(config) -> float:
    """The multiplier a target family applies to its input embeddings (the drafter
    embeds tokens as the target does): ``sqrt(hidden_size)`` for the Gemma families,
    Granite's ``embedding_multiplier``, else 1."""
    if str(getattr(config, "model_type", "")).startswith("gemma"):
        return float(config.hidden_size) ** 0.5
    return float(getattr(config, "embedding_multiplier", None) or 1.0)


def save_eagle(model: EagleModel, folder: str | Path) -> Path:
    """Write ``config.json`` (the meta) and ``model.safetensors`` to ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(asdict(model.meta), indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder


def is_eagle_folder(folder: str | Path) -> bool:
    """True when ``folder`` holds an EAGLE drafter written by :func:`save_eagle`."""
    cfg = Path(folder) / "config.json"
    try:
        return json.loads(cfg.read_text()).get("kind") == KIND
    except (OSError, ValueError):
        return False


def load_eagle(folder: str | Path, target_config=None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", field: str = "eagle_model",
               target: nn.Module | str | None = None) -> nn.Module:
    """Load an EAGLE drafter: a folder written by :func:`save_eagle`, or a public
    checkpoint (:func:`speclab.models.formats.detect_drafter_format`: EAGLE-1/2 / HASS
    research code, speculators ``eagle``). With ``target_config`` (the target's HF config)
    a drafter trained for another target is a ``ValueError`` naming ``field``. A public
    checkpoint takes the LM head (and the embedding, when it has none) from ``target``
    (the loaded target model or its folder); without it that is a ValueError too."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not is_eagle_folder(folder):
        from speclab.models.formats import load_public_eagle

        model = load_public_eagle(folder, target, target_config, field)
        return model.to(device=device, dtype=dtype).eval()
    data = json.loads((folder / "config.json").read_text())
    meta = meta_from_dict(data)
    if target_config is not None:
        meta.check_target(target_config, field)
    model = build_eagle(meta)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    return model.to(device=device, dtype=dtype).eval()


def meta_from_dict(data: dict) -> EagleMeta:
    """The :class:`EagleMeta` of a drafter's ``config.json`` (other keys, e.g. where an
    imported drafter came from, are ignored; absent layout keys mean today's layout)."""
    kept = {k: v for k, v in data.items() if k in EagleMeta.__dataclass_fields__}
    if kept.get("feature_layers") is not None:
        kept["feature_layers"] = tuple(int(i) for i in kept["feature_layers"])
    return EagleMeta(**kept)


def build_eagle(meta: EagleMeta) -> nn.Module:
    """An untrained drafter of ``meta``'s architecture: :class:`EagleModel` (EAGLE-1/2,
    ``version`` 1) or :class:`~speclab.families.eagle.model3.Eagle3Model` (``version`` 3)."""
    if meta.version == 3:
        from speclab.families.eagle.model3 import Eagle3Model

        return Eagle3Model(meta)
    if meta.version != 1:
        raise ValueError(f"eagle_model: unknown EAGLE version {meta.version} (1 or 3)")
    return EagleModel(meta)


def is_eagle_model(model) -> bool:
    """True for a loaded EAGLE-family drafter (EAGLE-1/2 or EAGLE-3)."""
    return isinstance(getattr(model, "meta", None), EagleMeta)


def trained_meta(config, e) -> EagleMeta:
    """The meta of the drafter a training job's ``eagle`` group ``e`` (``version``,
    ``layers``, ``norms``, ``feature_layers``, ``draft_vocab``) makes for a target with HF
    ``config``: EAGLE-1/2 or, ``version: 3``, EAGLE-3."""
    if e.version == 3:
        from speclab.families.eagle.model3 import eagle3_meta

        return eagle3_meta(config, e.feature_layers, e.draft_vocab)
    return EagleMeta.for_target(config, e.layers, e.norms, e.norms)


def load_init(folder: str | Path, target_config, e, field: str = "eagle.init_from"
              ) -> nn.Module:
    """A trained drafter to continue training from: :func:`load_eagle` checked against
    the target (errors name ``field``) and against the shape the ``eagle`` group ``e``
    trains (:func:`trained_meta`)."""
    model = load_eagle(folder, target_config, field=field)
    if model.meta.version == 1 and e.version == 1 and model.meta.layers != e.layers:
        raise ValueError(f"{field}: the drafter has {model.meta.layers} layers, "
                         f"eagle.layers is {e.layers}")
    want = trained_meta(target_config, e)
    if model.meta != want:
        raise ValueError(f"{field}: the drafter's shape {asdict(model.meta)} is not that of "
                         f"the drafter eagle.* trains for this target, {asdict(want)}")
    return model


def check_artifact(model: nn.Module, target_config, field: str, target_source: str | None,
                   target_vocab: int) -> None:
    """The family's artifact check (Serve's draft replica at load): ValueError naming
    ``field`` unless the drafter was trained for the target (its HF config:
    architecture, hidden size, vocabulary; without the target's folder, the
    vocabulary ``target_vocab`` alone)."""
    del target_source
    if target_config is not None:
        model.meta.check_target(target_config, field)
    elif int(model.meta.vocab_size) != int(target_vocab):
        raise ValueError(f"{field}: trained for a target with vocab_size="
                         f"{model.meta.vocab_size}, but the target has {target_vocab}")


def kept_positions(x: torch.Tensor, keep: int | torch.Tensor | None) -> torch.Tensor:
    """``x [B, T, ...]`` at the positions an LM head's logits are wanted, as Hugging Face
    models read ``logits_to_keep``: None all ``T``, an int the last ``keep``, a ``[K]``
    index tensor those ``K`` positions (every row's)."""
    if keep is None:
        return x
    return x[:, -keep:] if isinstance(keep, int) else x[:, keep]
