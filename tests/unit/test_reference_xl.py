"""``reference-xl`` grown on the host from a tiny stand-in for the reference pair (the
real 5.45B model is only ever grown on a GPU): the grown target and drafter compute the
small ones' function, the checksum the host computes tensor by tensor is the one the
build finds, and a wrong expectation is reported, not hidden."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speclab.reference_large import forward_cost
from speclab.reference_xl import (
    XLSpec,
    checksum_key,
    expected_checksums,
    grow_reference_xl,
    tensor_checksum,
    weights_checksum,
)


def build_fake_reference_home(home: Path) -> dict[str, str]:
    """``$SPECLAB_HOME/models/reference-<hash>/`` holding a tiny pair under the reference
    pair's name (so :func:`~speclab.models.reference.ensure_reference_pair` finds it
    instead of training the real one): a 2-layer LLaMA target with a byte-level BPE
    tokenizer, a 1-layer draft and an EAGLE drafter for the target."""
    from speclab.data.corpus import read_text, split_files
    from speclab.families.eagle.model import EagleModel, save_eagle
    from speclab.models.reference import ReferenceSpec
    from speclab.models.tiny import build_tiny_llama
    from speclab.models.tokenizer import train_bpe_tokenizer

    folder = home / "models" / f"reference-{ReferenceSpec().digest()}"
    tok = train_bpe_tokenizer([read_text(split_files("train"), 20_000)], 300, folder / "target")
    tok.save_pretrained(folder / "draft")
    sizes = {"vocab_size": len(tok), "hidden_size": 32, "num_heads": 4}
    build_tiny_llama(folder / "target", seed=1, num_layers=2, **sizes)
    build_tiny_llama(folder / "draft", seed=2, num_layers=1, **sizes)
    (folder / "reference.json").write_text(json.dumps({"stand_in": "tests"}))
    from speclab.models.loading import load_model

    torch.manual_seed(3)
    eagle = EagleModel.from_target(load_model(str(folder / "target")))
    save_eagle(eagle, home / "drafters" / "eagle-tiny")
    return {"target": str(folder / "target"), "draft": str(folder / "draft"),
            "eagle": str(home / "drafters" / "eagle-tiny")}


@pytest.fixture(scope="module")
def fake_home(tmp_path_factory) -> dict[str, str]:
    return build_fake_reference_home(tmp_path_factory.mktemp("xl-home"))


def test_the_checksum_is_exact_and_sees_one_bit():
    t = torch.randn(1000, 7).to(torch.bfloat16)
    assert tensor_checksum(t) == tensor_checksum(t.clone())
    flipped = t.clone()
    flipped.view(torch.int16)[123, 4] ^= 1  # the lowest mantissa bit of one element
    assert tensor_checksum(flipped) != tensor_checksum(t)
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same values in another order
    assert tensor_checksum(swapped) != tensor_checksum(t)
    assert weights_checksum(iter([("a", t)])) != weights_checksum(iter([("b", t)]))


def test_a_spec_is_parsed_and_a_bad_one_names_the_flag():
    assert XLSpec.parse("24x16") == XLSpec(24, 16)
    with pytest.raises(ValueError, match="--xl"):
        XLSpec.parse("24")
    with pytest.raises(ValueError, match="widen and depth"):
        XLSpec(0, 4)


def test_reference_xl_computes_the_small_pairs_function_and_its_checksums_match(fake_home):
    spec = XLSpec(3, 5)
    expected = expected_checksums(fake_home["target"], [fake_home["eagle"]], spec, "float32")
    xl = grow_reference_xl(fake_home["target"], fake_home["draft"], [fake_home["eagle"]],
                           spec, "cpu", "float32", expected, log=lambda _m: None)
    meta = xl.meta
    assert meta["hidden"] == 96 and meta["layers"] == 5 and meta["heads"] == 12
    assert {c["match"] for c in meta["checksums"].values()} == {True}
    check = meta["function_check"]
    assert check["target_greedy_agreement"] == 1.0
    assert check["target_logits_max_abs_diff"] < 1e-3
    assert check["eagle-tiny_greedy_agreement"] == 1.0
    # a checksum the build does not find is reported as a mismatch
    wrong = {**expected, "target": "0" * 16}
    again = grow_reference_xl(fake_home["target"], fake_home["draft"], [], spec, "cpu",
                              "float32", wrong, log=lambda _m: None)
    assert again.meta["checksums"]["target"]["match"] is False
    assert checksum_key(spec, "float32") == "3x5-float32"
    cost = forward_cost(xl.target, list(range(40)), prefix=16, repeats=2, tokens=(1, 4),
                        eagle=xl.drafters["eagle-tiny"], draft=xl.draft)
    assert set(cost["target_ms"]) == {"1", "4"} and cost["eagle_vs_target"] > 0
    assert cost["draft_vs_target"] > 0 and cost["params"] == meta["params"]
