"""Medusa heads: tree templates, the heads' folder and target checks, what the heads read
each round, losslessness (greedy identity for every tree shape, chi-square at T > 0),
typical acceptance, and the MEDUSA-1 / MEDUSA-2 losses."""

import json
import math

import pytest
import torch

from speclab.api import Decoder
from speclab.decoding.loop import autoregressive_generate
from speclab.decoding.runner import ModelRunner
from speclab.decoding.sampling import SamplingParams
from speclab.families.eagle.training import collate_feat
from speclab.families.medusa.drafter import MedusaDrafter, medusa_template
from speclab.families.medusa.model import MedusaHeads, head_accuracies, load_medusa, save_medusa
from speclab.families.medusa.training import (
    Medusa2Model,
    head_losses,
    lm_quality,
    medusa1_loss,
    medusa2_loss,
    repeated_ngram_share,
)
from speclab.families.medusa.trees import (
    cartesian_template,
    chain_template,
    expected_length,
    replayed_length,
    sparse_template,
)
from speclab.models.loading import load_model
from speclab.train.distill_data import feat_example, medusa_examples

PROMPT = [3, 9, 27, 17, 51, 2]
ACC = [[0.6, 0.2, 0.1], [0.4, 0.3, 0.05], [0.3, 0.1, 0.0]]


def _data(target_dir: str, n: int = 32, seed: int = 0) -> dict:
    """Self-distillation rows: random 3-token prompts continued greedily by the target."""
    runner = ModelRunner(load_model(target_dir))
    g = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    prompts = [torch.randint(0, vocab, (3,), generator=g).tolist() for _ in range(n)]
    return collate_feat(medusa_examples(runner, prompts, 14, 4, batch=8))


def _train(target_dir: str, steps: int, heads: int = 3) -> tuple[MedusaHeads, list[float]]:
    """MEDUSA-1 heads trained on the target's own continuations."""
    target = load_model(target_dir)
    batch = _data(target_dir)
    torch.manual_seed(0)
    model = MedusaHeads.from_target(target, target_dir, heads)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    history = []
    for _ in range(steps):
        loss = medusa1_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
    model.eval()
    acc = head_accuracies(model, batch["features"], batch["tokens"], 4)
    model.tree = {"accuracies": acc}
    return model, history


@pytest.fixture(scope="module")
def trained(tiny_pair):
    return _train(tiny_pair["target"], 80)


def test_self_distillation_rows_are_the_targets_greedy_continuations(tiny_pair):
    """Batched generation equals one-at-a-time greedy decoding with the engine, and each
    row's features / top-k are the target's on that sequence."""
    runner = ModelRunner(load_model(tiny_pair["target"]))
    prompts = [[1, 2, 3], [7, 7, 7], [40, 3, 9], [5, 6, 60]]
    rows = medusa_examples(runner, prompts, 10, 4, batch=3)  # a full and a partial batch
    for prompt, row in zip(prompts, rows):
        out, _ = autoregressive_generate(runner, prompt, 10, SamplingParams(0.0))
        assert row["tokens"] == prompt + out
        one = feat_example(runner, row["tokens"], 4)
        assert row["topk_ids"] == one["topk_ids"]
        torch.testing.assert_close(collate_feat([row])["features"],
                                   collate_feat([one])["features"], atol=2e-3, rtol=0)


def test_templates():
    assert chain_template(3) == [(0,), (0, 0), (0, 0, 0)]
    cart = cartesian_template(2, 3)
    assert len(cart) == 2 + 4 + 8 and len(set(cart)) == len(cart)
    sparse = sparse_template(ACC, 5)
    # the five best products: .6, .24 (.6*.4), .2, .18 (.6*.3), .1
    assert sparse == [(0,), (1,), (2,), (0, 0), (0, 1)]
    for nodes in range(1, 20):
        tpl = sparse_template(ACC, nodes)
        assert len(tpl) == min(nodes, 3 + 9 + 27)
        assert all(p[:-1] in tpl for p in tpl if len(p) > 1)  # parents kept
        order = {p: i for i, p in enumerate(tpl)}
        assert all(order[p[:-1]] < order[p] for p in tpl if len(p) > 1)
    assert sparse_template(ACC, 10, depth=1) == [(0,), (1,), (2,)]
    assert expected_length([(0,), (0, 0)], ACC) == pytest.approx(1 + 0.6 + 0.24)
    # the sparse tree's estimate is the best of any template of its size
    assert expected_length(sparse_template(ACC, 14), ACC) >= expected_length(cart, ACC)
    with pytest.raises(ValueError, match="accuracies"):
        sparse_template([], 4)


def test_fresh_heads_repeat_the_lm_head_and_folder_round_trip(tiny_pair, tmp_path):
    from speclab.models.tiny import build_tiny_llama

    target = load_model(tiny_pair["target"])
    heads = MedusaHeads.from_target(target, tiny_pair["target"], 3)
    h = torch.randn(2, 5, target.config.hidden_size)
    want = target.get_output_embeddings()(h)
    got = heads(h)
    assert got.shape == (3, 2, 5, target.config.vocab_size)
    for k in range(3):
        torch.testing.assert_close(got[k], want)
    folder = save_medusa(heads, tmp_path / "m", {"accuracies": ACC})
    again = load_medusa(folder, target)
    torch.testing.assert_close(again(h), got)
    assert again.tree == {"accuracies": ACC} and again.meta == heads.meta
    other = build_tiny_llama(tmp_path / "other", seed=4, vocab_size=64, hidden_size=48)
    with pytest.raises(ValueError, match="medusa_model: heads trained for a target with "
                                         "hidden_size=32"):
        load_medusa(folder, load_model(str(other)))
    # same shape, other weights (e.g. MEDUSA-2 heads with the original target)
    with pytest.raises(ValueError, match="medusa_model: heads trained for target .*other "
                                         "weights"):
        Decoder.from_pretrained(tiny_pair["close"]).generate(
            prompt_ids=PROMPT, method="medusa", medusa_model=str(folder))
    with pytest.raises(ValueError, match="medusa_model: .* holds no Medusa heads"):
        load_medusa(tiny_pair["target"])
    bare = save_medusa(heads, tmp_path / "bare")
    with pytest.raises(ValueError, match="medusa_model: these heads have no calibration"):
        Decoder.from_pretrained(tiny_pair["target"]).generate(
            prompt_ids=PROMPT, method="medusa", medusa_model=str(bare), tree="sparse")
    with pytest.raises(ValueError, match="medusa_model"):
        Decoder.from_pretrained(tiny_pair["target"]).generate(prompt_ids=PROMPT,
                                                              method="medusa")


def test_heads_read_the_feature_that_produced_the_root(tiny_pair):
    """Fresh heads repeat the target's next-token distribution, so on the feature of the
    last accepted node head 1's best token is the token that feature produced: the root.
    Every round of greedy decoding must therefore draft the root itself first."""
    target = load_model(tiny_pair["target"])
    heads = MedusaHeads.from_target(target, tiny_pair["target"], 2)
    drafter = MedusaDrafter(heads, chain_template(2))
    roots, firsts = [], []
    propose = drafter.propose

    def spy(committed, budget):
        tree = propose(committed, budget)
        if len(tree) > 1:
            roots.append(tree.tokens[0])
            firsts.append(tree.tokens[1])
        return tree

    drafter.propose = spy
    from speclab.decoding.drafting import DraftTraits
    from speclab.decoding.loop import generate_tokens
    from speclab.decoding.rules import resolve_rule

    params = SamplingParams(0.0)
    generate_tokens(ModelRunner(target), drafter, PROMPT, 20, params,
                    resolve_rule(None, None, params),
                    traits=DraftTraits(needs_features=True))
    assert len(roots) > 5 and roots[1:] == firsts[1:]  # the first root is the prompt's


@pytest.mark.parametrize("tree,knobs", [("chain", {}), ("cartesian", {"tree_top_k": 2}),
                                        ("sparse", {"nodes": 10}),
                                        ("sparse", {"nodes": 6, "depth": 2})])
def test_greedy_output_is_the_targets_for_every_tree(tiny_pair, trained, tmp_path, tree, knobs):
    heads, history = trained
    assert history[-1] < 0.7 * history[0]
    folder = save_medusa(heads, tmp_path / "m", heads.tree)
    dec = Decoder.from_pretrained(tiny_pair["target"])
    for prompt in (PROMPT, [5], [7, 8, 9, 10]):
        ar, _ = autoregressive_generate(dec.target, prompt, 40, SamplingParams(0.0))
        res = dec.generate(prompt_ids=prompt, method="medusa", medusa_model=str(folder),
                           tree=tree, max_new_tokens=40, **knobs)
        assert res.token_ids == ar
    assert res.stats.accepted_tokens > 0  # trained heads are right sometimes


def test_batched_rows_equal_rows_alone(tiny_pair, trained):
    heads, _ = trained
    dec = Decoder.from_pretrained(tiny_pair["target"])
    ps = [PROMPT, [5], [7, 8, 9, 10], [1, 2]]
    kw = {"method": "medusa", "medusa_model": heads, "tree": "sparse", "nodes": 8,
          "max_new_tokens": 30}
    alone = [dec.generate(prompt_ids=p, **kw) for p in ps]
    res = dec.generate(prompts=ps, batch_size=2, **kw)
    assert [r.token_ids for r in res] == [a.token_ids for a in alone]
    assert sum(r.stats.accepted_tokens for r in res) > 0


def test_the_static_fast_path_runs_medusa(tiny_pair, trained, monkeypatch):
    """``Decoder(compile=True)``'s static layout (uncompiled here) returns the target's
    last hidden states from its step: the heads draft what they draft on the eager
    batched engine (same tokens, same target calls)."""
    import functools

    import speclab.api as api
    from speclab.decoding.static_runner import FastPath

    heads, _ = trained
    ps = [PROMPT, [5], [7, 8, 9, 10], [1, 2]]
    kw = {"method": "medusa", "medusa_model": heads, "tree": "sparse", "nodes": 8,
          "max_new_tokens": 30, "batch_size": 2}
    eager = Decoder.from_pretrained(tiny_pair["target"]).generate(prompts=ps, **kw)
    monkeypatch.setattr(api, "FastPath", functools.partial(FastPath, compile=False))
    fast = Decoder.from_pretrained(tiny_pair["target"], compile=True, capacity=64)
    res = fast.generate(prompts=ps, **kw)
    assert [r.token_ids for r in res] == [r.token_ids for r in eager]
    assert [r.stats.target_calls for r in res] == [r.stats.target_calls for r in eager]


def test_sparse_tree_beats_the_chain_and_follows_the_calibration(tiny_pair, trained):
    heads, _ = trained
    acc = heads.tree["accuracies"]
    assert acc[0][0] > 0.3  # head 1's top-1 is learnt
    tpl = medusa_template(heads, "sparse", 10, 2)
    assert tpl == sparse_template(acc, 10)
    dec = Decoder.from_pretrained(tiny_pair["target"])
    taus = {}
    for tree in ("chain", "sparse"):
        lengths = []
        for prompt in (PROMPT, [7, 8, 9, 10], [1, 2]):
            res = dec.generate(prompt_ids=prompt, method="medusa", medusa_model=heads,
                               tree=tree, nodes=10, max_new_tokens=40)
            lengths += res.stats.accepted_lengths
        taus[tree] = sum(lengths) / len(lengths)
    assert taus["sparse"] >= taus["chain"] > 1.0, taus


def test_typical_acceptance_runs_relaxed_and_is_greedy_at_t0(tiny_pair, trained):
    heads, _ = trained
    dec = Decoder.from_pretrained(tiny_pair["target"])
    ar = dec.generate(prompt_ids=PROMPT, method="ar", max_new_tokens=30)
    t0 = dec.generate(prompt_ids=PROMPT, method="medusa", medusa_model=heads,
                      verify="typical", max_new_tokens=30)
    assert t0.token_ids == ar.token_ids
    hot = dec.generate(prompt_ids=PROMPT, method="medusa", medusa_model=heads,
                       verify="typical", temperature=0.7, max_new_tokens=30,
                       verify_params={"epsilon": 0.3, "delta": 0.09})
    assert len(hot.token_ids) == 30 and hot.stats.tau >= 1.0
    with pytest.raises(Exception, match="epsilon"):
        dec.generate(prompt_ids=PROMPT, method="medusa", medusa_model=heads, verify="typical",
                     temperature=0.7, verify_params={"epsilon": -1})


def test_head_losses_pair_head_k_with_the_token_k_plus_1_ahead():
    vocab, length = 7, 5
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])  # L + 1 = 6
    logits = torch.randn(2, 1, length, vocab)
    got = head_losses(logits, tokens)
    for k in (1, 2):
        span = length - k
        want = torch.nn.functional.cross_entropy(logits[k - 1, 0, :span],
                                                 tokens[0, k + 1: k + 1 + span])
        torch.testing.assert_close(got[k - 1], want)


def test_medusa1_trains_and_raises_head_accuracy(tiny_pair, trained):
    heads, history = trained
    target = load_model(tiny_pair["target"])
    fresh = MedusaHeads.from_target(target, tiny_pair["target"], 3)
    batch = _data(tiny_pair["target"], n=16, seed=5)  # held out
    before = head_accuracies(fresh, batch["features"], batch["tokens"], 1)
    after = head_accuracies(heads, batch["features"], batch["tokens"], 1)
    assert after[0][0] > before[0][0] + 0.2, (before, after)
    with torch.no_grad():
        assert float(medusa1_loss(heads, batch)) < float(medusa1_loss(fresh, batch))


def test_medusa2_warmup_freezes_the_backbone_then_trains_both(tiny_pair):
    target = load_model(tiny_pair["target"])
    model = Medusa2Model(load_model(tiny_pair["target"]),
                         MedusaHeads.from_target(target, tiny_pair["target"], 2))
    batch = _data(tiny_pair["target"], n=4)
    medusa2_loss(model, batch, frozen=True).backward()
    assert all(p.grad is None for p in model.backbone.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.heads.parameters())
    model.zero_grad(set_to_none=True)
    loss = medusa2_loss(model, batch, lambda0=0.5)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0
               for p in model.backbone.parameters())
    # L_LM (kl) of the untouched copy is 0: the copy IS the original
    with torch.no_grad():
        _, heads_logits = model(batch["tokens"][:, :-1])
        want = 0.5 * sum(0.8 ** k * v for k, v in
                         enumerate(head_losses(heads_logits, batch["tokens"]), 1))
    torch.testing.assert_close(loss.detach(), want, atol=1e-4, rtol=1e-4)


def test_lm_quality_of_a_copy_and_of_another_model(tiny_pair):
    a = load_model(tiny_pair["target"])
    windows = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    same = lm_quality(a, load_model(tiny_pair["target"]), windows, [PROMPT], 12)
    assert same["ppl_original"] == pytest.approx(same["ppl_tuned"])
    assert same["top1_agreement"] == 1.0 and same["greedy_identical"] == 1.0
    assert same["repeat4_original"] == same["repeat4_tuned"]
    other = lm_quality(a, load_model(tiny_pair["weak"]), windows, [PROMPT], 12)
    assert other["top1_agreement"] < 1.0 and other["greedy_token_agreement"] < 1.0
    a_out, _ = autoregressive_generate(ModelRunner(a), PROMPT, 12, SamplingParams(0.0))
    assert other["repeat4_original"] == repeated_ngram_share([a_out], 4)


def test_repeated_ngram_share_counts_repeats_within_each_sequence():
    assert repeated_ngram_share([[1, 2, 3, 4, 5, 6]], 4) == 0.0  # 3 four-grams, all new
    # a loop of period 2: (1,2,1,2) then (2,1,2,1), then each repeats
    assert repeated_ngram_share([[1, 2] * 5], 4) == pytest.approx(5 / 7)
    # pooled: the second sequence's 4-gram is not a repeat of the first's
    assert repeated_ngram_share([[1, 2, 3, 4], [1, 2, 3, 4]], 4) == 0.0
    assert repeated_ngram_share([[7, 7, 7, 7, 7]], 4) == 0.5
    assert math.isnan(repeated_ngram_share([[1, 2, 3], []], 4))


@pytest.mark.slow
def test_sampling_with_medusa_matches_the_target(micro_pair):
    from tests.unit.test_engine_sampling import PROMPT as SPROMPT
    from tests.unit.test_engine_sampling import N, chi_square_p, exact_two_token_dist

    heads, _ = _train(micro_pair["target"], 60, heads=2)
    dec = Decoder.from_pretrained(micro_pair["target"])
    exact = exact_two_token_dist(dec, SamplingParams(1.0))
    counts, accepted = {}, 0
    for seed in range(N):
        res = dec.generate(prompt_ids=SPROMPT, method="medusa", medusa_model=heads,
                           tree="cartesian", tree_top_k=3, max_new_tokens=2,
                           temperature=1.0, seed=seed)
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
        accepted += res.stats.accepted_tokens
    assert accepted > N // 4
    assert chi_square_p(counts, exact, N) > 1e-3


def test_shift_command_measures_typical_acceptance_against_the_target(tmp_path, capsys):
    """`speclab shift`: speculative sampling's first-token TV stays at plain sampling's
    noise floor (same seeds); typical acceptance moves mass onto the drafted token."""
    import json

    from speclab.cli import main
    from speclab.models.registry import ensure_tiny_pair

    target, _ = ensure_tiny_pair(tmp_path / "models")  # with a tokenizer, for text prompts
    heads, _ = _train(target, 60)
    folder = save_medusa(heads, tmp_path / "m", heads.tree)
    common = ["shift", "--target", target, "--method", "medusa",
              "--medusa-model", str(folder), "--temperature", "0.7", "--samples", "150",
              "--num-prompts", "3", "--context-chars", "60"]
    result = {}
    for rule in ("sample", "typical"):
        out = tmp_path / rule
        assert main([*common, "--verify", rule, "--verify-param", "epsilon=0.3",
                     "--out", str(out)] if rule == "typical" else
                    [*common, "--verify", rule, "--out", str(out)]) == 0
        result[rule] = json.loads((out / "shift.json").read_text())["mean"]
    assert "tv_method" in capsys.readouterr().out
    floor = result["sample"]["tv_ar"]
    assert result["sample"]["tv_method"] < floor + 0.1, result
    assert result["typical"]["tv_method"] > result["sample"]["tv_method"] + 0.05, result
    assert main([*common, "--verify", "typical", "--verify-param", "epsilon"]) == 2
    assert "verify_params: expected KEY=NUMBER" in capsys.readouterr().err
    assert main([*common[:-6], "--temperature", "0", "--samples", "3"]) == 2


def _prompted_rows(target_dir: str, n: int = 12, prompt: int = 5, seed: int = 7) -> list:
    """``medusa`` rows: random ``prompt``-token "corpus" prompts + 10 greedy tokens."""
    runner = ModelRunner(load_model(target_dir))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, runner.vocab_size, (prompt,), generator=g).tolist()
               for _ in range(n)]
    return medusa_examples(runner, prompts, 10, 4, batch=8)


def _own_accuracy(heads, batch: dict, first: int) -> list[float]:
    """Head k's top-1 accuracy over labels x_{t+k+1} with index >= ``first``, by hand."""
    logits = heads(batch["features"])  # [K, B, L, V]
    tokens, length = batch["tokens"], batch["features"].shape[1]
    out = []
    for k in range(1, heads.meta.heads + 1):
        hits = total = 0
        for t in range(length - k):
            if t + k + 1 >= first:
                hits += int((logits[k - 1, :, t].argmax(-1) == tokens[:, t + k + 1]).sum())
                total += tokens.shape[0]
        out.append(hits / total)
    return out


def test_calibration_scores_the_heads_on_the_targets_own_tokens(tiny_pair, trained, tmp_path):
    """Issue 35, item 6: calibration (``tree.json``, the sparse tree, expected tau) and
    ``val_head<k>_top1`` count only labels in the target's continuation, not the corpus
    prompt's; the heads' loss skips the prompt's labels too (``medusa.prompt_labels``: the
    variant that keeps them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from speclab.config.schema import MedusaTrainConfig, TrainConfig
    from speclab.families.medusa.stages import calibrate
    from speclab.families.medusa.task import MedusaTask, MedusaTaskConfig

    heads, _ = trained
    target = load_model(tiny_pair["target"])
    rows = _prompted_rows(tiny_pair["target"])
    batch = collate_feat(rows)
    with torch.no_grad():
        own, every = _own_accuracy(heads, batch, 5), _own_accuracy(heads, batch, 0)
    assert own[0] > every[0] + 0.05  # the prompt's random tokens bias the estimate down
    tree = calibrate(heads, target, [(r["tokens"], 5) for r in rows], 3, 6, "shard")
    assert [a[0] for a in tree["accuracies"]] == pytest.approx(own, abs=1e-6)
    assert tree["sparse"] == [list(p) for p in sparse_template(tree["accuracies"], 6)]

    folder = tmp_path / "data" / "medusa"
    folder.mkdir(parents=True)
    for i in range(2):
        pq.write_table(pa.Table.from_pylist(rows), folder / f"shard-{i:05d}.parquet")
    cfg = MedusaTaskConfig(train=TrainConfig(batch_size=3),
                           medusa=MedusaTrainConfig(heads=3, engine_prompts=0),
                           target=tiny_pair["target"], prompt_len=5)
    task = MedusaTask(cfg, tmp_path / "data", torch.device("cpu"))
    task.build_model()
    got = task.val_metrics(heads)
    assert [got[f"val_head{k}_top1"] for k in (1, 2, 3)] == pytest.approx(own, abs=1e-6)
    # the heads' loss: labels x_{t+k+1} with index >= 5 only
    sub = {k: v[:3] for k, v in batch.items()}
    with torch.no_grad():
        logits = heads(sub["features"])
        want = sum(0.8 ** k * torch.nn.functional.cross_entropy(
            logits[k - 1, :, max(5 - k - 1, 0): 14 - k].reshape(-1, logits.shape[-1]),
            sub["tokens"][:, max(5 - k - 1, 0) + k + 1: 15].reshape(-1)) for k in (1, 2, 3))
        torch.testing.assert_close(task.loss(heads, sub), want)
        every_label = cfg.model_copy(update={"medusa": cfg.medusa.model_copy(
            update={"prompt_labels": True})})
        both = MedusaTask(every_label, tmp_path / "data", torch.device("cpu"))
        torch.testing.assert_close(both.loss(heads, sub), medusa1_loss(heads, sub))


def test_serve_refuses_heads_of_another_target_at_load(tiny_pair, trained, tmp_path):
    """Issue 35, item 9: a Serve draft replica checks its Medusa heads against the target
    when it loads (shape and LM-head fingerprint, as offline; the fingerprint read from the
    target's safetensors, tied embeddings too) and refuses them, naming the field."""
    from transformers import LlamaForCausalLM

    from serve_apps.draft import DraftDeployment
    from speclab.families.medusa.model import lm_head_fingerprint as _lm_head_fingerprint
    from speclab.families.medusa.model import target_fingerprint
    from speclab.models.tiny import tiny_llama_config

    heads, _ = trained
    folder = str(save_medusa(heads, tmp_path / "m", heads.tree))
    method = {"name": "medusa", "medusa_model": folder}
    assert DraftDeployment(None, None, method, 64, target_source=tiny_pair["target"]).features
    with pytest.raises(ValueError, match="medusa_model: heads trained for target .*other "
                                         "weights"):
        DraftDeployment(None, None, method, 64, target_source=tiny_pair["close"])
    with pytest.raises(ValueError, match="medusa_model: heads trained for a target with "
                                         "vocab_size=64, but the target has 100"):
        DraftDeployment(None, None, method, 100)
    config = tiny_llama_config(vocab_size=48, hidden_size=16, num_layers=1, num_heads=2)
    config.tie_word_embeddings = True
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tied")
    for path in (tiny_pair["target"], str(tmp_path / "tied")):
        model = load_model(path)
        assert _lm_head_fingerprint(path, model.config) == target_fingerprint(model)


def test_calibration_continues_held_out_prompts_of_the_evaluations_kind(tmp_path):
    """Issue 35, item 3: ``medusa.calibration: prompts`` (the default) scores the heads on
    held-out prompts of the evaluation's kind (never the evaluated ones) continued greedily
    by the target, stopping at EOS, with only the continuation's labels counted, over
    sequences of different lengths; the tree shapes' ``replayed_tau`` equals the tau that
    greedy decoding with the heads measures on those prompts; a JSONL set with nothing
    beyond the evaluated prompts is refused naming the field."""
    from types import SimpleNamespace

    from speclab.config.schema import DataConfig, DecodingConfig, MedusaTrainConfig
    from speclab.data.prompts import held_out_prompts, load_prompts
    from speclab.families.medusa.stages import calibrate, calibration_sequences
    from speclab.models.registry import ensure_tiny_pair

    evaluated = set(load_prompts("stdlib_functions", 16, 200))
    held = held_out_prompts("stdlib_functions", 8, 16, 200)
    assert len(held) == 8 and not evaluated & set(held)
    every = load_prompts("stdlib_functions", 10**9, 200)  # the evaluation's sequence
    assert held == every[-8:]  # its tail: the evaluation's split, past any short evaluation
    assert held_out_prompts("stdlib_functions", 64, len(every) - 5, 200) == every[-5:]

    target, _ = ensure_tiny_pair(tmp_path / "models")  # with a tokenizer
    texts = ["def add(a, b):", "class Foo:", "import os\nimport sys", "for i in range(3):",
             "    return x", "x = [1, 2, 3]\n"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    cfg = SimpleNamespace(data=DataConfig(prompts="jsonl", path=str(path), num_prompts=2),
                          medusa=MedusaTrainConfig(heads=3, calibration_prompts=3),
                          decoding=DecodingConfig(max_new_tokens=10), distill=None)
    dec = Decoder.from_pretrained(target)
    model = dec.target.model
    plain = [dec.generate(t, method="ar", max_new_tokens=10).token_ids for t in texts[2:5]]
    model.generation_config.eos_token_id = plain[0][3]  # the first held-out row stops early
    seqs = calibration_sequences(cfg, target, model, tmp_path / "unused")
    ids = [dec.encode(t) for t in texts[2:5]]
    assert [s[1] for s in seqs] == [len(i) for i in ids]  # scored past the prompt
    assert seqs[0][0] == ids[0] + plain[0][:4]  # stops at (and keeps) EOS
    for (tokens, _), prompt, cont in zip(seqs[1:], ids[1:], plain[1:]):
        assert tokens[: len(prompt)] == prompt
        got = tokens[len(prompt):]
        assert got == cont[: len(got)] and (len(got) == 10 or got[-1] == plain[0][3])

    heads = MedusaHeads.from_target(model, target, 3)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    heads.eval()
    tree = calibrate(heads, model, seqs, 4, 6)
    hits, total = torch.zeros(3), torch.zeros(3)  # by hand, one ragged sequence at a time
    with torch.no_grad():
        for tokens, first in seqs:
            t = torch.tensor([tokens])
            logits = heads(model.model(input_ids=t[:, :-1]).last_hidden_state)
            for k in range(1, 4):
                for pos in range(t.shape[1] - 1 - k):
                    if pos + k + 1 >= first:
                        hits[k - 1] += int(logits[k - 1, 0, pos].argmax() == t[0, pos + k + 1])
                        total[k - 1] += 1
    assert [a[0] for a in tree["accuracies"]] == pytest.approx((hits / total).tolist())
    assert tree["calibration"] == "prompts" and tree["calibration_sequences"] == 3
    assert tree["calibration_labels"] == total.tolist()
    # the replayed tau is what greedy decoding with those heads measures on those prompts
    folder = str(save_medusa(heads, tmp_path / "heads", tree))
    same_eos = Decoder(model, tokenizer=dec.tokenizer)
    for shape, knobs in (("chain", {"tree": "chain"}),
                         ("cartesian_2", {"tree": "cartesian", "tree_top_k": 2})):
        lengths = [n for p in ids for n in same_eos.generate(
            prompt_ids=p, method="medusa", medusa_model=folder, max_new_tokens=10,
            **knobs).stats.accepted_lengths]
        assert tree["replayed_tau"][shape] == pytest.approx(sum(lengths) / len(lengths))

    short = SimpleNamespace(**{**vars(cfg), "data": DataConfig(
        prompts="jsonl", path=str(path), num_prompts=6)})
    with pytest.raises(ValueError, match="medusa.calibration: 'prompts' needs prompts"):
        calibration_sequences(short, target, model, tmp_path / "unused")


def test_replayed_length_walks_the_rounds_as_decoding_does():
    """A round at position j accepts the deepest template prefix of its ranks and the next
    round starts past its bonus token: the long accepted run at position 0 is ONE round
    (a mean over every position would count positions 1-3 as rounds too); independent
    heads are not assumed."""
    chain = chain_template(3)
    seq = [(0, 0, 0), (0, 0, 9), (0, 9, 9), (9, 9, 9), (1, 0, 9), (0, 9, 9)]
    # rounds: j=0 accepts 3 (4 tokens) -> j=4: rank 1 is off the chain, 0 (1 token) -> j=5:
    # accepts 1 (2 tokens)
    assert replayed_length(chain, [seq]) == pytest.approx((4 + 1 + 2) / 3)
    wide = cartesian_template(2, 3)  # rank 1 at depth 1 is in this tree
    # j=0 (4 tokens), then j=4 accepts (1, 0) (3 tokens) and the sequence ends
    assert replayed_length(wide, [seq]) == pytest.approx((4 + 3) / 2)
    assert replayed_length(wide, [seq, seq[3:]]) == pytest.approx((4 + 3 + 1 + 3) / 4)
    assert replayed_length(chain, []) == 1.0
