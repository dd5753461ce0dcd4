"""The EAGLE feature drafter: its folder, the features the engine hands it, losslessness
(greedy identity, chi-square at T > 0) and its EAGLE / HASS training losses."""

import pytest
import torch
import torch.nn.functional as F

from speclab import losses
from speclab.api import Decoder
from speclab.decoding.loop import autoregressive_generate
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.families.eagle.model import EagleModel, load_eagle, save_eagle
from speclab.families.eagle.training import (
    collate_feat,
    eagle_loss,
    hass_step_mask,
    top1_agreement,
)
from speclab.models.loading import load_model
from speclab.models.tiny import build_tiny_llama
from speclab.train.distill_data import feat_example

PROMPT = [3, 9, 27, 17, 51, 2]


def _train(target_dir: str, steps: int, loss: str = "eagle", seed: int = 0,
           windows: int = 32, length: int = 17) -> tuple[EagleModel, list[float], dict]:
    """A drafter trained on the target's features over its own greedy continuations of
    random 3-token starts (self-distillation data, as Medusa and EAGLE recipes use)."""
    target = load_model(target_dir)
    runner = ModelRunner(target)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(windows):
        start = torch.randint(0, vocab, (3,), generator=g).tolist()
        out, _ = autoregressive_generate(runner, start, length - 3, SamplingParams(0.0))
        rows.append(feat_example(runner, start + out, min(4, vocab)))
    batch = collate_feat(rows)
    torch.manual_seed(seed)
    model = EagleModel.from_target(target)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    history = []
    for _ in range(steps):
        out = eagle_loss(model, batch, loss, hass_k=2, hass_steps=2)
        opt.zero_grad()
        out.backward()
        opt.step()
        history.append(out.item())
    return model.eval(), history, batch


@pytest.fixture(scope="module")
def trained(tiny_pair):
    return _train(tiny_pair["target"], 120)


def test_folder_round_trip_and_wrong_target(tiny_pair, tmp_path):
    target = load_model(tiny_pair["target"])
    model = EagleModel.from_target(target)
    assert not model.embed.weight.requires_grad and not model.lm_head.weight.requires_grad
    torch.testing.assert_close(model.lm_head.weight, target.get_output_embeddings().weight)
    folder = save_eagle(model, tmp_path / "e")
    again = load_eagle(folder, target.config)
    f, x = torch.randn(1, 4, target.config.hidden_size), torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(again(f, x)[1], model(f, x)[1])
    other = build_tiny_llama(tmp_path / "other", seed=4, vocab_size=64, hidden_size=48)
    with pytest.raises(ValueError, match="eagle_model: trained for a target with hidden_size=32"):
        load_eagle(folder, load_model(str(other)).config)
    with pytest.raises(ValueError, match="eagle_model: .* holds no EAGLE drafter"):
        load_eagle(tiny_pair["target"])
    dec = Decoder.from_pretrained(str(other))
    with pytest.raises(ValueError, match="eagle_model: trained for a target"):
        dec.generate(prompt_ids=PROMPT, method="eagle", eagle_model=str(folder))
    with pytest.raises(ValueError, match="eagle_model"):
        dec.generate(prompt_ids=PROMPT, method="eagle")


def test_the_drafter_sees_the_targets_features_of_every_committed_position(tiny_pair,
                                                                           trained):
    from speclab.families.eagle.drafter import EagleDrafter

    seen = []

    class Recording(EagleDrafter):
        def observe(self, features):
            seen.append(features.clone())
            super().observe(features)

    dec = Decoder.from_pretrained(tiny_pair["target"])
    drafter = Recording(trained[0], top_k=3, depth=3, nodes=8)
    from speclab.decoding.drafting import DraftTraits
    from speclab.decoding.loop import generate_tokens
    from speclab.decoding.rules import resolve_rule

    params = SamplingParams(0.0)
    out, stats = generate_tokens(dec.target, drafter, PROMPT, 20, params,
                                 resolve_rule(None, None, params),
                    traits=DraftTraits(needs_features=True))
    assert stats.accepted_tokens > 0
    committed = PROMPT + out
    ref = ModelRunner(load_model(tiny_pair["target"]))
    ref.track_hidden()
    ref.reset()
    ref.forward(torch.tensor(committed[:-1]))
    got = torch.cat(seen)  # prefill, then each round's accepted path (the last round's
    assert len(PROMPT) + 10 <= got.shape[0] < len(committed) - 1  # never drafts again)
    torch.testing.assert_close(got, ref.hidden[: got.shape[0]], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("builder", ["eagle2", "optimal", "salf"])
def test_greedy_output_is_the_targets(tiny_pair, trained, tmp_path, builder):
    folder = save_eagle(trained[0], tmp_path / "e")
    dec = Decoder.from_pretrained(tiny_pair["target"])
    for prompt in (PROMPT, [7]):
        ar = dec.generate(prompt_ids=prompt, method="ar", max_new_tokens=40)
        res = dec.generate(prompt_ids=prompt, method="eagle", eagle_model=str(folder),
                           builder=builder, tree_top_k=3, depth=4, nodes=10, batch=2,
                           max_new_tokens=40)
        assert res.token_ids == ar.token_ids
        assert res.stats.draft_calls > 0
    assert res.stats.tau > 1.5  # a trained drafter is really accepted


@pytest.mark.parametrize("builder", ["eagle2", "salf"])
def test_batched_rows_equal_rows_alone(tiny_pair, trained, tmp_path, builder):
    """Feature drafters in the batched engine (every row's drafter step in one forward,
    one target forward): each row's tokens and accepted lengths (so its trees) are the
    ones it gets alone."""
    folder = str(save_eagle(trained[0], tmp_path / "e"))
    dec = Decoder.from_pretrained(tiny_pair["target"])
    ps = [PROMPT, [7], [5, 6, 7, 8], [9, 9]]
    kw = {"method": "eagle", "eagle_model": folder, "builder": builder, "nodes": 8,
          "batch": 2, "tree_top_k": 3, "depth": 4, "max_new_tokens": 30}
    alone = [dec.generate(prompt_ids=p, **kw) for p in ps]
    res = dec.generate(prompts=ps, batch_size=3, **kw)
    assert [r.token_ids for r in res] == [a.token_ids for a in alone]
    assert [r.stats.accepted_lengths for r in res] == [a.stats.accepted_lengths for a in alone]


def test_batched_rows_feed_their_prompts_at_join_grouped_by_length(tiny_pair, trained,
                                                                   tmp_path, monkeypatch):
    """Rows of very different prompt lengths: the batched EAGLE drafter feeds each
    prompt's pairs when the row first drafts (BatchRunner.add_rows: rows of similar
    lengths in one forward), so its first sync feeds one pair per row, not the longest
    prompt padded into every row; outputs stay plain decoding's."""
    from speclab.families.eagle.drafter_batch import FeatureBatchRunner

    folder = str(save_eagle(trained[0], tmp_path / "e"))
    dec = Decoder.from_pretrained(tiny_pair["target"])
    ps = [PROMPT * 12, [7], [5, 6, 7, 8], PROMPT * 3]
    widths = []
    real = FeatureBatchRunner.forward
    monkeypatch.setattr(FeatureBatchRunner, "forward", lambda self, tokens, *a, **k: (
        widths.append([int(t.shape[0]) for t in tokens]) or real(self, tokens, *a, **k)))
    kw = {"method": "eagle", "eagle_model": folder, "tree_top_k": 3, "depth": 4,
          "nodes": 8, "max_new_tokens": 12}
    res = dec.generate(prompts=ps, **kw)
    ar = dec.generate(prompts=ps, method="ar", max_new_tokens=12)
    assert [r.token_ids for r in res] == [a.token_ids for a in ar]
    # the join: two groups (the 72-token prompt alone; the rest, 18 tokens at most),
    # each row's pairs but its last; then the first sync feeds one pair per row
    assert sorted(widths[0] + widths[1]) == sorted(len(p) - 2 if len(p) > 1 else 0
                                                    for p in ps)
    assert sorted(map(len, widths[:2])) == [1, 3]
    assert widths[2] == [1, 0, 1, 1]  # the 1-token prompt has no feature: the target first


@pytest.mark.parametrize("method", ["chain", "eagle"])
def test_a_rows_draft_prefill_waits_for_its_first_draft(tiny_pair, trained, tmp_path,
                                                        monkeypatch, method):
    """A batch decoded plainly (an auto budget of 0 every step) runs no draft forward at
    all; one that drafts after plain steps prefills what the rows committed by then and
    decodes what plain decoding does; rows that join later (a batch of 2 over 4 prompts)
    wait at the end of the batch while the others draft, and leave from anywhere."""
    from speclab.decoding.budget import RowBudget

    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))
    folder = str(save_eagle(trained[0], tmp_path / "e"))
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    kw = ({"gamma": 3} if method == "chain" else
          {"eagle_model": folder, "tree_top_k": 3, "depth": 3, "nodes": 6})
    ps = [PROMPT * 4, [7], [5, 6, 7, 8], PROMPT]
    ar = [r.token_ids for r in dec.generate(prompts=ps, method="ar", max_new_tokens=14)]
    plan: list[int] = []

    def choose(self, limit=None):
        b = min(plan[min(len(self.chosen), len(plan) - 1)],
                limit if limit is not None else self.max_depth)
        self.chosen.append(b)
        return b

    monkeypatch.setattr(RowBudget, "choose", choose)
    plan[:] = [0]
    res = dec.generate(prompts=ps, method=method, budget="auto", max_new_tokens=14, **kw)
    assert [r.token_ids for r in res] == ar and dec.last_batch.draft_forwards == 0
    for size in (4, 2):
        plan[:] = [0, 0, 0, 3, 0, 2, 3, 1, 0, 3]
        res = dec.generate(prompts=ps, method=method, budget="auto", max_new_tokens=14,
                           batch_size=size, **kw)
        assert [r.token_ids for r in res] == ar
        assert dec.last_batch.draft_forwards > 0


def test_training_raises_agreement_and_hass_trains_too(tiny_pair, trained):
    model, history, batch = trained
    assert history[-1] < 0.5 * history[0]
    fresh = EagleModel.from_target(load_model(tiny_pair["target"]))
    assert top1_agreement(model, batch) > top1_agreement(fresh, batch) + 0.3
    _, hass, _ = _train(tiny_pair["target"], 30, loss="hass")
    assert hass[-1] < hass[0]


def test_engine_acceptance_during_training(tiny_pair, trained):
    from speclab.families.eagle.training import engine_acceptance

    target = load_model(tiny_pair["target"])
    got = engine_acceptance(target, trained[0], [PROMPT, [5, 6, 7]], 24, depth=4)
    assert got["engine_tau"] > 1.5 and got["engine_identical"] == 1.0
    assert got["engine_speedup"] > 0
    accept = [got[f"engine_accept_at_{k}"] for k in range(1, 5)]
    assert 1.0 >= accept[0] > 0 and accept == sorted(accept, reverse=True)
    fresh = engine_acceptance(target, EagleModel.from_target(target), [PROMPT], 24, depth=4)
    assert fresh["engine_tau"] < got["engine_tau"]


def test_context_alignment_mask():
    """Step s's pair j: target pairs <= j - s + 1, then pair j - d of step s - d's set."""
    m = hass_step_mask(4, 2, torch.device("cpu"))  # [4, 8]: target set, step-2 set
    assert m[2].tolist() == [True, True, False, False, False, False, True, False]
    assert m[0].tolist() == [False] * 4 + [True, False, False, False]
    m3 = hass_step_mask(5, 3, torch.device("cpu"))  # target, step-2 and step-3 sets
    assert m3[4].tolist() == [True, True, True, False, False,
                              False, False, False, True, False,  # step 2's pair 3
                              False, False, False, False, True]  # step 3's pair 4
    assert m3.sum(1).tolist() == [1, 2, 3, 4, 5]


def _feat_batch(hidden: int, vocab: int, rows: int = 2, length: int = 9, seed: int = 1
                ) -> dict[str, torch.Tensor]:
    """A :func:`collate_feat`-shaped batch of random features (scale 2) and top-4s."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, length, 4, generator=g).sort(-1, descending=True).values * 0.25
    return {"tokens": torch.randint(0, vocab, (rows, length + 1), generator=g),
            "features": 2 * torch.randn(rows, length, hidden, generator=g),
            "topk_ids": torch.randint(0, vocab, (rows, length, 4), generator=g),
            "topk_probs": probs}


class _Recording(torch.nn.Module):
    """The drafter, keeping each call's outputs and whether its features carry a graph."""

    def __init__(self, model: EagleModel) -> None:
        super().__init__()
        self.model, self.calls = model, []

    def forward(self, features, input_ids, **kwargs):
        f_hat, logits = self.model(features, input_ids, **kwargs)
        self.calls.append((f_hat, logits, features.requires_grad))
        return f_hat, logits


def _decoded(model: EagleModel, batch: dict, b: int, j: int, step: int):
    """Step ``step``'s ``(f_hat [H], logits [V])`` at pair ``j`` by real decoding with a KV
    cache: pairs ``0..j-step+1`` with the target's features, then ``step - 1`` pairs each
    fed the drafter's previous output and the window's next token."""
    from transformers import DynamicCache

    feats, tokens = batch["features"][b], batch["tokens"][b]
    c = j - step + 1
    cache = DynamicCache()
    f_hat, logits = model(feats[None, : c + 1], tokens[None, 1: c + 2],
                          position_ids=torch.arange(c + 1)[None], past_key_values=cache,
                          use_cache=True)
    f_hat, logits = f_hat[:, -1:], logits[:, -1:]
    for p in range(c + 1, j + 1):
        f_hat, logits = model(f_hat, tokens[None, p + 1: p + 2], position_ids=torch.tensor(
            [[p]]), past_key_values=cache, use_cache=True)
    return f_hat[0, -1], logits[0, -1]


@pytest.mark.parametrize("layers", [1, 2])
def test_hass_steps_are_step_by_step_decoding(tiny_pair, layers):
    """Issue 35, item 1: at every step (3 and 4 included, and at every layer) the HASS
    training forward's features are those of decoding the drafter pair by pair on the
    same tokens."""
    target = load_model(tiny_pair["target"])
    torch.manual_seed(0)
    model = EagleModel.from_target(target, layers).float().eval()
    batch = _feat_batch(target.config.hidden_size, target.config.vocab_size)
    rec = _Recording(model)
    with torch.no_grad():
        eagle_loss(rec, batch, "hass", hass_k=2, hass_steps=4)
        t = batch["features"].shape[1] - 1
        assert len(rec.calls) == 4
        for step, (f_hat, logits, _) in enumerate(rec.calls, start=1):
            f_hat, logits = f_hat[:, -t:], logits[:, -t:]  # the step's own pairs
            for b in range(2):
                for j in sorted({step - 1, (step + t) // 2, t - 1}):
                    want_f, want_l = _decoded(model, batch, b, j, step)
                    torch.testing.assert_close(f_hat[b, j], want_f, atol=1e-5, rtol=1e-5,
                                               msg=f"step {step}, pair {j}")
                    torch.testing.assert_close(logits[b, j], want_l, atol=1e-5, rtol=1e-5)


def _hass_terms(f_hat, logits, batch, first: int, hass_k: int = 2) -> torch.Tensor:
    """HASS's step loss ``1.0 reg + 0.1 CE + 1.0 top-K`` over pairs ``j >= first``
    (``f_hat [B, T', H]``, ``logits [B, T', V]`` at those pairs)."""
    tgt = batch["features"][:, 1 + first:]
    ids, probs = batch["topk_ids"][:, 1 + first:], batch["topk_probs"][:, 1 + first:]
    mask = torch.ones(ids.shape[:2])
    reg = F.smooth_l1_loss(f_hat, tgt, reduction="none").mean()
    return (reg + 0.1 * losses.soft_ce(logits, ids, probs, mask)
            + losses.hass_topk(logits, ids, probs, mask, top_k=hass_k))


def test_hass_objective_is_reg_ce_and_top_k(tiny_pair):
    """Issue 35, item 2: a HASS step trains 1.0 reg + 0.1 CE + 1.0 top-K (HASS's
    ``main_hass.py`` / ``train.sh``), not the top-K term in place of the CE."""
    target = load_model(tiny_pair["target"])
    torch.manual_seed(0)
    model = EagleModel.from_target(target).float()
    batch = _feat_batch(target.config.hidden_size, target.config.vocab_size)
    t = batch["features"].shape[1] - 1
    with torch.no_grad():
        f_hat, logits = model(batch["features"][:, :-1], batch["tokens"][:, 1: t + 1])
        want = _hass_terms(f_hat, logits, batch, 0)
        torch.testing.assert_close(eagle_loss(model, batch, "hass", hass_k=2, hass_steps=1),
                                   want, atol=1e-5, rtol=1e-5)
        no_topk = eagle_loss(model, batch, "hass", hass_k=2, hass_steps=1, w_topk=0.0)
        torch.testing.assert_close(no_topk, eagle_loss(model, batch, "eagle"))


def test_hass_sums_the_steps_and_detaches_fed_back_features(tiny_pair):
    """Issue 35, item 4: the fed-back features carry no graph and the steps' losses are
    summed, as in HASS (``hass_detach: False`` and ``hass_reduce: mean`` are the named
    variants)."""
    target = load_model(tiny_pair["target"])
    torch.manual_seed(0)
    model = EagleModel.from_target(target).float()
    batch = _feat_batch(target.config.hidden_size, target.config.vocab_size)
    t = batch["features"].shape[1] - 1
    rec = _Recording(model)
    total = eagle_loss(rec, batch, "hass", hass_k=2, hass_steps=2)
    assert [c[2] for c in rec.calls] == [False, False]  # step 2 reads detached features
    total.backward()
    assert all(p.grad is not None for p in model.fc.parameters())
    with torch.no_grad():
        step1 = eagle_loss(model, batch, "hass", hass_k=2, hass_steps=1)
        dec = [[_decoded(model, batch, b, j, 2) for j in range(1, t)] for b in range(2)]
        f2 = torch.stack([torch.stack([f for f, _ in row]) for row in dec])
        l2 = torch.stack([torch.stack([lg for _, lg in row]) for row in dec])
        step2 = _hass_terms(f2, l2, batch, 1)
    torch.testing.assert_close(total.detach(), step1 + step2, atol=1e-5, rtol=1e-5)
    rec.calls.clear()
    kept = eagle_loss(rec, batch, "hass", hass_k=2, hass_steps=2, hass_detach=False,
                      hass_reduce="mean")
    assert [c[2] for c in rec.calls] == [False, True]
    torch.testing.assert_close(kept.detach(), (step1 + step2) / 2, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="hass_reduce"):
        eagle_loss(model, batch, "hass", hass_reduce="max")


def test_training_batches_carry_eagles_feature_noise(tiny_pair, tmp_path):
    """Issue 35, item 5: EAGLE's and HASS's ``AddUniformNoise(std=0.2)``, ``(U - 0.5) * 0.2
    * 512 / L``, on the features the drafter reads in training (the regression targets
    and the validation batches stay clean)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from speclab.config.schema import EagleTrainConfig, TrainConfig
    from speclab.families.eagle.task import EagleTask, EagleTaskConfig

    assert (EagleTrainConfig().feature_noise, EagleTrainConfig().feature_noise_len) == (0.2,
                                                                                       512)
    for bad in ({"feature_noise": -0.1}, {"feature_noise_len": 0}, {"w_topk": -1.0},
                {"hass_reduce": "max"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EagleTrainConfig(**bad)
    target = load_model(tiny_pair["target"])
    runner = ModelRunner(target)
    folder = tmp_path / "data" / "feat"
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        rows = [feat_example(runner, torch.randint(0, 64, (17,), generator=g).tolist(), 4)
                for _ in range(2)]
        pq.write_table(pa.Table.from_pylist(rows), folder / f"shard-{i:05d}.parquet")
    cfg = EagleTaskConfig(train=TrainConfig(batch_size=2),
                          eagle=EagleTrainConfig(loss="hass", hass_k=2),
                          target=tiny_pair["target"])
    task = EagleTask(cfg, tmp_path / "data", torch.device("cpu"))
    batch = task.batch(3, 0)
    noise, feats = batch["feature_noise"], batch["features"]
    assert noise.shape == feats.shape and feats.shape[1] == 16
    bound = 0.2 * 512 / 16 / 2
    assert noise.abs().max() <= bound and noise.abs().max() > 0.9 * bound
    assert abs(float(noise.mean())) < 0.05 * bound
    torch.testing.assert_close(task.batch(3, 0)["feature_noise"], noise)  # deterministic
    assert "feature_noise" not in task._val_batch()
    model = task.build_model()
    with torch.no_grad():
        f_hat, logits = model((feats + noise)[:, :-1], batch["tokens"][:, 1:16])
        assert float((f_hat - model(feats[:, :-1], batch["tokens"][:, 1:16])[0]).abs().max()
                     ) > 1e-3
        reg = F.smooth_l1_loss(f_hat, feats[:, 1:])  # clean targets
        ce = losses.soft_ce(logits, batch["topk_ids"][:, 1:], batch["topk_probs"][:, 1:],
                            torch.ones(2, 15))
        want = reg + 0.1 * ce
        got = eagle_loss(model, batch, "eagle")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    off = cfg.model_copy(update={"eagle": cfg.eagle.model_copy(update={"feature_noise": 0})})
    assert "feature_noise" not in EagleTask(off, tmp_path / "data", torch.device("cpu")).batch(
        3, 0)


@pytest.mark.slow
def test_sampling_with_eagle_matches_the_target(micro_pair, tmp_path):
    from tests.unit.test_engine_sampling import N, chi_square_p, exact_two_token_dist

    model, _, _ = _train(micro_pair["target"], 60, windows=32)
    folder = save_eagle(model, tmp_path / "e")
    dec = Decoder.from_pretrained(micro_pair["target"])
    exact = exact_two_token_dist(dec, SamplingParams(1.0))
    counts, accepted = {}, 0
    from tests.unit.test_engine_sampling import PROMPT as SPROMPT

    for seed in range(N):
        res = dec.generate(prompt_ids=SPROMPT, method="eagle", eagle_model=str(folder),
                           tree_top_k=3, depth=2, nodes=6, max_new_tokens=2,
                           temperature=1.0, seed=seed)
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
        accepted += res.stats.accepted_tokens
    assert accepted > N // 4
    assert chi_square_p(counts, exact, N) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_features_travel_packed_and_exact(dtype):
    from speclab.decoding.sides import VerifyResult
    from speclab.decoding.wire import pack_tensor, unpack_tensor

    x = torch.randn(3, 5).to(dtype)
    packed = pack_tensor(x)
    assert isinstance(packed["data"], bytes) and packed["shape"] == [3, 5]
    assert torch.equal(unpack_tensor(packed), x) and unpack_tensor(packed).dtype == dtype
    assert unpack_tensor(pack_tensor(torch.zeros(0, 8))).shape == (0, 8)
    v = VerifyResult([0, 2], [5, 6], 1, 1, 3, x)
    assert torch.equal(VerifyResult.from_dict(v.to_dict()).features, x)
    assert VerifyResult.from_dict(VerifyResult([0], [5], 0, 0, 0).to_dict()).features is None


def test_serve_refuses_a_drafter_of_another_target_at_load(tiny_pair, tmp_path):
    """Issue 35, item 9: a Serve draft replica checks its EAGLE drafter against the target
    when it loads (the check offline decoding makes) and refuses it, naming the field."""
    from serve_apps.draft import DraftDeployment

    target = load_model(tiny_pair["target"])
    good = save_eagle(EagleModel.from_target(target), tmp_path / "good")
    other = build_tiny_llama(tmp_path / "other", seed=4, vocab_size=64, hidden_size=48)
    bad = save_eagle(EagleModel.from_target(load_model(str(other))), tmp_path / "bad")
    wide = build_tiny_llama(tmp_path / "wide", seed=4, vocab_size=100)
    big = save_eagle(EagleModel.from_target(load_model(str(wide))), tmp_path / "big")

    def deploy(folder, **kwargs):
        return DraftDeployment(None, None, {"name": "eagle", "eagle_model": str(folder)},
                               64, **kwargs)

    assert deploy(good, target_source=tiny_pair["target"]).features
    with pytest.raises(ValueError, match="eagle_model: trained for a target with "
                                         "hidden_size=48, but the target has 32"):
        deploy(bad, target_source=tiny_pair["target"])
    with pytest.raises(ValueError, match="eagle_model: trained for a target with "
                                         "vocab_size=100, but the target has 64"):
        deploy(big)  # without the target's folder: its vocabulary alone


@pytest.mark.parametrize("batched", [False, True])
def test_drafting_ahead_on_its_own_features_resyncs_on_the_targets(tiny_pair, trained,
                                                                   batched):
    """The draft pool drafts each round ahead (as the Serve draft replica does while the
    target verifies): the EAGLE drafter stands its own outputs in for the guessed path's
    target features. Every tree it drafts for real afterwards is exactly the tree of a
    fresh drafter given the target's features of every committed position (the
    stand-ins were dropped), hits and misses both happen, and the tokens are the
    target's. ``batched``: the batched drafter (what Serve's draft replica builds) in
    place of one drafter per row."""
    from types import SimpleNamespace

    from speclab.decoding.batch_runner import BatchRunner
    from speclab.decoding.drafting import PerRowDrafters
    from speclab.decoding.row_pool import DraftPool, NewRow, TargetPool, seeded
    from speclab.decoding.rules import RuleSpec
    from speclab.drafters.registry import eager_batch_runner
    from speclab.families.eagle.drafter import EagleConfig, EagleDrafter

    model = trained[0]
    target = load_model(tiny_pair["target"])
    knobs = {"top_k": 3, "depth": 4, "nodes": 8}
    want = Decoder.from_pretrained(tiny_pair["target"]).generate(
        prompt_ids=PROMPT, method="ar", max_new_tokens=40).token_ids
    tpool = TargetPool(BatchRunner(target), features=True)
    cfg = EagleConfig(eagle_model=model, tree_top_k=3, depth=4, nodes=8)
    ctx = SimpleNamespace(target_config=target.config, batch_runner=eager_batch_runner)
    make = ((lambda s: cfg.build_batch(ctx))
            if batched else (lambda s: PerRowDrafters(lambda g: EagleDrafter(model, **knobs))))
    dpool = DraftPool(make, ahead_min_hit_rate=0.0)
    greedy = SamplingParams()
    start = tpool.start([NewRow("r", PROMPT, greedy, RuleSpec("greedy"), seeded(0))])[0]
    dpool.join([NewRow("r", PROMPT, greedy, None, seeded(0), None, start.features)])
    ref = ModelRunner(target)
    ref.track_hidden()
    out, path, new, feats, flags = [], None, [], None, []
    while len(out) < 40:
        budget = 40 - len(out) - 1
        p = dpool.propose([("r", path, new, budget, feats)])[0]
        flags.append(p.ahead)
        if not p.ahead and p.tree is not None:  # drafted for real: as a fresh drafter
            # given the target's features
            committed = PROMPT + out
            ref.reset()
            ref.forward(torch.tensor(committed[:-1]))
            fresh = EagleDrafter(model, **knobs)
            fresh.start(committed)
            fresh.observe(ref.hidden)
            alone = fresh.propose(committed, budget)
            assert p.tree.tokens == alone.tokens, len(out)
            assert p.tree.parents == alone.parents, len(out)
        dpool.draft_ahead(["r"])
        v = tpool.verify([("r", p.tree)])[0]
        path, new, feats = v.path, v.new, v.features
        out += v.new
    assert out[:40] == want
    assert flags.count(True) > 0 and flags.count(False) > 0, flags


def test_an_auto_budget_with_plain_rounds_between_keeps_the_targets_output(
        tiny_pair, trained, tmp_path, monkeypatch):
    """The auto budget's plain rounds hand the drafter every token and target feature
    committed since its last tree: alone and batched, greedy output stays the target's."""
    import itertools

    from speclab.decoding.budget import RowBudget

    def choose(self, limit=None):
        cycle = self.__dict__.setdefault("_cycle", itertools.cycle([0, 4, 0, 0, 2, 1]))
        b = min(next(cycle), limit if limit is not None else 4)
        self.chosen.append(b)
        return b
    monkeypatch.setattr(RowBudget, "choose", choose)
    monkeypatch.setenv("SPECLAB_HOME", str(tmp_path / "home"))
    folder = str(save_eagle(trained[0], tmp_path / "e"))
    dec = Decoder.from_pretrained(tiny_pair["target"])
    ps = [PROMPT, [5, 6, 7, 8]]
    kw = {"method": "eagle", "eagle_model": folder, "tree_top_k": 3, "depth": 4, "nodes": 8,
          "max_new_tokens": 30, "budget": "auto"}
    ar = [dec.generate(prompt_ids=p, method="ar", max_new_tokens=30).token_ids for p in ps]
    for p, ref in zip(ps, ar, strict=True):
        res = dec.generate(prompt_ids=p, **kw)
        assert res.token_ids == ref and 0 in res.stats.round_reach[:-1]
        assert res.stats.accepted_tokens > 0
    assert [r.token_ids for r in dec.generate(prompts=ps, **kw)] == ar


def test_hass_k_is_checked_against_the_top_k_the_step_reads():
    """Offline features store ``distill.top_k`` probabilities; online ones compute
    ``eagle.online_top_k`` in the step: ``hass_k`` is checked against the one in use."""
    from types import SimpleNamespace

    from speclab.families.eagle.checks import hass_within_top_k

    job = SimpleNamespace(distill=SimpleNamespace(top_k=8))
    online = SimpleNamespace(hass_k=10, features="online", online_top_k=10)
    hass_within_top_k(online, job)  # 10 computed in the step: distill.top_k plays no part
    with pytest.raises(ValueError, match=r"eagle.hass_k \(10\) must not exceed "
                                         r"eagle.online_top_k \(4\), computed in the step"):
        hass_within_top_k(SimpleNamespace(hass_k=10, features="online", online_top_k=4), job)
    with pytest.raises(ValueError, match=r"eagle.hass_k \(10\) must not exceed "
                                         r"distill.top_k \(8\), the stored top-k"):
        hass_within_top_k(SimpleNamespace(hass_k=10, features="offline", online_top_k=10), job)
