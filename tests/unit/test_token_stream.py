"""Conversations as a training corpus: inputs never cross two conversations and end on
an assistant token, rows carry the assistant-only loss mask, and the feature and KD
losses ignore every position the mask leaves out (tiny fixtures; no download)."""

from __future__ import annotations

import json

import pytest
import torch

from speclab.config.schema import CorpusConfig
from speclab.data.token_stream import TokenStream, row_loss_mask, token_stream

pytestmark = pytest.mark.usefixtures("own_home")  # the corpus's shards


def _conversations(n: int) -> list[dict]:
    return [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what is the capital of Portugal?"},
        {"from": "gpt", "value": "Lisbon is the capital. " * (1 + i % 3)},
        {"from": "human", "value": "reverse a string"},
        {"from": "gpt", "value": "def reverse(s): return s[::-1]"}]} for i in range(n)]


@pytest.fixture()
def tokenizer(chat_tokenizer):
    return chat_tokenizer


@pytest.fixture()
def chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _conversations(40)) + "\nnot json\n")
    return path


def test_conversation_stream_segments_masks_and_split(tokenizer, chat_file):
    corpus = CorpusConfig(source="conversations", path=str(chat_file), validation=0.2, test=0.2)
    train = token_stream(corpus, tokenizer, "train")
    val = token_stream(corpus, tokenizer, "validation")
    assert train.stats["malformed"] == 1 and train.stats["conversations_read"] == 40
    n_train, n_val = int(train.segment.max()) + 1, int(val.segment.max()) + 1
    assert n_train + n_val < 40 and n_train > n_val > 0  # the test split is elsewhere
    assert train.mask.shape == train.tokens.shape == train.segment.shape
    assert 0 < int(train.mask.sum()) < train.numel()
    # the mask is exactly the assistant turns: the end-of-turn marker, never a user token
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ends = (train.tokens == im_end).nonzero().flatten().tolist()
    assert [int(train.mask[e]) for e in ends[:4]] == [0, 1, 0, 1]
    capped = token_stream(corpus.model_copy(update={"max_conversations": 3}), tokenizer)
    assert int(capped.segment.max()) == 2


def test_inputs_lie_in_one_conversation_and_end_on_an_assistant_token(tokenizer, chat_file):
    stream = token_stream(CorpusConfig(source="conversations", path=str(chat_file)), tokenizer)
    length = 24
    starts = stream.starts(200, length, torch.Generator().manual_seed(0))
    assert starts == stream.starts(200, length, torch.Generator().manual_seed(0))
    for s in starts:
        assert int(stream.segment[s]) == int(stream.segment[s + length - 1])
        assert int(stream.mask[s + length - 1]) == 1
    masks = stream.masks(starts[:3], length)
    assert masks == [stream.mask[s: s + length].tolist() for s in starts[:3]]
    with pytest.raises(ValueError, match="no conversation holds an input of 500 tokens"):
        stream.starts(4, 500, torch.Generator())


def test_plain_text_starts_are_the_plans_of_old():
    tokens = torch.arange(500) % 37
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert TokenStream.of(tokens).starts(9, 10, g1) == \
        torch.randint(0, 500 - 10 - 1, (9,), generator=g2).tolist()
    assert TokenStream.of(tokens).masks([1, 2], 10) is None


def test_row_loss_mask_keeps_the_inputs_mask_and_counts_what_the_target_wrote():
    assert row_loss_mask([1, 2, 3], [1, 2, 3], [0, 1, 1]) == [0, 1, 1]
    assert row_loss_mask([1, 2, 9, 9], [1, 2, 3], [0, 0, 0]) == [0, 0, 1, 1]


def test_plain_text_jobs_refuse_conversations_by_name():
    from speclab.data.text import load_corpus

    with pytest.raises(ValueError, match="corpus.source: conversations"):
        load_corpus("conversations", "x.jsonl", 100, 10)


def _feat_batch(seed: int = 0, b: int = 2, length: int = 9, h: int = 16, k: int = 3,
                vocab: int = 40) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, vocab, (b, length + 1), generator=g),
            "features": torch.randn(b, length, h, generator=g),
            "topk_ids": torch.randint(0, vocab, (b, length, k), generator=g),
            "topk_probs": torch.rand(b, length, k, generator=g).softmax(-1)}


@pytest.mark.parametrize("loss", ["eagle", "hass", "eagle3"])
def test_masked_positions_never_reach_the_feature_losses(loss):
    from speclab.families.eagle.training import eagle3_loss, feature_loss

    model = _eagle_model()
    batch = _feat_batch()
    mask = torch.ones(2, 10)
    mask[:, 2:6] = 0  # pairs 0..3 predict tokens 2..5: not the assistant's
    batch["loss_mask"] = mask

    def run(b):
        torch.manual_seed(0)
        if loss == "eagle3":
            return eagle3_loss(model, b, steps=3)
        return feature_loss(model, b, steps=1 if loss == "eagle" else 3, w_topk=0.0)

    base = run(batch)
    masked_ids = batch["topk_ids"].clone()
    masked_ids[:, 1:5] = (masked_ids[:, 1:5] + 7) % 40  # the targets of masked pairs 0..3
    assert torch.allclose(base, run({**batch, "topk_ids": masked_ids}))
    moved = dict(batch)
    moved["topk_ids"] = batch["topk_ids"].clone()
    moved["topk_ids"][:, 7] = (moved["topk_ids"][:, 7] + 7) % 40  # an assistant position
    assert not torch.allclose(base, run(moved))
    unmasked = {k: v for k, v in batch.items() if k != "loss_mask"}
    assert not torch.allclose(base, run(unmasked))


def _eagle_model():
    from speclab.families.eagle.model import EagleMeta, EagleModel

    torch.manual_seed(0)
    return EagleModel(EagleMeta("LlamaForCausalLM", hidden_size=16, vocab_size=40, heads=2,
                                intermediate_size=32)).eval()


def test_kd_batches_take_the_rows_mask():
    from speclab.train.distill_batches import collate_kd

    rows = [{"tokens": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
            {"tokens": [5, 6, 7, 8], "loss_mask": [1, 1, 1, 0]}]
    assert collate_kd(rows)["mask"].tolist() == [[0, 1, 1], [1, 1, 0]]
    assert collate_kd([{"tokens": [1, 2, 3]}])["mask"].tolist() == [[1, 1]]
