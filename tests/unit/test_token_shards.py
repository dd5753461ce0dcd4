"""The conversation corpus as token shards: written once record by record, cut between
conversations, memory-mapped and reused by later runs, a new folder when the source or
the settings change; sharding never changes the stream or the inputs drawn from it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from speclab.config.schema import CorpusConfig
from speclab.data.token_shards import MANIFEST
from speclab.data.token_stream import token_stream
from tests.unit.test_token_stream import _conversations

pytestmark = pytest.mark.usefixtures("own_home")  # the shards stay in the test's dir


@pytest.fixture()
def chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _conversations(120)) + "\n")
    return path


def test_sharding_changes_neither_the_stream_nor_the_inputs_drawn(chat_tokenizer, chat_file):
    corpus = CorpusConfig(source="conversations", path=str(chat_file), validation=0.1,
                          test=0.1)
    whole = token_stream(corpus, chat_tokenizer)
    cut = token_stream(corpus.model_copy(update={"shard_tokens": 1024}), chat_tokenizer)
    assert len(whole.shards) == 1 and len(cut.shards) >= 3
    assert whole.stats["cache"] != cut.stats["cache"]  # the shard size is in the key
    for part in ("tokens", "mask", "segment"):
        assert torch.equal(getattr(whole, part), getattr(cut, part))
    for s in cut.shards:  # memory-mapped, cut between conversations
        assert isinstance(s.tokens, np.memmap)
    firsts = [int(s.segment[0]) for s in cut.shards]
    lasts = [int(s.segment[-1]) for s in cut.shards]
    assert all(a > b for a, b in zip(firsts[1:], lasts[:-1], strict=True))
    for length in (8, 24, 40):
        starts = whole.starts(300, length, torch.Generator().manual_seed(3))
        assert cut.starts(300, length, torch.Generator().manual_seed(3)) == starts
        assert cut.inputs(starts, length) == whole.inputs(starts, length)
        assert cut.masks(starts, length) == whole.masks(starts, length)


def test_a_second_run_reuses_the_shards_and_a_changed_file_is_tokenised_again(
        chat_tokenizer, chat_file, own_home, capsys):
    corpus = CorpusConfig(source="conversations", path=str(chat_file), max_conversations=None)
    first = token_stream(corpus, chat_tokenizer)
    assert "tokenised in" in capsys.readouterr().out
    again = token_stream(corpus, chat_tokenizer)
    assert "reused" in capsys.readouterr().out
    assert again.stats == first.stats and torch.equal(again.tokens, first.tokens)
    assert first.stats["conversations_used"] > 100  # null: every train conversation
    with open(chat_file, "a") as f:  # one more conversation: a new key
        f.write(json.dumps(_conversations(121)[-1]) + "\n")
    grown = token_stream(corpus, chat_tokenizer)
    assert grown.stats["cache"] != first.stats["cache"]
    assert grown.stats["conversations_read"] == first.stats["conversations_read"] + 1
    assert len(list((own_home / "data" / "tokens").iterdir())) == 2  # no temporary folder


def test_a_damaged_shard_folder_is_refused_by_name_and_a_dead_writer_leaves_nothing(
        chat_tokenizer, chat_file, own_home):
    import shutil

    corpus = CorpusConfig(source="conversations", path=str(chat_file), shard_tokens=1024)
    folder = Path(token_stream(corpus, chat_tokenizer).stats["cache"])
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["conversations_used"] > 0 and len(manifest["shards"]) >= 3
    (folder / "mask-00001.npy").unlink()
    with pytest.raises(ValueError, match=r"shard 1 is unreadable.*delete the folder"):
        token_stream(corpus, chat_tokenizer)
    # a writer that died left its temporary folder: the next writer of that key removes
    # it; a live writer's (this process's) and a fresh one of another host stay
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    host = socket.gethostname()
    dead = folder.parent / f"{folder.name}.tmp-{host}-{gone.stdout.strip()}-0badf00d"
    live = folder.parent / f"{folder.name}.tmp-{host}-{os.getpid()}-0000beef"
    remote = folder.parent / f"{folder.name}.tmp-elsewhere-1-0000cafe"
    old_remote = folder.parent / f"{folder.name}.tmp-elsewhere-2-0000dead"
    for f in (dead, live, remote, old_remote):
        f.mkdir()
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(old_remote, (day_ago, day_ago))
    shutil.rmtree(folder)
    again = token_stream(corpus, chat_tokenizer)
    assert again.numel() == manifest["tokens"]
    assert not dead.exists() and not old_remote.exists()
    assert live.exists() and remote.exists()


def test_an_empty_split_is_refused_and_nothing_is_cached(chat_tokenizer, tmp_path, own_home):
    path = tmp_path / "none.jsonl"
    path.write_text(json.dumps({"id": "a", "conversations": [
        {"from": "human", "value": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="holds no train conversation"):
        token_stream(CorpusConfig(source="conversations", path=str(path)), chat_tokenizer)
    assert not any((own_home / "data" / "tokens").iterdir())
