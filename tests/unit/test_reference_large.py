"""``reference-large``'s growth functions on tiny random LLaMAs (the real model is never
built here): widening (tiled weights, head_dim kept, GQA, tied heads untied) and
deepening (inserted layers with zero output projections) keep the target's logits, and
the widened EAGLE drafters and Medusa heads propose what the small ones propose."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from speclab.reference_large import (
    LargeSpec,
    deepen_llama,
    deepened_index,
    deepened_layout,
    widen_eagle,
    widen_llama,
    widened_config,
)

IDS = [3, 17, 41, 5, 60, 22, 9, 33, 48, 1, 27, 14, 52, 7]


def _llama(tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    """A random 3-layer LLaMA with GQA (4 heads, 2 KV heads of head_dim 8)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, tie_word_embeddings=tied,
                      attn_implementation="sdpa", architectures=["LlamaForCausalLM"])
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked, non-trivial logits; norms away from 1
        model.get_output_embeddings().weight.mul_(8.0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def _cached_logits(model, ids=IDS, split: int = 9) -> torch.Tensor:
    """Logits of ``ids[split:]`` decoded one by one on top of a cache of ``ids[:split]``
    (rotary positions and the KV cache in play)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = []
    with torch.no_grad():
        model(input_ids=torch.tensor([ids[:split]]), past_key_values=cache, use_cache=True)
        for t in ids[split:]:
            out.append(model(input_ids=torch.tensor([[t]]), past_key_values=cache,
                             use_cache=True).logits[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("tied", [False, True])
def test_widening_and_deepening_keep_the_logits(tied):
    small = _llama(tied)
    want = _logits(small)
    wide = widen_llama(small, 3)
    cfg = wide.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (96, 144, 12, 6, 8)
    assert not cfg.tie_word_embeddings
    torch.testing.assert_close(_logits(wide), want, atol=1e-5, rtol=1e-5)
    deep = deepen_llama(small, 7)
    assert deep.config.num_hidden_layers == 7
    torch.testing.assert_close(_logits(deep), want, atol=1e-5, rtol=1e-5)
    both = widen_llama(deepen_llama(small, 7), 3)
    torch.testing.assert_close(_logits(both), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_cached_logits(both), _cached_logits(small), atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(_logits(deepen_llama(widen_llama(small, 3), 7)), want,
                               atol=1e-5, rtol=1e-5)
    assert want.abs().max() > 1.0  # the comparison is not between near-zero logits


def test_inserted_layers_are_full_layers_that_add_nothing():
    small = _llama()
    deep = deepen_llama(small, 7)
    layout = deepened_layout(3, 7)
    assert [src for src, ins in layout if not ins] == [0, 1, 2]
    assert sum(ins for _, ins in layout) == 4 and layout[0] == (0, False)
    for layer, (src, inserted) in zip(deep.model.layers, layout):
        orig = small.model.layers[src]
        torch.testing.assert_close(layer.self_attn.q_proj.weight, orig.self_attn.q_proj.weight)
        torch.testing.assert_close(layer.mlp.up_proj.weight, orig.mlp.up_proj.weight)
        zero = layer.self_attn.o_proj.weight.abs().sum() + layer.mlp.down_proj.weight.abs().sum()
        assert (zero == 0) == inserted
    with pytest.raises(ValueError, match="depth 2 < the model's 3 layers"):
        deepen_llama(small, 2)


def test_only_llama_models_are_widened():
    from transformers import Qwen2Config

    with pytest.raises(ValueError, match="only llama models are widened, got 'qwen2'"):
        widened_config(Qwen2Config(hidden_size=32, num_attention_heads=4), 2)


def test_the_widened_eagle_drafter_proposes_what_the_small_one_does():
    from speclab.families.eagle.model import EagleMeta, EagleModel

    small = _llama()
    torch.manual_seed(1)
    drafter = EagleModel.from_target(small).eval()
    with torch.no_grad():  # a drafter whose every part matters (fc bias, norms)
        drafter.fc.bias.normal_()
        for name, p in drafter.decoder.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if "norm" in name else p.mul_(5.0)
    large = widen_llama(deepen_llama(small, 5), 3)
    wide = widen_eagle(drafter, 3, large.config)
    assert wide.meta == EagleMeta.for_target(large.config, 1)
    with pytest.raises(ValueError, match="widened meta"):
        widen_eagle(drafter, 2, large.config)

    def feats(model):
        grabbed = []
        hook = model.get_output_embeddings().register_forward_pre_hook(
            lambda _m, args: grabbed.append(args[0][0]))
        _logits(model)
        hook.remove()
        return grabbed[0][None, :-1]

    f_small, f_large = feats(small), feats(large)
    torch.testing.assert_close(f_large, f_small.repeat(1, 1, 3), atol=1e-5, rtol=1e-5)
    x = torch.tensor([IDS[1:]])
    with torch.no_grad():
        h_small, q_small = drafter(f_small, x)
        h_wide, q_wide = wide(f_large, x)
    torch.testing.assert_close(h_wide, h_small.repeat(1, 1, 3), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(q_wide, q_small, atol=1e-4, rtol=1e-4)
    assert q_small.std() > 0.5  # proposals that depend on the input
    assert torch.equal(q_wide.argmax(-1), q_small.argmax(-1))


def _assert_pairs_decode_alike(tmp_path, method: str = "eagle", **knobs) -> list[int]:
    """``method`` decoding of ``tmp_path/small`` with the drafter in ``e_small`` and of
    ``tmp_path/large`` with ``e_large`` gives the same tokens AND the same rounds (the
    same proposals accepted). Returns the rounds' accepted lengths."""
    from speclab.api import Decoder

    knobs = knobs or {"tree_top_k": 2, "depth": 3, "nodes": 6}
    runs = {}
    for name in ("small", "large"):
        dec = Decoder.from_pretrained(str(tmp_path / name))
        runs[name] = dec.generate(prompt_ids=IDS[:5], max_new_tokens=16, method=method,
                                  **{f"{method}_model": str(tmp_path / f"e_{name}")}, **knobs)
    assert runs["large"].token_ids == runs["small"].token_ids
    assert runs["large"].stats.accepted_lengths == runs["small"].stats.accepted_lengths
    return runs["small"].stats.accepted_lengths


def test_engine_decodes_the_grown_pair_as_the_small_one(tmp_path):
    """Through the engine: EAGLE decoding on the grown target with the widened drafter
    gives the small pair's tokens AND its rounds (the same proposals accepted)."""
    from speclab.families.eagle.model import EagleModel, save_eagle

    small = _llama(seed=2)
    torch.manual_seed(3)
    drafter = EagleModel.from_target(small).eval()
    large = widen_llama(deepen_llama(small, 5), 2)
    small.save_pretrained(tmp_path / "small")
    large.save_pretrained(tmp_path / "large")
    save_eagle(drafter, tmp_path / "e_small")
    save_eagle(widen_eagle(drafter, 2, large.config), tmp_path / "e_large")
    _assert_pairs_decode_alike(tmp_path)


def test_the_cache_key_covers_the_spec_and_the_base_pair():
    spec = LargeSpec()
    assert spec.digest("reference-a") != spec.digest("reference-b")
    assert spec.digest("reference-a") != LargeSpec(depth=spec.depth + 1).digest("reference-a")
    assert spec.digest("reference-a") == LargeSpec().digest("reference-a")


def test_the_cost_table_and_the_run_dtype():
    from speclab.reference_large import format_cost, run_dtype

    assert run_dtype("cpu") in ("bfloat16", "float32")
    one = {"threads": 2, "prefix": 128, "repeats": 10, "measured_at": "now",
           "load_avg_1min_before": 0.5, "target_ms": {"1": 20.0, "8": 23.0},
           "target_ratio": {"1": 1.0, "8": 1.15}, "eagle_ms": 1.6, "eagle_vs_target": 0.08}
    text = format_cost({"cpu": "x", "cpu_capability": "AVX512", "native_bfloat16": True,
                        "run_dtype": "bfloat16", "by_dtype": {"bfloat16": one}})
    assert "| x one token | 1.00 | 1.15 |" in text and "= 0.080 of a target forward" in text


def _eagle3(small, seed: int = 4):
    """An EAGLE-3 drafter for ``small`` over the embeddings, layer 1's input and the LM
    head's input (indices 0, 1 and L: each kind of index moves differently when the
    target is deepened), with a 40-token draft vocabulary; every part perturbed."""
    from speclab.families.eagle.model3 import Eagle3Model

    torch.manual_seed(seed)
    drafter = Eagle3Model.from_target(small, (0, 1, 3), torch.arange(0, 64, 64 // 40)[:40])
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name != "embed.weight":
                p.add_(0.3 * torch.randn_like(p)) if "norm" in name else p.mul_(5.0)
    return drafter.eval()


def test_deepened_index_points_at_the_same_state():
    assert [deepened_index(i, 3, 7) for i in range(4)] == [0, 2, 4, 7]
    assert deepened_layout(3, 7)[2] == (1, False) and deepened_layout(3, 7)[4] == (2, False)
    with pytest.raises(ValueError, match="feature_layers: index 4 outside"):
        deepened_index(4, 3, 7)


def test_the_widened_eagle3_drafter_proposes_what_the_small_one_does():
    """EAGLE-3: its fused layers move to the deepened target's states that hold the same
    features, ``fc`` and q/k/v over concatenated inputs are tiled part by part, the draft
    vocabulary is kept; fed each target's own features, both drafters give the same
    logits (and the wide one's outputs are the small one's tiled)."""
    from speclab.families.eagle.model import EagleMeta
    from speclab.reference_large import drafter_logits

    small = _llama()
    drafter = _eagle3(small)
    large = widen_llama(deepen_llama(small, 7), 2)
    wide = widen_eagle(drafter, 2, large.config, layers=3)
    assert wide.meta.version == 3 and wide.meta.feature_layers == (0, 2, 7)
    assert wide.meta.draft_vocab_size == 40 and torch.equal(wide.d2t, drafter.d2t)
    assert wide.meta == EagleMeta(**{**drafter.meta.__dict__, "hidden_size": 64, "heads": 8,
                                     "intermediate_size": 96, "feature_layers": (0, 2, 7)})
    q_small, q_wide = drafter_logits(small, drafter, IDS), drafter_logits(large, wide, IDS)
    finite = q_small > torch.finfo(torch.float32).min / 2
    assert torch.equal(finite, q_wide > torch.finfo(torch.float32).min / 2)
    assert finite.sum(-1).eq(40).all()  # the draft vocabulary only
    torch.testing.assert_close(q_wide[finite], q_small[finite], atol=1e-4, rtol=1e-4)
    assert q_small[finite].std() > 0.5
    assert torch.equal(q_wide.argmax(-1), q_small.argmax(-1))
    with pytest.raises(ValueError, match="give the small target's"):  # layers must move
        widen_eagle(drafter, 2, large.config)


@pytest.mark.parametrize("field,value", [
    ("target_hidden_size", 16), ("residual_norm", True), ("fc_input_norm", True),
    ("fc_state_norms", True), ("feed_normed", True), ("head_norm", False),
    ("qkv_bias", True), ("o_bias", True)])
def test_an_eagle3_variant_is_refused_for_widening_naming_the_field(field, value):
    """The variants' norms, biases and fused widths are not tiled: refused by name, with
    or without the wide target's config (no meta dump)."""
    from dataclasses import replace

    from speclab.families.eagle.model3 import Eagle3Model

    small = _llama()
    variant = Eagle3Model(replace(_eagle3(small).meta, **{field: value}))
    for config in (None, widen_llama(deepen_llama(small, 7), 2).config):
        with pytest.raises(ValueError, match=rf"widen_eagle: the drafter is an EAGLE-3 "
                           rf"variant \({field}={value!r}\); only drafters with the default"):
            widen_eagle(variant, 2, config, layers=3)


def test_engine_decodes_the_grown_pair_with_eagle3_as_the_small_one(tmp_path):
    """``widen_drafter_folder`` (what ``speclab reference --large --widen`` runs) on a
    stand-in ``reference-large`` folder, then the engine: EAGLE-3 decoding on the grown
    target with the widened drafter gives the small pair's tokens and rounds. A drafter
    for another target is refused by name."""
    import json

    from speclab.families.eagle.model import save_eagle
    from speclab.models.grow_drafters import widen_drafter_folder
    from speclab.reference_large import widen_eagle_folder

    small = _llama(seed=2)
    folders = _stand_in_large(tmp_path, small, widen_llama(deepen_llama(small, 7), 2))
    save_eagle(_eagle3(small, seed=5), tmp_path / "e_small")
    check = widen_drafter_folder(str(tmp_path / "e_small"), str(tmp_path / "e_large"),
                                 folders, log=lambda _m: None, ids=IDS)
    assert check["kind"] == "eagle" and check["version"] == 3
    assert check["greedy_agreement"] == 1.0 and check["feature_layers"] == [0, 2, 7]
    assert json.loads((tmp_path / "e_large" / "widened.json").read_text()) == check
    _assert_pairs_decode_alike(tmp_path)
    other = LlamaForCausalLM(LlamaConfig(**{**small.config.to_dict(), "hidden_size": 48,
                                           "intermediate_size": 48})).eval()
    save_eagle(_eagle3(other), tmp_path / "wrong")
    with pytest.raises(ValueError, match="--widen"):
        widen_eagle_folder(str(tmp_path / "wrong"), str(tmp_path / "x"), folders,
                           log=lambda _m: None, ids=IDS)


def _stand_in_large(tmp_path, small, large):
    """``small`` / ``large`` saved as a stand-in ``reference-large`` folder (its
    ``reference_large.json`` names the small target and the widening 2)."""
    import json

    from speclab.reference_large import ReferenceLarge

    small.save_pretrained(tmp_path / "small")
    large.save_pretrained(tmp_path / "large")
    (tmp_path / "reference_large.json").write_text(json.dumps(
        {"base_pair": {"target": str(tmp_path / "small")}, "spec": {"widen": 2}}))
    return ReferenceLarge(str(tmp_path / "large"), "", "", "", str(tmp_path))


def _medusa(target, seed: int = 4):
    """Medusa heads for ``target``: the untrained heads (each repeats the target's
    next-token guess, which is right where the target repeats itself) with every weight
    perturbed, so each part's widening is tested."""
    from speclab.families.medusa.model import MedusaHeads

    heads = MedusaHeads.from_target(target, "small", heads=3)
    torch.manual_seed(seed)
    with torch.no_grad():
        heads.w1.normal_(0, 0.05)
        heads.b1.normal_(0, 0.05)
        heads.w2.add_(0.05 * torch.randn_like(heads.w2))
    return heads.eval()


def test_widened_medusa_heads_give_the_small_ones_logits(tmp_path):
    """``speclab reference --large --widen`` on MEDUSA-1 heads (``widen_drafter_folder``
    on a stand-in ``reference-large``): the wide heads, fed the grown target's last
    feature, give every head's logits of the small heads fed the small target's; they
    carry the grown target's fingerprint and the calibration; through the engine, Medusa
    decoding of the grown pair gives the small pair's tokens and rounds. Heads for
    another target, and a folder that holds no drafter, are refused naming ``--widen``."""
    import json

    from speclab.families.medusa.model import load_medusa, save_medusa, target_fingerprint
    from speclab.models.grow_drafters import widen_drafter_folder, widen_medusa
    from speclab.reference_large import logits_and_features

    small = _llama(seed=2)
    large = widen_llama(deepen_llama(small, 7), 2)
    heads = _medusa(small)
    wide = widen_medusa(heads, 2, large)
    assert wide.meta.hidden_size == 64 and wide.meta.fingerprint == target_fingerprint(large)
    want = heads(logits_and_features(small, IDS)[1])
    got = wide(logits_and_features(large, IDS)[1])
    assert got.shape == want.shape == (3, len(IDS), 64) and want.std() > 1.0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not 3 x"):
        widen_medusa(heads, 3, large)

    folders = _stand_in_large(tmp_path, small, large)
    tree = {"accuracies": [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]]}
    save_medusa(heads, tmp_path / "e_small", tree=tree)
    check = widen_drafter_folder(str(tmp_path / "e_small"), str(tmp_path / "e_large"),
                                 folders, log=lambda _m: None, ids=IDS)
    assert check["kind"] == "medusa" and check["greedy_agreement"] == 1.0
    assert check["greedy_agreement_per_head"] == [1.0, 1.0, 1.0]
    assert json.loads((tmp_path / "e_large" / "widened.json").read_text()) == check
    loaded = load_medusa(tmp_path / "e_large", large)  # the grown target's heads
    assert loaded.tree == tree and loaded.w1.dtype == torch.float32
    with pytest.raises(ValueError, match="heads trained for target"):
        load_medusa(tmp_path / "e_large", deepen_llama(widen_llama(_llama(seed=9), 2), 7))
    rounds = _assert_pairs_decode_alike(tmp_path, "medusa", tree="sparse", nodes=6)
    assert max(rounds) > 1  # proposals were accepted, so they were compared

    save_medusa(_medusa(widen_llama(small, 2)), tmp_path / "wrong")  # another target's
    with pytest.raises(ValueError, match="--widen"):
        widen_drafter_folder(str(tmp_path / "wrong"), str(tmp_path / "x"), folders,
                             log=lambda _m: None, ids=IDS)
    (tmp_path / "neither").mkdir()
    with pytest.raises(ValueError, match="--widen: .* holds neither"):
        widen_drafter_folder(str(tmp_path / "neither"), str(tmp_path / "x"), folders)
