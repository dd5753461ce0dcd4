"""EAGLE-3 (issue 35, item 2): the target's layer features, the drafter's cache and draft
vocabulary, lossless decoding under every tree builder, the training-time test (each
step is step-by-step decoding) and its loss, the folder and the training config."""

import pytest
import torch

from speclab import losses
from speclab.api import Decoder
from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.drafting import DraftTraits
from speclab.decoding.features import eagle3_layers, layer_ids
from speclab.decoding.loop import autoregressive_generate, generate_tokens
from speclab.decoding.rules import resolve_rule
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.families.eagle.drafter import EagleConfig, EagleDrafter
from speclab.families.eagle.model import EagleModel, load_eagle, save_eagle
from speclab.families.eagle.model3 import Eagle3Model
from speclab.families.eagle.training import collate_feat, eagle3_loss, hass_forward, talf_loss
from speclab.models.loading import load_model
from speclab.models.tiny import build_tiny_llama
from speclab.train.distill_data import feat_example

PROMPT = [3, 9, 27, 17, 51, 2]


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory) -> str:
    """A 6-layer tiny target: EAGLE-3's default layers are then (1, 3, 5)."""
    root = tmp_path_factory.mktemp("eagle3")
    return str(build_tiny_llama(root / "target", seed=4, vocab_size=64, num_layers=6))


def _traits(model) -> DraftTraits:
    return DraftTraits(needs_features=True, feature_layers=model.meta.feature_layers)


def _rows(target, windows: int = 24, length: int = 17, seed: int = 0, spec="eagle3"):
    """feat3 rows over the target's own greedy continuations of random starts."""
    runner = ModelRunner(target)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(windows):
        start = torch.randint(0, target.config.vocab_size, (3,), generator=g).tolist()
        out, _ = autoregressive_generate(runner, start, length - 3, SamplingParams(0.0))
        rows.append(feat_example(runner, start + out, 4, spec))
    return rows


def train_eagle3(target_dir: str, steps: int = 60, draft_vocab: int = 0) -> Eagle3Model:
    """An EAGLE-3 drafter trained ``steps`` steps (loss ``eagle3``, 3 TTT steps) on the
    target's fused features over its own greedy continuations, with a draft vocabulary
    of the ``draft_vocab`` most frequent target tokens (0: all; also used by Serve's
    tests)."""
    from speclab.families.eagle.task import draft_vocabulary

    target = load_model(target_dir)
    rows = _rows(target, windows=24, length=17)
    batch = collate_feat(rows)
    torch.manual_seed(0)
    ids = draft_vocabulary(rows, draft_vocab) if draft_vocab else None
    model = Eagle3Model.from_target(target, None, ids).float()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss = eagle3_loss(model, batch, steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_layer_specs_and_the_default_layers():
    assert eagle3_layers(32) == (2, 16, 29)
    assert eagle3_layers(6) == (1, 3, 5) and eagle3_layers(7) == (2, 3, 4)
    assert eagle3_layers(3) == (0, 1, 2) and eagle3_layers(2) == (0, 1, 2)
    assert layer_ids(None, 6) == (6,)
    assert layer_ids([0, 6], 6) == (0, 6)
    with pytest.raises(ValueError, match="eagle.feature_layers: layer indices \\[7\\]"):
        layer_ids([1, 7], 6, "eagle.feature_layers")


@pytest.mark.parametrize("spec", [None, (0, 2, 5, 6)])
def test_runner_features_are_the_hidden_states_hf_returns(deep_target, spec):
    """A spec's features are HF's ``output_hidden_states`` at its indices (index L: the LM
    head's input), for the single-row and the batched runner alike."""
    target = load_model(deep_target)
    tokens = torch.tensor(PROMPT)
    with torch.no_grad():
        states = target(tokens[None], output_hidden_states=True).hidden_states
    runner = ModelRunner(target)
    runner.track_hidden(spec)
    runner.reset()
    runner.forward(tokens)
    ids = layer_ids(spec, 6)
    want = torch.cat([states[i][0] for i in ids], -1)
    torch.testing.assert_close(runner.features(spec), want)
    torch.testing.assert_close(runner.hidden, states[6][0])
    batch = BatchRunner(target)
    batch.track_hidden(spec)
    batch.add_rows([PROMPT, PROMPT[:3]], logits=False)
    torch.testing.assert_close(batch.features(spec)[0, :len(PROMPT)], want, atol=1e-5,
                               rtol=1e-5)
    runner.release()
    batch.release()
    assert not target.model.layers[2]._forward_pre_hooks  # hooks removed with the runners


def test_cached_forwards_equal_one_forward(deep_target):
    """The drafter over a cache (pairs appended in two calls) equals one forward."""
    target = load_model(deep_target)
    torch.manual_seed(0)
    model = Eagle3Model.from_target(target).float().eval()
    f, ids = torch.randn(1, 8, 3 * 32), torch.randint(0, 64, (1, 8))
    from transformers import DynamicCache

    with torch.no_grad():
        full_h, full_l = model(f, ids)
        cache = DynamicCache()
        h1, l1 = model(f[:, :5], ids[:, :5], past_key_values=cache, use_cache=True)
        h2, l2 = model(f[:, 5:], ids[:, 5:], position_ids=torch.arange(5, 8)[None],
                       past_key_values=cache, use_cache=True)
    torch.testing.assert_close(torch.cat([h1, h2], 1), full_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([l1, l2], 1), full_l, atol=1e-5, rtol=1e-5)


def test_draft_vocabulary_maps_and_proposals(deep_target, tmp_path):
    """Draft id i is target id i + d2t[i]; logits outside the draft vocabulary are never
    proposed; the folder keeps the maps."""
    target = load_model(deep_target)
    ids = torch.arange(0, 64, 3)
    model = Eagle3Model.from_target(target, None, ids).float().eval()
    assert model.meta.draft_vocab_size == len(ids)
    assert torch.equal(model.draft_ids, ids)
    assert int(model.t2d.sum()) == len(ids) and bool(model.t2d[ids].all())
    torch.testing.assert_close(model.lm_head.weight, target.lm_head.weight[ids])
    with torch.no_grad():
        _, logits = model(torch.randn(1, 4, 96), torch.tensor([PROMPT[:4]]))
    probs = logits.softmax(-1)
    assert float(probs[..., ~model.t2d].max()) == 0.0
    runner = ModelRunner(target)
    tree = None
    drafter = EagleDrafter(model, 4, 3, 12)
    side_traits = _traits(model)
    out, _ = generate_tokens(runner, drafter, PROMPT, 12, SamplingParams(0.0),
                             resolve_rule(None, None, SamplingParams(0.0)), traits=side_traits)
    tree = drafter.propose(PROMPT + out, 3) if drafter.pending.shape[0] else None
    if tree is not None:
        assert all(bool(model.t2d[t]) for t in tree.tokens[1:])
    loaded = load_eagle(save_eagle(model, tmp_path / "e3"), target.config)
    assert loaded.meta == model.meta
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)


@pytest.mark.parametrize("builder", ["eagle2", "optimal", "salf"])
def test_greedy_output_is_the_targets(deep_target, builder):
    target = load_model(deep_target)
    torch.manual_seed(1)
    model = Eagle3Model.from_target(target, None, torch.arange(0, 64, 2)).float().eval()
    runner = ModelRunner(target)
    params = SamplingParams(0.0)
    want, _ = autoregressive_generate(runner, PROMPT, 24, params)
    got, stats = generate_tokens(runner, EagleDrafter(model, 3, 4, 10, builder=builder),
                                 PROMPT, 24, params, resolve_rule(None, None, params),
                                 traits=_traits(model))
    assert got == want
    assert stats.target_calls <= 24


def test_decoder_runs_eagle3_offline_and_batched(deep_target, tmp_path):
    """Through the public API: the method ``eagle`` with an EAGLE-3 folder reads the
    layers from it (traits), offline and batched, identical to plain decoding."""
    target = load_model(deep_target)
    folder = save_eagle(Eagle3Model.from_target(target).float(), tmp_path / "e3")
    cfg = EagleConfig(eagle_model=str(folder), depth=3, nodes=8)
    assert cfg.traits().feature_layers == (1, 3, 5)
    dec = Decoder.from_pretrained(deep_target)
    plain = dec.generate(prompt_ids=PROMPT, max_new_tokens=16, method="ar").token_ids
    one = dec.generate(prompt_ids=PROMPT, max_new_tokens=16, method=cfg)
    two = dec.generate(prompts=[PROMPT, PROMPT[:4]], max_new_tokens=16, method=cfg)
    assert one.token_ids == plain
    assert two[0].token_ids == plain
    assert one.stats.target_calls < 16


def test_the_static_fast_path_runs_eagle_drafters(deep_target, tmp_path, monkeypatch):
    """``Decoder(compile=True)``'s static layout (uncompiled here; compiled on CUDA in
    tests/gpu/test_cuda_compile.py): the target's step returns the features an EAGLE-3
    (layers 1, 3, 5) and an EAGLE-1 drafter (the last layer) read, the drafter runs on a
    fast path of its own, and every row drafts the trees of the eager batched engine:
    the same tokens and the same target calls."""
    import functools

    import speclab.api as api
    from speclab.decoding.static_runner import FastPath

    target = load_model(deep_target)
    e3 = save_eagle(train_eagle3(deep_target, steps=30), tmp_path / "e3")
    e1 = save_eagle(EagleModel.from_target(target).float(), tmp_path / "e1")
    monkeypatch.setattr(api, "FastPath", functools.partial(FastPath, compile=False))
    ps = [PROMPT, [5, 6, 7], list(range(1, 10)), [11, 12]]
    for folder in (e3, e1):
        cfg = EagleConfig(eagle_model=str(folder), depth=3, nodes=8)
        eager = Decoder.from_pretrained(deep_target).generate(
            prompts=ps, max_new_tokens=20, method=cfg, batch_size=2)
        dec = Decoder.from_pretrained(deep_target, compile=True, capacity=48)
        fast = dec.generate(prompts=ps, max_new_tokens=20, method=cfg, batch_size=2)
        assert [r.token_ids for r in fast] == [r.token_ids for r in eager], folder.name
        assert ([r.stats.target_calls for r in fast]
                == [r.stats.target_calls for r in eager]), folder.name
        assert len(dec._fast) == 2  # the target's static cache and the drafter's
        one = dec.generate(prompt_ids=PROMPT, max_new_tokens=20, method=cfg)
        assert one.token_ids == eager[0].token_ids


class _Recording(torch.nn.Module):
    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.calls = model, []
        self.t2d = model.t2d

    def forward(self, features, input_ids, **kwargs):
        out = self.model(features, input_ids, **kwargs)
        self.calls.append((*out, features.requires_grad))
        return out


def _decoded(model, feats, tokens, j: int, step: int):
    """Step ``step``'s logits at pair ``j`` by real decoding: pairs ``0..j-step+1`` with
    the target's fused features, then ``step - 1`` pairs fed the drafter's own output."""
    from transformers import DynamicCache

    c = j - step + 1
    cache = DynamicCache()
    out, logits = model(feats[None, : c + 1], tokens[None, 1: c + 2],
                        position_ids=torch.arange(c + 1)[None], past_key_values=cache,
                        use_cache=True)
    out, logits = out[:, -1:], logits[:, -1:]
    for p in range(c + 1, j + 1):
        out, logits = model(out, tokens[None, p + 1: p + 2], position_ids=torch.tensor([[p]]),
                            past_key_values=cache, use_cache=True)
    return logits[0, -1]


def test_training_time_test_steps_are_step_by_step_decoding(deep_target):
    """Every TTT step's logits (steps 2-4 feed the drafter's own outputs) equal decoding
    pair by pair on the same tokens; the fed-back outputs keep their graph (EAGLE-3)."""
    target = load_model(deep_target)
    torch.manual_seed(0)
    model = Eagle3Model.from_target(target).float()
    batch = collate_feat(_rows(target, windows=2, length=10))
    rec = _Recording(model)
    eagle3_loss(rec, batch, steps=4)
    t = batch["features"].shape[1] - 1
    assert len(rec.calls) == 4
    assert [c[2] for c in rec.calls] == [False, True, True, True]
    with torch.no_grad():
        for step, (_, logits, _) in enumerate(rec.calls, start=1):
            for j in sorted({step - 1, t - 1}):
                want = _decoded(model, batch["features"][0, :-1], batch["tokens"][0], j, step)
                torch.testing.assert_close(logits[0, j].detach(), want, atol=1e-4, rtol=1e-4)


class Wrapped(torch.nn.Module):
    """The drafter as DDP wraps it on Ray Train workers (no attributes of its own)."""

    def __init__(self, module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_eagle3_loss_is_the_decayed_sum_of_step_ces(deep_target):
    target = load_model(deep_target)
    torch.manual_seed(0)
    model = Eagle3Model.from_target(target, None, torch.arange(0, 64, 2)).float()
    batch = collate_feat(_rows(target, windows=2, length=8))
    t = batch["features"].shape[1] - 1
    outs = hass_forward(model, batch["features"][:, :-1], batch["tokens"][:, 1:t + 1], 3,
                        False)
    ids = batch["topk_ids"][:, 1:]
    probs = batch["topk_probs"][:, 1:] * model.t2d[ids]  # restricted to the draft vocab
    want = sum(0.8 ** (s - 1) * losses.soft_ce(
        logits, ids, probs, (torch.arange(t) >= s - 1).float().expand(2, t))
        for s, (_, logits) in enumerate(outs, start=1))
    got = eagle3_loss(model, batch, steps=3, decay=0.8)
    torch.testing.assert_close(got, want)
    assert torch.isfinite(got)

    torch.testing.assert_close(eagle3_loss(Wrapped(model), batch, steps=3, decay=0.8), want)


def test_training_raises_acceptance_and_talf_applies(deep_target):
    """A few steps of EAGLE-3 training lower the loss and raise the engine's tau over an
    untrained drafter; TALF's loss runs on an EAGLE-3 drafter (fused pass 0, own
    features deeper)."""
    from speclab.families.eagle.training import collate_forest, engine_acceptance
    from speclab.train.distill_data import feat_forest_example

    target = load_model(deep_target)
    rows = _rows(target, windows=24, length=17)
    batch = collate_feat(rows)
    torch.manual_seed(0)
    model = Eagle3Model.from_target(target).float()
    prompts = [r["tokens"][:8] for r in rows[:3]]
    before = engine_acceptance(target, model.eval(), prompts, 16)["engine_tau"]
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    history = []
    for _ in range(60):
        loss = eagle3_loss(model, batch, steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
    after = engine_acceptance(target, model.eval(), prompts, 16)
    assert history[-1] < 0.6 * history[0]
    assert after["engine_identical"] == 1.0
    assert after["engine_tau"] > before
    runner = ModelRunner(target)
    forest = collate_forest([feat_forest_example(runner, r["tokens"], 4, 2, 2, "eagle3")
                             for r in rows[:2]])
    assert forest["features"].shape[-1] == 96
    assert torch.isfinite(talf_loss(model, forest))
    torch.testing.assert_close(talf_loss(Wrapped(model), forest), talf_loss(model, forest))


def test_training_config_refuses_what_eagle3_cannot_train():
    from speclab.config.schema import EagleTrainConfig

    assert EagleTrainConfig(version=3, loss="eagle3").ttt_steps == 7
    with pytest.raises(ValueError, match="loss: 'hass' regresses"):
        EagleTrainConfig(version=3, loss="hass")
    with pytest.raises(ValueError, match="draft_vocab: an EAGLE-3 setting"):
        EagleTrainConfig(draft_vocab=32)
    with pytest.raises(ValueError, match="loss: eagle3 trains an EAGLE-3 drafter"):
        EagleTrainConfig(loss="eagle3")


def test_draft_vocabulary_is_the_most_frequent_trained_tokens():
    """As EAGLE-3 counts: the tokens under the loss mask (every token without one); ties
    to the target's more frequent top-1, then the lower id; then the lowest unseen ids."""
    from speclab.families.eagle.task import draft_vocabulary

    rows = [{"topk_ids": [[5, 1], [5, 2], [7, 1]], "tokens": [9, 9, 4, 3],
             "loss_mask": [1, 1, 0, 1]}]  # token 4 is a prompt token: not counted
    assert draft_vocabulary(rows, 2).tolist() == [3, 9]
    assert draft_vocabulary(rows, 3).tolist() == [3, 5, 9]
    assert draft_vocabulary(rows, 5).tolist() == [0, 3, 5, 7, 9]
    rows[0].pop("loss_mask")
    assert draft_vocabulary(rows, 3).tolist() == [3, 4, 9]  # the prompt token counts now


def test_target_data_windows_are_the_targets_greedy_text(deep_target):
    """``eagle.data: target``: each window keeps its first ``data_prompt`` tokens and the
    rest is the target's greedy continuation (checked against argmax over full forwards,
    past EOS); the feature rows hold those windows; the shard plan records the setting
    (corpus windows record nothing, so older plans still match); a prompt that leaves
    nothing to generate is refused, naming the field."""
    from types import SimpleNamespace

    from speclab.config.jobs import DistillEagleJob
    from speclab.train import distill_data as dd

    target = load_model(deep_target)
    g = torch.Generator().manual_seed(3)
    windows = torch.randint(0, 64, (5, 13), generator=g).tolist()
    got = dd.target_windows(ModelRunner(target), windows, keep=4, batch=2)
    assert [w[:4] for w in got] == [w[:4] for w in windows]
    for w in got:
        assert len(w) == 13
        with torch.no_grad():
            for i in range(4, 13):
                logits = target(input_ids=torch.tensor([w[:i]])).logits[0, -1]
                assert int(logits.argmax()) == w[i]
    assert got != windows  # the random windows are not the target's text

    eagle = SimpleNamespace(data="target", data_prompt=4, feature_layers=None)
    ctx = dd.SignalContext(ModelRunner(target), None, None, SimpleNamespace(top_k=4), 0,
                           eagle)
    rows = dd.data_kind("feat3").make(ctx, windows, 0)
    assert [r["tokens"] for r in rows] == got
    assert dd.data_kind("feat3").settings(eagle) == {
        "feature_layers": "eagle3", "data": "target", "data_prompt": 4}
    assert dd.data_kind("feat").settings(SimpleNamespace(data="corpus")) == {}
    corpus = dd.data_kind("feat").make(dd.SignalContext(
        ModelRunner(target), None, None, SimpleNamespace(top_k=4), 0,
        SimpleNamespace(data="corpus")), windows[:1], 0)
    assert corpus[0]["tokens"] == windows[0]

    with pytest.raises(ValueError, match=r"eagle.data_prompt \(24\) must be below "
                                         r"distill.seq_len \(24\)"):
        DistillEagleJob.model_validate({"distill": {"seq_len": 24},
                                        "eagle": {"data": "target", "data_prompt": 24}})


def test_a_window_shorter_than_the_evaluation_contexts_is_reported(capsys):
    """``context_window``: the trained window (``distill.seq_len + 1``) against the
    evaluation's longest context (the longest tokenised ``data`` prompt + ``max_new_tokens``),
    with a warning naming ``distill.seq_len`` only when the evaluation goes past the
    window (a stand-in tokenizer: one token per character)."""
    from speclab.config.jobs import DistillEagleJob
    from speclab.data.prompts import load_prompts
    from speclab.families.eagle.stages import context_window

    class Chars:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert not add_special_tokens
            return [ord(c) for c in text]

    cfg = DistillEagleJob.model_validate({"distill": {"seq_len": 64},
                                          "data": {"num_prompts": 3, "context_chars": 120},
                                          "decoding": {"max_new_tokens": 32}})
    longest = max(len(t) for t in load_prompts("stdlib_functions", 3, 120)) + 32
    assert longest > 65
    assert context_window(cfg, Chars()) == {"trained_window": 65,
                                            "eval_longest_context": longest}
    out = capsys.readouterr().out
    assert "distill.seq_len" in out and f"up to {longest}" in out
    cfg.distill.seq_len = longest - 1
    assert context_window(cfg, Chars())["trained_window"] == longest
    assert capsys.readouterr().out == ""


def test_tree_shards_record_the_trees_shape():
    """The TALF kinds' plan records ``talf_top_k`` / ``talf_depth`` (they change every
    row) and ``talf_data_roots`` where set, so shards made with other trees are refused
    instead of trained on."""
    from types import SimpleNamespace

    from speclab.train import distill_data as dd

    eagle = SimpleNamespace(data="corpus", talf_top_k=3, talf_depth=6, feature_layers=None)
    assert dd.data_kind("feat_tree").settings(eagle) == {"talf_top_k": 3, "talf_depth": 6}
    assert dd.data_kind("feat3_tree").settings(eagle) == {
        "feature_layers": "eagle3", "talf_top_k": 3, "talf_depth": 6}
    eagle.data, eagle.data_prompt = "target", 8
    assert dd.data_kind("feat_tree").settings(eagle) == {
        "talf_top_k": 3, "talf_depth": 6, "data": "target", "data_prompt": 8}
    eagle.talf_data_roots = 32  # trees drawn when the data is made: recorded where set
    assert dd.data_kind("feat3_tree").settings(eagle) == {
        "feature_layers": "eagle3", "talf_top_k": 3, "talf_depth": 6, "talf_data_roots": 32,
        "data": "target", "data_prompt": 8}
