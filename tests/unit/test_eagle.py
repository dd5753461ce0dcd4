"""The EAGLE feature drafter: its folder, the features the engine hands it, losslessness
(greedy identity, chi-square at T > 0) and its EAGLE / HASS training losses."""

import pytest
import torch

from speclab.api import Decoder
from speclab.decoding.loop import autoregressive_generate
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.models.eagle import EagleModel, load_eagle, save_eagle
from speclab.models.loading import load_model
from speclab.models.tiny import build_tiny_llama
from speclab.train.distill_data import feat_example
from speclab.train.eagle import _context_mask, collate_feat, eagle_loss, top1_agreement

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
    from speclab.drafters.eagle import EagleDrafter

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


def test_batched_rows_equal_rows_alone(tiny_pair, trained, tmp_path):
    """Feature drafters in the batched engine (one drafter per row, one target forward)."""
    folder = str(save_eagle(trained[0], tmp_path / "e"))
    dec = Decoder.from_pretrained(tiny_pair["target"])
    ps = [PROMPT, [7], [5, 6, 7, 8], [9, 9]]
    kw = {"method": "eagle", "eagle_model": folder, "builder": "salf", "nodes": 8, "batch": 2,
          "max_new_tokens": 30}
    alone = [dec.generate(prompt_ids=p, **kw) for p in ps]
    res = dec.generate(prompts=ps, batch_size=3, **kw)
    assert [r.token_ids for r in res] == [a.token_ids for a in alone]
    assert [r.stats.accepted_lengths for r in res] == [a.stats.accepted_lengths for a in alone]


def test_training_raises_agreement_and_hass_trains_too(tiny_pair, trained):
    model, history, batch = trained
    assert history[-1] < 0.5 * history[0]
    fresh = EagleModel.from_target(load_model(tiny_pair["target"]))
    assert top1_agreement(model, batch) > top1_agreement(fresh, batch) + 0.3
    _, hass, _ = _train(tiny_pair["target"], 30, loss="hass")
    assert hass[-1] < hass[0]


def test_engine_acceptance_during_training(tiny_pair, trained):
    from speclab.train.eagle import engine_acceptance

    target = load_model(tiny_pair["target"])
    got = engine_acceptance(target, trained[0], [PROMPT, [5, 6, 7]], 24, depth=4)
    assert got["engine_tau"] > 1.5 and got["engine_identical"] == 1.0
    assert got["engine_speedup"] > 0
    accept = [got[f"engine_accept_at_{k}"] for k in range(1, 5)]
    assert 1.0 >= accept[0] > 0 and accept == sorted(accept, reverse=True)
    fresh = engine_acceptance(target, EagleModel.from_target(target), [PROMPT], 24, depth=4)
    assert fresh["engine_tau"] < got["engine_tau"]


def test_context_alignment_mask():
    m = _context_mask(4, 2, torch.device("cpu"))  # [8, 8]: target half, own half
    assert m[:4, :4].tolist() == torch.tril(torch.ones(4, 4, dtype=torch.bool)).tolist()
    assert not m[:4, 4:].any()  # target rows never see own pairs
    # own row j at step 2: target pairs <= j - 1 and own pair j itself
    assert m[4 + 2].tolist() == [True, True, False, False, False, False, True, False]
    assert m[4 + 0].tolist() == [False] * 4 + [True, False, False, False]
    m3 = _context_mask(5, 3, torch.device("cpu"))
    assert m3[5 + 4].tolist() == [True, True, True, False, False,
                                  False, False, False, True, True]


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
