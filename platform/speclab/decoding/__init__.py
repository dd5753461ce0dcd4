"""Speculative decoding engine: pure PyTorch (+ transformers models), no Ray, no MLflow.

Conventions used everywhere in this package:

* ``p`` is the TARGET distribution, ``q`` the DRAFT distribution (Leviathan et al.,
  AtSpeed). transformers uses the opposite letters internally; they never leak here.
* A round is: a drafter proposes a :class:`~speclab.decoding.tree.TokenTree` rooted at the
  last committed token that the target has not processed yet (node 0, the *root*);
  the target scores every node in ONE forward with tree attention; a verification
  rule (:mod:`speclab.decoding.rules`) picks the accepted root-to-node path plus one
  corrected/bonus token; both KV caches keep only the accepted path (a gather).
* The target's logits at node ``i`` are its distribution over the children of ``i``.
* "Lossless": at temperature 0 the output equals the target's greedy decoding; at
  temperature > 0 (with identical top-k/top-p warping of ``p`` and ``q``) the output
  distribution equals the target's. Relaxed rules (typical acceptance) say so.

Modules: ``sampling`` (warping), ``tree`` (TokenTree, masks, positions), ``rules/``
(verification rules: a registry of pure functions with their parameter models),
``runner`` (a model plus its KV cache), ``drafter`` (the one-sequence drafter interface),
``sides`` (the draft side and the target side of one sequence's round), ``drafting``
(the drafting interfaces, a method's traits, the tree builders' step protocol), ``loop``
(THE draft -> verify -> commit loop, written once, its stats and the single-sequence
driver), ``batch_runner`` (many rows in one cache), ``row_pool`` (the batched target and
draft sides, rows by id), ``batch_loop`` (the batched driver: one loop per row in
lockstep, ragged trees in one target forward, continuous batching), ``static_runner``
(the opt-in static-cache, compiled fast path), ``beam_levels`` / ``beam_loop`` /
``beam`` / ``trie`` (AtSpeed beam SD: a round's halves, the round loop, the searches),
``acceptance_head`` (SpecDec++), ``datastore`` (REST suffix arrays). The methods'
drafters implement ``drafting``'s interfaces in the package above this one; nothing here
imports them.
"""
