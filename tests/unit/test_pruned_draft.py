"""A draft cut from its target (``arch.init_from``): the cut model is the target's first
layers under its own final norm and LM head, it survives the distillation job's
save/load path, and cuts that cannot work are refused by the field that asks for them."""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from speclab.config import ConfigError, ExperimentConfig
from speclab.config.schema import DraftArchConfig
from speclab.models.pruned import check_cut, cut_model
from speclab.pipelines.fit import _build_model
from speclab.train.tasks import DistillTaskConfig, parse_task_config


def _smol_like(path, tied: bool = True, layers: int = 4, vocab: int = 96) -> str:
    """A tiny LLaMA shaped like SmolLM2 (grouped-query attention, tied head)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=96,
                      num_hidden_layers=layers, num_attention_heads=6, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=tied,
                      bos_token_id=None, pad_token_id=None, eos_token_id=1)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("tied", [True, False])
def test_the_cut_is_the_targets_first_layers_under_its_norm_and_head(tmp_path, tied):
    source = _smol_like(tmp_path / "t", tied)
    full = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    cut = cut_model(source, 2, 96, eos=1).eval()
    assert cut.config.num_hidden_layers == 2 and len(cut.model.layers) == 2
    assert cut.config.tie_word_embeddings == tied
    ids = torch.tensor([[5, 9, 17, 3, 40, 41, 2]])
    with torch.no_grad():
        # the full model's residual stream after its second layer, read out through its
        # own final norm and LM head, is what the cut model predicts
        hidden = full(ids, output_hidden_states=True).hidden_states[2]  # [1, T, d]
        want = full.lm_head(full.model.norm(hidden))  # [1, T, V]
        got = cut(ids).logits  # [1, T, V]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(cut.lm_head.weight, full.lm_head.weight)
    assert cut.generation_config.eos_token_id == 1


def test_the_distill_build_and_save_path_keeps_the_cut(tmp_path):
    """``_build_model`` (workers and ``save_final``) builds the cut from a resolved
    ``arch``; a trained state loads into a fresh build and saves as a loadable model of
    the source's class, with the target's layers past the cut gone."""
    source = _smol_like(tmp_path / "t")
    arch = DraftArchConfig(layers=3, init_from=source)
    trained = _build_model(arch, 96, 1)
    with torch.no_grad():
        trained.model.layers[0].mlp.up_proj.weight.add_(0.5)  # "training"
    fresh = _build_model(arch, 96, 1)
    fresh.load_state_dict(trained.state_dict())
    fresh.save_pretrained(tmp_path / "draft")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "draft", dtype=torch.float32).eval()
    assert type(back) is LlamaForCausalLM and back.config.num_hidden_layers == 3
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, trained.eval()(ids).logits)


def test_cuts_that_cannot_work_are_refused(tmp_path):
    source = _smol_like(tmp_path / "t", layers=4, vocab=96)
    with pytest.raises(ValueError, match="arch.layers: 5 exceeds the 4 decoder layers"):
        check_cut(source, 5, 96)
    with pytest.raises(ValueError, match="arch.init_from: .* vocabulary of 96 tokens, the "
                                         "target 128"):
        check_cut(source, 2, 128)
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2,
                               n_positions=64)).save_pretrained(gpt2)
    with pytest.raises(ValueError, match="arch.init_from: .* no num_hidden_layers|"
                                         "GPT2LMHeadModel, which has no model.layers"):
        cut_model(str(gpt2), 1, 96)


@pytest.mark.parametrize("overrides,message", [
    (["arch.init_from=target", "arch.hidden=256"], "arch.hidden: comes from init_from"),
    (["arch.init_from=target", "arch.heads=2", "arch.context=64"],
     "arch.context: comes from init_from"),
    (["arch.init_from=' '"], "arch.init_from: empty"),
])
def test_the_config_names_what_a_cut_decides(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ExperimentConfig.from_dict({"job": "distill"}, overrides)
    # what the workers get: the task config's JSON dump (every field), validated again
    cfg = ExperimentConfig.from_dict({"job": "distill"}, ["arch.init_from=target"])
    task = DistillTaskConfig(train=cfg.train, arch=cfg.arch)
    assert parse_task_config(task.model_dump(mode="json")).arch.init_from == "target"
    # the other training jobs keep the plain architecture: the key is unknown there
    with pytest.raises(ConfigError, match="arch.init_from: Extra inputs"):
        ExperimentConfig.from_dict({"job": "train_target"}, ["arch.init_from=target"])
