"""SpecDec++: acceptance head, weighted BCE, stop rule, training data, adaptive drafter."""

import math

import pytest
import torch

from speclab.api import Decoder
from speclab.decoding.acceptance_head import AcceptanceHead, load_head, save_head, should_stop
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.families.specdecpp.drafter import SpecDecPPDrafter
from speclab.families.specdecpp.training import DraftFeatures, head_metrics, mixed_batch
from speclab.losses import weighted_bce
from speclab.models.loading import load_model
from speclab.train.distill_data import accept_example
from tests.unit.test_engine_sampling import PROMPT, N, chi_square_p, exact_two_token_dist


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 4])
def test_head_shapes_and_depth(depth):
    head = AcceptanceHead(24, depth)
    assert head(torch.randn(3, 5, 24)).shape == (3, 5)
    assert head(torch.randn(24)).shape == ()
    assert len(head.blocks) == depth  # (D + 1) layers: D residual blocks + the output
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in head.modules())
    assert n_linear == depth + 1


def test_head_is_residual():
    head = AcceptanceHead(4, 1)
    with torch.no_grad():
        for p in head.blocks[0].parameters():
            p.zero_()  # silu(0) = 0: the block is the identity
        head.out.weight.copy_(torch.tensor([[1.0, 2.0, 0.0, 0.0]]))
        head.out.bias.zero_()
    with torch.no_grad():
        assert float(head(torch.tensor([1.0, 1.0, 5.0, 5.0]))) == pytest.approx(3.0)


def test_save_load_round_trip_and_hidden_mismatch(tmp_path):
    head = AcceptanceHead(16, 2)
    save_head(head, tmp_path, {"w_rej": 3.0})
    back = load_head(tmp_path, hidden_size=16)
    x = torch.randn(7, 16)
    torch.testing.assert_close(back(x), head(x))
    with pytest.raises(ValueError, match="hidden size 16 but the drafter's hidden size is 32"):
        load_head(tmp_path, hidden_size=32)
    with pytest.raises(ValueError, match="no acceptance head"):
        load_head(tmp_path / "missing")


def test_weighted_bce_hand_values():
    z = torch.tensor([[0.0, math.log(3.0)]])  # sigmoid: 0.5, 0.75
    p = torch.tensor([[1.0, 0.0]])
    mask = torch.tensor([[True, True]])
    # -(1 * log .5) and -(2 * log .25), averaged over 2 positions
    want = (math.log(2.0) + 2 * math.log(4.0)) / 2
    assert float(weighted_bce(z, p, mask, 1.0, 2.0)) == pytest.approx(want, rel=1e-5)
    # soft label 0.25 at the first position only (mask drops the second)
    mask = torch.tensor([[True, False]])
    soft = torch.tensor([[0.25, 0.0]])
    want = 0.25 * math.log(2.0) + 0.75 * 6.0 * math.log(2.0)
    assert float(weighted_bce(z, soft, mask, 1.0, 6.0)) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="w_acc / w_rej"):
        weighted_bce(z, p, mask, 1.0, -1.0)


def test_stop_rule_on_hand_made_predictions():
    assert not should_stop([], 0.1)
    assert not should_stop([0.95, 0.95], 0.1)  # 1 - .9025 = .0975
    assert should_stop([0.95, 0.95, 0.95], 0.1)  # 1 - .857 = .143
    assert should_stop([0.5], 0.3) and not should_stop([0.5], 0.6)


def test_head_metrics_hand_values():
    pred = torch.tensor([0.05, 0.15, 0.95, 0.85])
    label = torch.tensor([0.0, 0.0, 1.0, 1.0])
    m = head_metrics(pred, label, bins=10)
    assert m["accuracy"] == 1.0
    # bins 0,1,9,8 each hold one prediction: ECE = mean |pred - label| = 0.1
    assert m["ece"] == pytest.approx(0.1)


@pytest.fixture(scope="module")
def runners(tiny_pair):
    return ModelRunner(load_model(tiny_pair["target"])), ModelRunner(load_model(tiny_pair["close"]))


def test_accept_example_greedy_and_sampled(runners):
    target, draft = runners
    prompt = [3, 9, 27, 4]
    row = accept_example(target, draft, prompt, 10, 0.0, 0, None)
    assert len(row["x"]) == len(row["y"]) == len(row["p"]) == 10
    # greedy: P_i = 1 exactly when the draft's argmax equals the target's token
    draft.reset()
    q = draft.forward(torch.tensor(prompt + row["x"]))[len(prompt) - 1: -1]
    assert row["y"] == q.argmax(-1).tolist()
    assert row["p"] == [float(a == b) for a, b in zip(row["x"], row["y"])]
    assert 0 < sum(row["p"]) < 10  # the close draft agrees sometimes, not always
    row = accept_example(target, draft, prompt, 10, 1.0, 0, None)
    assert all(0.0 <= v <= 1.0 for v in row["p"])


def test_mixed_batch_marks_draft_positions(runners, tiny_pair):
    target, draft = runners
    rows = [accept_example(target, draft, p, n, 0.0, 0, None)
            for p, n in (([1, 2, 3], 6), ([5, 6], 4))]
    feats = DraftFeatures(load_model(tiny_pair["close"]))
    b = mixed_batch(rows, feats, 0.5, torch.Generator().manual_seed(0))
    assert b["hidden"].shape == (2, 6, feats.hidden_size)
    assert not b["mask"][1, 4:].any()  # padding of the shorter response gets no loss
    assert 0 < int(b["mask"].sum()) < 10
    none_from_x = mixed_batch(rows, feats, 0.0, torch.Generator().manual_seed(0))
    assert int(none_from_x["mask"].sum()) == 10
    # the hidden state at z_i is the drafter's LM-head input after reading prompt + z_<=i
    row = rows[0]
    feats.model(input_ids=torch.tensor([row["prompt"] + row["y"]]))
    torch.testing.assert_close(none_from_x["hidden"][0], feats._last[0, 3:].float())


def test_adaptive_drafter_is_lossless_under_greedy(tiny_pair):
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    torch.manual_seed(0)
    head = AcceptanceHead(int(dec.draft.model.config.hidden_size), 1)
    lengths = set()
    for prompt in ([3, 9, 27], [5, 1, 2, 8, 11, 30], [7]):
        want = dec.generate(prompt_ids=prompt, method="ar", max_new_tokens=30).token_ids
        for h in (0.1, 0.5, 0.9):
            res = dec.generate(prompt_ids=prompt, method="specdecpp", head=head, stop_threshold=h,
                               max_new_tokens=30)
            assert res.token_ids == want
            lengths.add(res.stats.drafted_tokens / max(res.stats.target_calls, 1))
    assert len(lengths) > 1  # the threshold really changes the draft lengths


def test_adaptive_drafter_stops_where_the_rule_says(tiny_pair):
    """A head with constant output sigmoid(b): with h, the round drafts exactly
    ``1 + min k with 1 - s^k > h`` tokens (the paper keeps the token drafted last)."""
    draft = ModelRunner(load_model(tiny_pair["close"]))
    head = AcceptanceHead(int(draft.model.config.hidden_size), 0)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(math.log(0.9 / 0.1))  # sigmoid = 0.9
    for h, want in ((0.05, 2), (0.15, 3), (0.3, 5), (0.99, 20)):
        d = SpecDecPPDrafter(draft, head, h, SamplingParams(0.0), max_len=20)
        d.reset()
        tree = d.propose([3, 9, 27], budget=64)
        assert len(tree) - 1 == want, h
    d = SpecDecPPDrafter(draft, head, 0.99, SamplingParams(0.0), max_len=7)
    d.reset()
    assert len(d.propose([3, 9, 27], budget=64)) - 1 == 7  # the hard cap


def test_bad_inputs(tiny_pair):
    draft = ModelRunner(load_model(tiny_pair["close"]))
    hidden = int(draft.model.config.hidden_size)
    for h in (0.0, 1.0, -0.2, 1.5):
        with pytest.raises(ValueError, match="threshold: must be in"):
            SpecDecPPDrafter(draft, AcceptanceHead(hidden), h, SamplingParams(0.0))
    with pytest.raises(ValueError, match="hidden size"):
        SpecDecPPDrafter(draft, AcceptanceHead(hidden + 8), 0.5, SamplingParams(0.0))
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    with pytest.raises(ValueError, match="head: method 'specdecpp' needs"):
        dec.generate(prompt_ids=[1, 2], method="specdecpp", max_new_tokens=4)
    from speclab.config import ConfigError, ExperimentConfig

    with pytest.raises(ConfigError, match="w_rej"):
        ExperimentConfig.from_dict({"job": "train_head", "head": {"w_rej": -1}})
    with pytest.raises(ConfigError, match="thresholds"):
        ExperimentConfig.from_dict({"job": "specdecpp_eval",
                                    "adaptive": {"thresholds": [0.5, 1.0]}})
    with pytest.raises(ConfigError, match="head"):
        ExperimentConfig.from_dict({"method": {"name": "specdecpp"}})


@pytest.mark.slow
def test_adaptive_drafter_sampling_matches_target_distribution(micro_pair):
    """As the engine issue's test (chi-square over 3000 seeded two-token samples, p >
    0.001) with the adaptive drafter: the head changes lengths, never the output law."""
    dec = Decoder.from_pretrained(micro_pair["target"], micro_pair["draft"])
    exact = exact_two_token_dist(dec, SamplingParams(1.0))
    torch.manual_seed(1)
    head = AcceptanceHead(int(dec.draft.model.config.hidden_size), 1)
    counts, accepted = {}, 0
    for seed in range(N):
        res = dec.generate(prompt_ids=PROMPT, method="specdecpp", head=head, stop_threshold=0.5,
                           max_new_tokens=2, temperature=1.0, seed=seed)
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
        accepted += res.stats.accepted_tokens
    assert accepted > N // 4
    assert chi_square_p(counts, exact, N) > 1e-3


def test_batched_greedy_accept_data_equals_one_prompt_at_a_time(runners):
    """accept_examples decodes greedy responses in batches (EOS stops a row); each row is
    what accept_example gives that prompt alone; sampled rows keep their per-prompt
    seeds."""
    from speclab.train.distill_data import accept_examples

    target, draft = runners
    prompts = [[3, 9, 27, 4], [5, 6, 7, 8], [11, 2, 40, 41], [1, 2, 3, 4]]
    alone = [accept_example(target, draft, p, 12, 0.0, 7 + j, None)
             for j, p in enumerate(prompts)]
    eos = alone[1]["x"][3]  # a token the second response emits: it stops there
    with_eos = [accept_example(target, draft, p, 12, 0.0, 7 + j, eos)
                for j, p in enumerate(prompts)]
    assert len(with_eos[1]["x"]) < 12 and with_eos[1]["x"][-1] == eos
    assert accept_examples(target, draft, prompts, 12, 0.0, 7, None, batch=3) == alone
    assert accept_examples(target, draft, prompts, 12, 0.0, 7, eos, batch=3) == with_eos
    sampled = [accept_example(target, draft, p, 6, 1.0, 7 + j, None)
               for j, p in enumerate(prompts[:2])]
    assert accept_examples(target, draft, prompts[:2], 6, 1.0, 7, None) == sampled


def test_draft_features_skip_the_lm_head_only_where_the_decoder_gives_its_input(tiny_pair):
    """The decoder's last_hidden_state is the LM head's input on the tiny LLaMA draft, so
    the features come without the head; a decoder that gives something else (here
    another model's) is detected by the probe and the full forward is used."""
    draft = load_model(tiny_pair["close"])
    feats = DraftFeatures(draft)
    assert feats.decoder is draft.get_decoder()
    inputs = torch.tensor([[3, 9, 27, 4, 5], [1, 2, 3, 0, 0]])
    fast = feats(inputs)
    draft(input_ids=inputs)
    torch.testing.assert_close(fast, feats._last.float(), rtol=0, atol=0)
    other = load_model(tiny_pair["target"])  # the draft is a noisy copy: same shapes
    mixed = load_model(tiny_pair["close"])
    mixed.get_decoder = lambda: other.get_decoder()
    slow = DraftFeatures(mixed)
    assert slow.decoder is None
    torch.testing.assert_close(slow(inputs), fast, rtol=0, atol=0)
    wrong = load_model(tiny_pair["close"])
    wrong.get_decoder = lambda: wrong  # no decoder apart from the model itself
    assert DraftFeatures(wrong).decoder is None
