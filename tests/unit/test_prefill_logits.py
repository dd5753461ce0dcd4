"""A prefill computes logits only where they are read: the LM head of the target (and
of the draft) never sees the whole prompt unless a drafter reads the prompt's top tokens
(AASD) or a request echoes its prompt's log-probs. A 2048-token prompt at V = 65,536 used
to materialise 2048 x 65,536 float32 logits (537 MB) to throw them away."""

from __future__ import annotations

import torch

from speclab.api import Decoder
from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.row_pool import NewRow, TargetPool, seeded
from speclab.decoding.rules import RuleSpec
from speclab.decoding.sampling import SamplingParams

PROMPT = [(7 * i) % 60 + 2 for i in range(120)]


def _watch(model) -> list[int]:
    """Positions per LM head call of ``model``."""
    seen: list[int] = []
    model.get_output_embeddings().register_forward_pre_hook(
        lambda _m, args: seen.append(int(args[0].shape[-2])))
    return seen


def test_prefill_computes_no_prompt_logits_unless_they_are_read(tiny_pair):
    dec = Decoder.from_pretrained(tiny_pair["target"], tiny_pair["close"])
    target, draft = _watch(dec.target.model), _watch(dec.draft.model)
    for method, knobs in (("ar", {}), ("chain", {"gamma": 3}), ("salf", {"nodes": 8})):
        target.clear()
        draft.clear()
        want = dec.generate(prompt_ids=PROMPT, method="ar", max_new_tokens=12).token_ids
        single = dec.generate(prompt_ids=PROMPT, method=method, max_new_tokens=12, **knobs)
        batched = dec.generate(prompts=[PROMPT, PROMPT[:40]], method=method,
                               max_new_tokens=12, **knobs)
        assert single.token_ids == want and batched[0].token_ids == want
        assert max(target) <= 16 and max(draft, default=0) <= 16, (method, target, draft)
    target.clear()
    dec.generate(prompt_ids=PROMPT, method="aasd", max_new_tokens=4)  # reads prompt top-k
    assert max(target) == len(PROMPT) - 1


def test_an_echo_row_gets_its_prompt_logits_and_the_others_none(tiny_pair):
    dec = Decoder.from_pretrained(tiny_pair["target"])
    pool = TargetPool(BatchRunner(dec.target.model))
    seen = _watch(dec.target.model)
    rows = [NewRow("a", PROMPT, SamplingParams(), RuleSpec("greedy"), seeded(0))]
    assert pool.start(rows)[0].prompt_logprobs is None and max(seen) == 1
    rows = [NewRow("b", PROMPT, SamplingParams(), RuleSpec("greedy"), seeded(0), logprobs=0,
                   echo=True)]
    echo = pool.start(rows)[0].prompt_logprobs
    assert len(echo) == len(PROMPT) and max(seen) == len(PROMPT) - 1
    with torch.no_grad():
        ref = torch.log_softmax(dec.target.model(torch.tensor([PROMPT])).logits[0], -1)
    assert abs(echo[5][1] - float(ref[4, PROMPT[5]])) < 1e-4
