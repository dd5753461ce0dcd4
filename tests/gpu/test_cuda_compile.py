"""The compiled fast path on CUDA (skipped without CUDA): ``Decoder(compile=True)`` runs
the batched engine over static caches (``decoding/static_runner.py``: one
:class:`FastPath` per (model, rows), its step ``torch.compile``'d with
``mode="reduce-overhead"`` on CUDA, i.e. CUDA graphs), about a minute each on one H100:

- prompts of 5, 70, 10, 20, 140 and 20 tokens (plain decoding; the capacity each call
  needs is 128, 192, 128, 128, 256 and 128 slots): a call that fits the cache it finds
  compiles nothing, records no CUDA graph and replays one per forward; GPU memory stays
  flat across such calls, and a call that needs a bigger cache grows it by the
  difference of the two caches only (the old one is freed). The first call that replays
  after a recording may hold up to :data:`FIRST_REPLAY` more (measured on an H200 with
  torch 2.11: 32 MiB, the same after each recording, given back when the next cache
  replaces it; the first version of this test assumed 2 MiB and failed there);
- a draft model too (chain): after a warm-up pass, the same calls compile nothing, record
  no CUDA graph, replay one per forward and give the eager engine's tokens.

Compiles are counted with dynamo's counters (``counters["stats"]["unique_graphs"]``,
``counters["frames"]["ok"]``), CUDA graphs by counting the cudagraph-tree manager's
recordings and replays and inductor's ``counters["inductor"]["cudagraph_skips"]``.

The CPU tests at the end run the same sweep with the static layout uncompiled (a few
seconds), and pin a defect: a replaced static cache is freed only by Python's cyclic
garbage collector (see :func:`test_a_replaced_static_cache_is_freed_without_the_cyclic_gc`),
which is why the CUDA test collects garbage before it reads the memory.
"""

from __future__ import annotations

import functools
import gc
import time
import weakref

import pytest
import torch

from speclab.api import Decoder
from speclab.decoding.static_runner import FastPath

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LENGTHS = (5, 70, 10, 20, 140, 20)
NEW_TOKENS = 16
CAPACITIES = [128, 192, 192, 192, 256, 256]  # of the one static cache after each call
REUSING = (2, 3, 5)  # the calls that fit the cache an earlier call left
FIRST_REPLAYS = (2, 5)  # ... right after a call that recorded
NEW_CACHES = (0, 1, 4)  # a new capacity: a new cache, compiled anew
SLACK = 2 * 2**20  # bytes: what a call may leave beyond its cache (graph outputs, ...)
FIRST_REPLAY = 64 * 2**20  # bytes: what the first replay after a recording may add


def prompt(n: int) -> list[int]:
    return [(i % 60) + 2 for i in range(n)]


def cache_bytes(dec: Decoder) -> int:
    """Bytes of the static caches the Decoder holds now."""
    return sum(t.numel() * t.element_size()
               for f in dec._fast.values() for t in (*f.keys, *f.values))


class GraphCounts:
    """Compiles (dynamo's counters), CUDA graph recordings / replays / skips (the
    cudagraph-tree manager, inductor's counter) and fast-path forwards, as running
    totals; :meth:`since` gives what happened after an earlier :meth:`now`."""

    def __init__(self, monkeypatch) -> None:
        from torch._inductor import cudagraph_trees

        self.calls = {"records": 0, "replays": 0, "runs": 0}
        mgr = cudagraph_trees.CUDAGraphTreeManager
        for name, key, owner in (("record_function", "records", mgr),
                                 ("execute_node", "replays", mgr), ("run", "runs", FastPath)):
            monkeypatch.setattr(owner, name, self._counting(getattr(owner, name), key))

    def _counting(self, fn, key: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.calls[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    def now(self) -> dict[str, int]:
        from torch._dynamo.utils import counters

        return {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["ok"],
                "skips": counters["inductor"]["cudagraph_skips"], **self.calls}

    def since(self, before: dict[str, int]) -> dict[str, int]:
        return {k: v - before[k] for k, v in self.now().items()}


def sweep(dec: Decoder, counts: GraphCounts, lengths=LENGTHS) -> list[dict]:
    """One plain-decoding call per prompt length; per call: what it compiled, recorded
    and replayed, the static cache's capacity, the cache bytes held and (CUDA) the
    memory allocated once the call's garbage is collected."""
    out = []
    for n in lengths:
        before = counts.now()
        t0 = time.perf_counter()
        res = dec.generate(prompt_ids=prompt(n), method="ar", max_new_tokens=NEW_TOKENS)
        row = {"n": n, "s": time.perf_counter() - t0, "tokens": res.token_ids,
               "caches": len(dec._fast), "capacity": [f.capacity for f in dec._fast.values()],
               "cache_bytes": cache_bytes(dec), **counts.since(before)}
        if torch.cuda.is_available() and dec.target.device.type == "cuda":
            torch.cuda.synchronize()
            row["mem_no_gc"] = torch.cuda.memory_allocated()
            gc.collect()  # a replaced FastPath waits for the cyclic GC (the defect below)
            row["mem"] = torch.cuda.memory_allocated()
        out.append(row)
    return out


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """Two layers with a wide KV (32 heads x 128): the static cache holds 64 KiB per slot
    (8 / 12 / 16 MiB at 128 / 192 / 256 slots), so a cache left behind is far above
    :data:`SLACK`. No EOS: every call generates all its tokens."""
    from speclab.models.tiny import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("wide") / "m", seed=3, vocab_size=64,
                                hidden_size=4096, num_heads=32, intermediate_size=512,
                                num_layers=2))


@pytest.mark.gpu
@CUDA
def test_prompts_of_any_length_reuse_the_compiled_graphs_and_the_memory(wide_model,
                                                                        monkeypatch):
    dec = Decoder.from_pretrained(wide_model, device="cuda", compile=True)
    counts = GraphCounts(monkeypatch)
    rows = sweep(dec, counts)
    table = "\n".join(f"{r['n']:4d} tokens: cap {r['capacity']} {r['s']:6.2f} s "
                      f"graphs +{r['graphs']} records +{r['records']} replays +{r['replays']} "
                      f"runs +{r['runs']} mem {r['mem'] / 2**20:.1f} MiB "
                      f"(before gc {r['mem_no_gc'] / 2**20:.1f})" for r in rows)
    print("\n" + table)
    assert [r["capacity"] for r in rows] == [[c] for c in CAPACITIES], table
    assert all(r["caches"] == 1 for r in rows), table  # one static cache per (model, rows)
    assert all(len(r["tokens"]) == NEW_TOKENS for r in rows), table
    assert sum(r["skips"] for r in rows) == 0, table  # no forward fell back from CUDA graphs
    for i in NEW_CACHES:
        assert rows[i]["graphs"] > 0, table
    for i in REUSING:  # the cache fits: no compile, no recording, a replay per forward
        r = rows[i]
        assert r["graphs"] == 0 and r["frames"] == 0, table
        assert r["records"] == 0 and r["replays"] >= r["runs"] >= NEW_TOKENS - 1, table
        grew = r["mem"] - rows[i - 1]["mem"]
        assert grew <= (FIRST_REPLAY if i in FIRST_REPLAYS else SLACK), table  # no growth
    for i in NEW_CACHES[1:]:  # growing the cache costs the difference: the old one freed
        grown = rows[i]["cache_bytes"] - rows[i - 1]["cache_bytes"]
        held = FIRST_REPLAY if i - 1 in REUSING else 0  # the replays' extra, given back
        assert rows[i]["mem"] - rows[i - 1]["mem"] <= grown + SLACK + held, table


@pytest.mark.gpu
@CUDA
def test_compiled_speculative_decoding_replays_cuda_graphs_without_recompiling(tiny_pair,
                                                                              monkeypatch):
    eager = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cuda")
    fast = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"], device="cuda",
                                   compile=True, capacity=256)
    knobs = {"method": "chain", "gamma": 3, "max_new_tokens": 24}
    want = [eager.generate(prompt_ids=prompt(n), **knobs).token_ids for n in LENGTHS]
    counts = GraphCounts(monkeypatch)
    passes = []
    for _ in range(3):  # compile + warm up, record, then the steady state
        before, t0 = counts.now(), time.perf_counter()
        got = [fast.generate(prompt_ids=prompt(n), **knobs).token_ids for n in LENGTHS]
        passes.append({**counts.since(before), "s": round(time.perf_counter() - t0, 2)})
        assert got == want, passes
    print("\n" + "\n".join(map(str, passes)))
    assert len(fast._fast) == 2  # one static cache for the target, one for the draft
    # (the first pass may reuse graphs compiled for equal shapes earlier in the session)
    assert all(p["graphs"] == 0 and p["frames"] == 0 for p in passes[1:]), passes
    assert all(p["skips"] == 0 for p in passes), passes
    last = passes[-1]
    assert last["records"] == 0 and last["replays"] >= last["runs"] > 0, passes


@pytest.mark.gpu
@CUDA
def test_compiled_eagle_reads_the_targets_features_from_the_graph(tiny_pair, tmp_path,
                                                                  monkeypatch):
    """EAGLE-3 (three layers' features, fused in a sync, the drafter's own in tree
    steps: two feature widths) on the compiled fast path: the target's captured step
    returns the features beside the logits, the drafter has a fast path of its own, the
    tokens are the eager engine's, and after a warm-up pass the same calls compile
    nothing, record no CUDA graph and replay one per forward. (EAGLE-1 and Medusa on the
    static layout: tests/unit/test_eagle3.py, tests/unit/test_medusa.py.)"""
    from speclab.families.eagle.drafter import EagleConfig
    from speclab.families.eagle.model import save_eagle
    from speclab.families.eagle.model3 import Eagle3Model
    from speclab.models.loading import load_model

    torch.manual_seed(0)
    target = load_model(tiny_pair["target"])
    folders = [save_eagle(Eagle3Model.from_target(target).float(), tmp_path / "e3")]
    eager = Decoder.from_pretrained(tiny_pair["target"], device="cuda")
    for folder in folders:
        fast = Decoder.from_pretrained(tiny_pair["target"], device="cuda", compile=True,
                                       capacity=256)
        cfg = EagleConfig(eagle_model=str(folder), depth=3, nodes=8)
        knobs = {"method": cfg, "max_new_tokens": 24}
        want = [eager.generate(prompt_ids=prompt(n), **knobs).token_ids for n in LENGTHS]
        counts = GraphCounts(monkeypatch)
        passes = []
        for _ in range(3):  # compile + warm up, record, then the steady state
            before = counts.now()
            got = [fast.generate(prompt_ids=prompt(n), **knobs).token_ids for n in LENGTHS]
            passes.append(counts.since(before))
            assert got == want, (folder.name, passes)
        print(f"\n{folder.name}: " + "\n".join(map(str, passes)))
        assert len(fast._fast) == 2  # the target's static cache and the drafter's
        assert all(p["graphs"] == 0 and p["frames"] == 0 for p in passes[1:]), passes
        assert all(p["skips"] == 0 for p in passes), passes
        last = passes[-1]
        assert last["records"] == 0 and last["replays"] >= last["runs"] > 0, passes


# ---------------------------------------------------------------- without a GPU
def test_the_sweep_without_compiling(tiny_pair, monkeypatch):
    """:func:`sweep` and :class:`GraphCounts` on the CPU, the static layout uncompiled:
    the capacities the CUDA test expects, one cache, every forward counted and nothing
    compiled or recorded."""
    import speclab.api as api

    monkeypatch.setattr(api, "FastPath", functools.partial(FastPath, compile=False))
    dec = Decoder.from_pretrained(tiny_pair["target"], compile=True)
    rows = sweep(dec, GraphCounts(monkeypatch))
    assert [r["capacity"] for r in rows] == [[c] for c in CAPACITIES]
    assert [r["caches"] for r in rows] == [1] * len(LENGTHS)
    per_slot = rows[0]["cache_bytes"] // CAPACITIES[0]
    assert [r["cache_bytes"] for r in rows] == [c * per_slot for c in CAPACITIES]
    for r in rows:  # (tokens equal the eager engine's: tests/unit/test_batch_engine.py)
        assert len(r["tokens"]) == NEW_TOKENS and r["runs"] >= NEW_TOKENS - 1
        assert r["graphs"] == r["records"] == r["replays"] == r["skips"] == 0


def test_a_replaced_static_cache_is_freed_without_the_cyclic_gc(tiny_pair, monkeypatch):
    import speclab.api as api

    monkeypatch.setattr(api, "FastPath", functools.partial(FastPath, compile=False))
    dec = Decoder.from_pretrained(tiny_pair["target"], compile=True)
    dec.generate(prompt_ids=prompt(5), method="ar", max_new_tokens=4)
    old = weakref.ref(next(iter(dec._fast.values())).keys[0])
    gc.collect()
    gc.disable()
    try:  # a longer prompt: the cache is replaced by a bigger one
        dec.generate(prompt_ids=prompt(140), method="ar", max_new_tokens=4)
        assert [f.capacity for f in dec._fast.values()] == [256]
        still_held = old() is not None
        assert not still_held, "the replaced static cache is still allocated"
    finally:
        gc.enable()
