"""Online features (``eagle.features: online``): the batch the target computes inside a
training step equals the stored rows' batch (up to their float16 rounding) for EAGLE-1/2
and EAGLE-3 features, so both modes train the same loss; and a global batch is the same
rows on any number of workers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from speclab.decoding.runner import ModelRunner
from speclab.families.eagle.training import (
    collate_feat,
    eagle3_loss,
    feature_loss,
    online_feat_batch,
)
from speclab.models.tiny import tiny_llama_config
from speclab.train.distill_data import feat_example


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=64, hidden_size=32, num_layers=4)
                            ).eval()


@pytest.mark.parametrize("spec", [None, (1, 2, 3)], ids=["last-layer", "eagle3-fused"])
def test_online_batch_equals_the_offline_rows(target, spec):
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 64, (3, 17), generator=g).tolist()
    offline = collate_feat([feat_example(ModelRunner(target), w, 5, spec) for w in windows])
    rows = [{"tokens": w, "loss_mask": [0] * 5 + [1] * 12} for w in windows]
    online = online_feat_batch(target, rows, 5, spec)
    assert online["features"].shape == offline["features"].shape
    assert torch.equal(online["tokens"], offline["tokens"])
    assert torch.allclose(online["features"], offline["features"], atol=2e-3, rtol=1e-3)
    assert torch.equal(online["topk_ids"], offline["topk_ids"])
    assert torch.allclose(online["topk_probs"], offline["topk_probs"], atol=1e-5)
    assert online["loss_mask"].shape == (3, 17)
    offline["loss_mask"] = online["loss_mask"]  # a conversation's rows carry one alike

    from speclab.families.eagle.model import EagleModel
    from speclab.families.eagle.model3 import Eagle3Model

    torch.manual_seed(0)
    if spec is None:
        drafter = EagleModel.from_target(target, 1).eval()
        a, b = (feature_loss(drafter, x, steps=3, w_topk=1.0, top_k=3)
                for x in (online, offline))
    else:
        drafter = Eagle3Model.from_target(target, spec).eval()
        a, b = (eagle3_loss(drafter, x, steps=3) for x in (online, offline))
    assert torch.allclose(a, b, rtol=1e-4), (float(a), float(b))


def _eagle3_reference(target, model, tokens: torch.Tensor, loss_mask: torch.Tensor,
                      steps: int, decay: float = 0.8) -> torch.Tensor:
    """EAGLE-3's loss as its ``traineagle3`` code computes it, written out on its own: the
    target's logits (all positions) restricted to the draft vocabulary (``t2d``) and
    softmaxed; ``position_mask`` = the target's argmax is in the draft vocabulary x the
    loss mask; per TTT step ``-sum(position_mask * target_p * log_softmax(drafter logits
    over the draft vocabulary))``, weighted ``0.8 ** step``. Each step is divided by its
    scored positions (EAGLE-3's code divides by B * T: a constant factor per batch). The
    drafter's step outputs come from :func:`hass_forward`, which other tests check
    against step-by-step decoding."""
    from speclab.decoding.features import FeatureHooks
    from speclab.families.eagle.training import hass_forward

    hooks = FeatureHooks(target)
    hooks.add(model.meta.feature_layers)
    with torch.no_grad():
        logits = target(input_ids=tokens[:, :-1]).logits.float()  # [B, L, V]
        fused = hooks.get(model.meta.feature_layers).float()
    hooks.remove()
    length = logits.shape[1]
    t = length - 1
    t2d = model.t2d
    target_head = logits[:, 1:][..., t2d]  # [B, T, V_d]: pair j predicts position j + 1
    target_p = target_head.softmax(-1)
    target_mask = t2d[logits[:, 1:].argmax(-1)].float()  # [B, T]
    position_mask = target_mask * loss_mask[:, 2: t + 2]
    total = torch.zeros(())
    outs = hass_forward(model, fused[:, :-1], tokens[:, 1:length], steps, False)
    for s, (_, out_logits) in enumerate(outs):
        out_logp = out_logits[..., t2d].float().log_softmax(-1)  # the draft head's V_d
        valid = position_mask * (torch.arange(t) >= s).float()
        plogp = target_p * out_logp
        total = total + decay ** s * -(valid[..., None] * plogp).sum() / valid.sum()
    return total


@pytest.mark.parametrize("draft_vocab", [24, 64], ids=["draft-vocab-24", "whole-vocab"])
def test_eagle3_loss_is_eagle3s_reference_computation(target, draft_vocab):
    """The ``draft_vocab`` teacher (EAGLE-3's, computed with online features) gives
    exactly EAGLE-3's loss; with a draft vocabulary, positions whose target argmax lies
    outside it are masked, so the ``topk`` variant (today's, kept as an option) differs
    there; the config refuses the EAGLE-3 teacher with offline features."""
    from speclab.config.schema import EagleTrainConfig
    from speclab.families.eagle.model3 import Eagle3Model

    g = torch.Generator().manual_seed(3)
    windows = torch.randint(0, 64, (3, 17), generator=g).tolist()
    rows = [{"tokens": w, "loss_mask": [0] * 5 + [1] * 12} for w in windows]
    spec = (1, 2, 3)
    torch.manual_seed(0)
    ids = torch.arange(0, 64, 64 // draft_vocab)[:draft_vocab] if draft_vocab < 64 else None
    model = Eagle3Model.from_target(target, spec, ids).eval()
    batch = online_feat_batch(target, rows, 5, spec, draft_ids=model.draft_ids)
    assert batch["teacher_probs"].shape == (3, 16, draft_vocab)
    ours = eagle3_loss(model, batch, steps=3)
    want = _eagle3_reference(target, model, batch["tokens"], batch["loss_mask"], 3)
    assert torch.allclose(ours, want, rtol=1e-5), (float(ours), float(want))
    from speclab.families.eagle.task import EagleTask
    from speclab.families.eagle.training import pair_mask

    scored = pair_mask(batch, 15) * batch["teacher_mask"][:, 1:16]  # what global_share weighs
    assert EagleTask.scored(None, batch) == float(scored.sum())
    outside = 1 - batch["teacher_mask"][:, 1:]
    topk = eagle3_loss(model, {k: v for k, v in batch.items()
                               if not k.startswith("teacher_")}, steps=3)
    if draft_vocab < 64:
        assert outside.sum() > 0 and not torch.allclose(topk, ours, rtol=1e-3)
    else:
        assert outside.sum() == 0
    assert EagleTrainConfig(version=3, loss="eagle3", features="online").teacher == \
        "draft_vocab"
    assert EagleTrainConfig(version=3, loss="eagle3").teacher == "topk"
    with pytest.raises(ValueError, match="eagle3_teacher: draft_vocab reads"):
        EagleTrainConfig(version=3, loss="eagle3", eagle3_teacher="draft_vocab")


def test_medusa_online_batch_equals_the_offline_medusa_rows(target):
    """``medusa.features: online``: the shards hold prompts + the target's greedy
    continuations alone (``medusa_windows``), and the frozen target's features and top-k
    computed in the step equal the offline ``medusa`` rows' (up to their float16
    rounding), so both modes train the same heads' loss."""
    from speclab.config.schema import MedusaTrainConfig
    from speclab.families.medusa.model import MedusaHeads
    from speclab.families.medusa.objectives import Medusa1Knobs, medusa1_objective
    from speclab.families.medusa.stages import data_kind, group_kinds
    from speclab.train.distill_data import greedy_continuations, medusa_examples

    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, 64, (4, 6), generator=g).tolist()
    runner = ModelRunner(target)
    offline = collate_feat(medusa_examples(runner, prompts, 8, 5))
    outs = greedy_continuations(runner, prompts, 8, None, 64)
    online = online_feat_batch(target, [{"tokens": p + o} for p, o in zip(prompts, outs)], 5)
    assert torch.equal(online["tokens"], offline["tokens"])
    assert torch.allclose(online["features"], offline["features"], atol=2e-3, rtol=1e-3)
    assert torch.equal(online["topk_ids"], offline["topk_ids"])
    assert torch.allclose(online["topk_probs"], offline["topk_probs"], atol=1e-5)
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(target, "tiny", 3).eval()
    knobs = Medusa1Knobs()
    a, b = (medusa1_objective(heads, {**x, "first_label": 6}, knobs) for x in (online, offline))
    assert torch.allclose(a, b, rtol=1e-4), (float(a), float(b))
    assert data_kind(MedusaTrainConfig(features="online")) == "medusa_windows"
    assert group_kinds(MedusaTrainConfig()) == {"medusa"}


def test_a_global_batch_is_the_same_rows_on_any_number_of_workers(monkeypatch):
    import torch.distributed as dist

    from speclab.train.tasks import global_batch_rows

    one, _ = global_batch_rows(7, 3, 0, rows=100, batch_size=8)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    halves = [global_batch_rows(7, 3, r, rows=100, batch_size=4)[0] for r in (0, 1)]
    assert halves[0] + halves[1] == one
    assert global_batch_rows(7, 4, 0, 100, 4)[0] != halves[0]  # another step, other rows


def test_online_objectives_train_on_windows_and_talf_is_refused():
    from speclab.config.schema import EagleTrainConfig
    from speclab.families.eagle.stages import group_kinds

    for loss, version in (("eagle", 1), ("hass", 1), ("eagle3", 3)):
        online = EagleTrainConfig(loss=loss, version=version, features="online")
        assert group_kinds(online) == {"windows"}
        offline = EagleTrainConfig(loss=loss, version=version)
        assert group_kinds(offline) == {"feat3" if version == 3 else "feat"}
    with pytest.raises(ValueError, match="features: online"):
        EagleTrainConfig(loss="talf", features="online")


def test_window_kinds_cut_the_same_windows():
    """Online (``windows``) and offline (``feat`` / ``feat3``) runs, and KD, train on the
    same windows; prompt kinds draw their own."""
    from speclab.config.schema import DistillConfig
    from speclab.pipelines.signals import plan_starts

    tokens = torch.arange(5000) % 97
    d = DistillConfig(examples=20, seq_len=16)
    same = {k: plan_starts(d, 3, tokens, k) for k in ("kd", "windows", "feat", "feat3",
                                                       "feat_tree", "feat3_tree")}
    assert len({tuple(s) for s, _ in same.values()}) == 1
    assert plan_starts(d, 3, tokens, "seq")[0] != same["kd"][0]
    assert plan_starts(d, 4, tokens, "feat")[0] != same["feat"][0]  # another seed
