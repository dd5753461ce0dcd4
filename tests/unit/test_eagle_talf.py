"""TALF on the EAGLE drafter: the target-built forest (one beam tree per position) and the
drafter's logits at its nodes, each checked against a plain path-by-path computation."""

import pytest
import torch

from speclab.decoding.runner import ModelRunner
from speclab.families.eagle.model import EagleModel
from speclab.families.eagle.training import collate_forest, talf_logits, talf_loss
from speclab.models.loading import load_model
from speclab.train.distill_data import feat_forest_example

TOP_K, DEPTH, K = 3, 3, 4


def _window(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length + 1,), generator=g).tolist()


def _path(batch: dict, b: int, r: int, d: int, i: int) -> list[int]:
    """Tokens from root pair ``r`` down to beam slot ``i`` at depth index ``d``."""
    toks, slot = [], i
    for level in range(d, -1, -1):
        toks.append(int(batch["forest_tokens"][b, r, level, slot]))
        slot = int(batch["forest_parents"][b, r, level, slot])
    return toks[::-1]


def test_forest_nodes_carry_the_targets_own_beam_and_distributions(tiny_pair):
    target = load_model(tiny_pair["target"])
    runner = ModelRunner(target)
    window = _window(target.config.vocab_size, 12, 0)
    batch = collate_forest([feat_forest_example(runner, window, K, TOP_K, DEPTH)])
    assert batch["forest_tokens"].shape == (1, 11, DEPTH, TOP_K)
    assert (batch["forest_parents"][:, :, 0] == -1).all()
    for r in (0, 4, 10):  # root x_{r+1}
        prefix = window[: r + 2]
        with torch.no_grad():
            logp = torch.log_softmax(target(torch.tensor([prefix])).logits[0, -1], -1)
        assert batch["forest_tokens"][0, r, 0].tolist() == logp.topk(TOP_K).indices.tolist()
        for d in range(DEPTH):
            for i in range(TOP_K):
                path = _path(batch, 0, r, d, i)
                with torch.no_grad():
                    out = target(torch.tensor([prefix + path])).logits[0, -1].softmax(-1)
                probs, ids = out.topk(K)
                assert batch["forest_ids"][0, r, d, i].tolist() == ids.tolist()
                torch.testing.assert_close(batch["forest_probs"][0, r, d, i], probs,
                                           atol=2e-3, rtol=1e-2)
        # the beam: depth 2 keeps the TOP_K best two-token paths under the root
        scores = {}
        for a in logp.topk(TOP_K).indices.tolist():
            with torch.no_grad():
                nxt = torch.log_softmax(target(torch.tensor([prefix + [a]])).logits[0, -1], -1)
            for c in range(nxt.shape[0]):
                scores[(a, c)] = float(logp[a] + nxt[c])
        best = sorted(scores, key=scores.get, reverse=True)[:TOP_K]
        got = {tuple(_path(batch, 0, r, 1, i)) for i in range(TOP_K)}
        assert got == set(best)


@pytest.mark.parametrize("roots", [0, 4])
def test_talf_logits_are_the_drafters_on_its_own_features_along_each_path(tiny_pair, roots):
    target = load_model(tiny_pair["target"])
    runner = ModelRunner(target)
    vocab = target.config.vocab_size
    rows = [feat_forest_example(runner, _window(vocab, 10, s), K, TOP_K, DEPTH)
            for s in (1, 2)]
    batch = collate_forest(rows, roots, torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    model = EagleModel.from_target(target).float().eval()
    with torch.no_grad():
        logits, ids, _ = talf_logits(model, batch)
    t = batch["features"].shape[1] - 1
    n_roots = roots or t
    assert logits.shape[:2] == ids.shape[:2] == (2, t + DEPTH * n_roots * TOP_K)
    if roots:  # a random subset, different per row
        assert batch["forest_roots"][0].tolist() != batch["forest_roots"][1].tolist()
    for b in (0, 1):
        feats, tokens = batch["features"][b], batch["tokens"][b]
        for j in sorted({0, n_roots // 2, n_roots - 1}):
            r = int(batch["forest_roots"][b, j])
            # the engine's view: pairs 0..r with the target's features, then each node
            # fed the drafter's own output at its parent (a chain, causal attention)
            with torch.no_grad():
                f_hat, ctx_logits = model(feats[None, : r + 1], tokens[None, 1: r + 2])
            torch.testing.assert_close(logits[b, r], ctx_logits[0, -1], atol=1e-4, rtol=1e-4)
            for d in range(DEPTH):
                for i in range(TOP_K):
                    path = _path(batch, b, j, d, i)
                    f_in = feats[: r + 1]
                    x_in = tokens[1: r + 2]
                    out_f = f_hat[0]
                    for tok in path:
                        f_in = torch.cat([f_in, out_f[-1:]])
                        x_in = torch.cat([x_in, torch.tensor([tok])])
                        with torch.no_grad():
                            out_f, out_l = model(f_in[None], x_in[None])
                        out_f = out_f[0]
                    col = t + (d * n_roots + j) * TOP_K + i
                    torch.testing.assert_close(logits[b, col], out_l[0, -1], atol=1e-4,
                                               rtol=1e-4)


def test_talf_training_lowers_the_loss(tiny_pair):
    target = load_model(tiny_pair["target"])
    runner = ModelRunner(target)
    vocab = target.config.vocab_size
    batch = collate_forest([feat_forest_example(runner, _window(vocab, 12, s), K, 2, 2)
                            for s in range(4)])
    torch.manual_seed(0)
    model = EagleModel.from_target(target).float()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    history = []
    for _ in range(40):
        loss = talf_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
    assert history[-1] < 0.7 * history[0]


def test_training_starts_from_init_from(tiny_pair, tmp_path):
    """``eagle.init_from``: the task's model starts as that drafter (the papers' protocol
    of fine-tuning an EAGLE-trained drafter with HASS or TALF); another depth is refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from speclab.config.schema import EagleTrainConfig, TrainConfig
    from speclab.families.eagle.model import save_eagle
    from speclab.families.eagle.task import EagleTask, EagleTaskConfig

    target = load_model(tiny_pair["target"])
    runner = ModelRunner(target)
    vocab = target.config.vocab_size
    folder = tmp_path / "data" / "feat_tree"
    folder.mkdir(parents=True)
    for i in range(2):
        rows = [feat_forest_example(runner, _window(vocab, 8, 10 * i + s), K, 2, 2)
                for s in range(2)]
        pq.write_table(pa.Table.from_pylist(rows), folder / f"shard-{i:05d}.parquet")
    torch.manual_seed(5)
    start = save_eagle(EagleModel.from_target(target).float(), tmp_path / "start")
    cfg = EagleTaskConfig(train=TrainConfig(batch_size=2),
                          eagle=EagleTrainConfig(loss="talf", init_from=str(start),
                                                 talf_roots=3),
                          target=tiny_pair["target"])
    task = EagleTask(cfg, tmp_path / "data", torch.device("cpu"))
    model = task.build_model()
    saved = EagleModel.from_target(target).float()
    saved.load_state_dict(_saved_state(start))
    for (name, a), b in zip(model.state_dict().items(), saved.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    batch = task.batch(0, 0)
    assert batch["forest_roots"].shape == (2, 3) and torch.isfinite(task.loss(model, batch))
    deeper = cfg.model_copy(update={"eagle": cfg.eagle.model_copy(update={"layers": 2})})
    with pytest.raises(ValueError, match="eagle.init_from"):
        EagleTask(deeper, tmp_path / "data", torch.device("cpu")).build_model()


def _saved_state(folder) -> dict:
    """The tensors of a drafter folder written by save_eagle."""
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_drawn_trees_give_the_full_loss_in_expectation(tiny_pair):
    """``talf_roots`` R < T (issue 35, item 3): averaged over every draw of R trees, the
    loss equals the loss over every tree; the roots weigh 1 / (1 + D k) of it, as in the
    full loss, not T / (T + R D k)."""
    from itertools import combinations

    target = load_model(tiny_pair["target"])
    runner = ModelRunner(target)
    full = collate_forest([feat_forest_example(runner, _window(target.config.vocab_size, 6,
                                                                 7), K, 2, 2)])
    t = full["forest_roots"].shape[1]
    torch.manual_seed(0)
    model = EagleModel.from_target(target).float().eval()
    with torch.no_grad():
        want = float(talf_loss(model, full))
        draws = []
        for pick in combinations(range(t), 2):
            idx = torch.tensor(pick)
            sub = {**full, "forest_roots": idx[None]}
            for key in ("forest_tokens", "forest_parents", "forest_ids", "forest_probs"):
                sub[key] = full[key][:, idx]
            draws.append(float(talf_loss(model, sub)))
    assert len(draws) == 10
    assert sum(draws) / len(draws) == pytest.approx(want, rel=1e-5)


def test_trees_drawn_when_the_data_is_made_are_the_full_forests_at_their_roots(tiny_pair):
    """``eagle.talf_data_roots``: a window's trees built at ``n`` drawn roots are the full
    forest's trees there (tokens, parents, the target's top-k), the batch names those roots,
    a training draw picks among them, and the drafter's TALF logits at their nodes are the
    full forest's."""
    target = load_model(tiny_pair["target"])
    runner = ModelRunner(target)
    window = _window(target.config.vocab_size, 12, 5)
    full = collate_forest([feat_forest_example(runner, window, K, TOP_K, DEPTH)])
    row = feat_forest_example(runner, window, K, TOP_K, DEPTH, roots=4,
                              generator=torch.Generator().manual_seed(1))
    part = collate_forest([row])
    at = part["forest_roots"][0]
    assert part["forest_tokens"].shape == (1, 4, DEPTH, TOP_K)
    assert at.tolist() == sorted(set(at.tolist())) and 0 <= int(at.min()) and int(at.max()) < 11
    for key in ("forest_tokens", "forest_parents", "forest_ids"):
        assert torch.equal(part[key][0], full[key][0, at]), key
    torch.testing.assert_close(part["forest_probs"][0], full["forest_probs"][0, at])
    again = feat_forest_example(runner, window, K, TOP_K, DEPTH, roots=4,
                                generator=torch.Generator().manual_seed(1))
    assert again["forest_roots"] == row["forest_roots"]  # the draw is the generator's
    sub = collate_forest([row], 2, torch.Generator().manual_seed(0))
    assert sub["forest_roots"].shape == (1, 2)
    assert set(sub["forest_roots"][0].tolist()) <= set(at.tolist())
    torch.manual_seed(0)
    model = EagleModel.from_target(target).float().eval()
    with torch.no_grad():
        got, _, _ = talf_logits(model, part)
        want, _, _ = talf_logits(model, full)
    t = full["features"].shape[1] - 1
    torch.testing.assert_close(got[0, :t], want[0, :t], atol=1e-4, rtol=1e-4)
    for d in range(DEPTH):
        for j, r in enumerate(at.tolist()):
            for i in range(TOP_K):
                torch.testing.assert_close(got[0, t + (d * 4 + j) * TOP_K + i],
                                           want[0, t + (d * t + r) * TOP_K + i],
                                           atol=1e-4, rtol=1e-4)
