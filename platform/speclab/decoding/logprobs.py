"""Log-probabilities of tokens under the target's own distribution (what OpenAI's
``logprobs`` / ``top_logprobs`` / ``echo`` report).

They are read from the logits the target computes anyway: the verify forward's row at
each node of the accepted path gives the distribution of the token committed after it
(an accepted draft or the bonus), the prefill's rows those of the prompt's tokens. They
are the target's RAW distribution (``log_softmax`` of its logits in float32, before
temperature and top-k/top-p), as vLLM reports by default, so they do not depend on the
sampling settings or on the draft: at temperature 0 they equal plain decoding's.

An entry is ``[token, logprob, [[id, logprob], ...]]`` (the ``top`` best tokens, best
first): plain lists, so a round's entries travel between deployments as they are.
"""

from __future__ import annotations

import torch

from speclab.decoding.host import fetch, to_device

#: the most alternatives a request may ask for per token (OpenAI and vLLM: 20)
MAX_TOP_LOGPROBS = 20

TokenLogprob = list  # [token id, logprob, [[id, logprob], ...]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Entries for ``tokens[i]`` under ``logits[i]``.

    Args:
        logits: ``[n, V]`` target logits; row ``i`` is the distribution ``tokens[i]``
            was drawn from.
        tokens: the ``n`` tokens.
        top: alternatives per token (0: none), at most :data:`MAX_TOP_LOGPROBS`.
    Returns:
        ``n`` entries ``[token, logprob, [[id, logprob] * top]]``.
    """
    return logprob_entries(tokens, *fetch(*logprob_inputs(logits, tokens, top)))


def logprob_inputs(logits: torch.Tensor, tokens: list[int], top: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs`'s device half: the chosen tokens' log-probs ``[n]`` and the
    ``top`` best log-probs and ids ``[n, top]``, on the logits' device."""
    if logits.shape[0] != len(tokens):
        raise ValueError(f"logits: {logits.shape[0]} rows for {len(tokens)} tokens")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs: at most {MAX_TOP_LOGPROBS} alternatives, got {top}")
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    index = to_device(torch.tensor(tokens, dtype=torch.long), lp.device)
    chosen = lp.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    values, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
    return chosen, values, ids


def logprob_entries(tokens: list[int], chosen: torch.Tensor, values: torch.Tensor,
                    ids: torch.Tensor) -> list[TokenLogprob]:
    """:func:`token_logprobs`'s host half, over :func:`logprob_inputs` on the host."""
    alts = [[[int(i), float(v)] for i, v in zip(ri, rv, strict=True)]
            for ri, rv in zip(ids.tolist(), values.tolist(), strict=True)]
    return [[int(t), float(c), a] for t, c, a in zip(tokens, chosen.tolist(), alts, strict=True)]


def prompt_logprobs(logits: torch.Tensor | None, prompt_ids: list[int], top: int
                    ) -> list[TokenLogprob | None]:
    """Entries for a prompt's tokens (``echo``): None for the first token (nothing
    predicts it), then ``prompt_ids[i+1]`` under the prefill's ``logits[i]``.

    Args:
        logits: ``[P-1, V]`` prefill logits (row ``i`` follows ``prompt_ids[:i+1]``);
            None for a 1-token prompt.
        prompt_ids: the ``P`` prompt tokens.
        top: alternatives per token (0: none).
    Returns:
        ``P`` entries, the first None.
    """
    rest = token_logprobs(logits, list(prompt_ids[1:]), top) if logits is not None else []
    return [None, *rest]
