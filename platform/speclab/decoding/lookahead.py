"""Drafting the next round while the target verifies this one (overlapped rounds).

A drafter that waits for the verdict before drafting the next tree leaves the draft
device idle while the target verifies, and the target idle while the draft drafts. Once
round ``r``'s tree is on its way to the target, the draft side can instead GUESS the
verdict and draft round ``r+1`` at once: it assumes the tree's most likely path
(:func:`guess_path`: from the root, the most probable child at every level, so a
chain's whole length) is accepted and drafts a tree ROOTED AT THAT PATH'S LAST TOKEN with
one level more than the next round may use. The bonus token the target will add is then
one of that tree's first-level children when the drafter's guesses cover it (a tree
drafter guesses several), and round ``r+1``'s tree is the subtree under it
(:func:`subtree`). A verdict that took another path or another bonus is a miss: the
drafter forgets what it drafted ahead (``BatchDrafter.rewind``) and drafts as usual.

A feature drafter (EAGLE) drafts ahead on its own predicted features of the guessed
path (the target's arrive with the verdict); after a hit its state holds those stand-ins,
so at its next real draft it rewinds to where it last drafted on the target's features
and takes the committed tokens since then with the target's features (``sync_at``).

The target verifies every tree it receives, so the output does not depend on hits and
misses: at temperature 0 it equals plain decoding exactly. Drafting ahead is done for
greedy drafting only: a sampled request's single random generator travels with its
round to the target (whose rule draws from it), so it cannot draw the next round's
draft at the same time without correlating the draft with the verification.

:class:`RowAhead` is one request's state: the translation between the trees the target
sees (subtrees) and the drafter's own trees (rooted one guessed path earlier), the tree
drafted ahead, and the hit statistics that switch drafting ahead off for a request where
it loses time (:meth:`RowAhead.worth_it`). :class:`~speclab.decoding.row_pool.DraftPool`
drives it; :class:`AheadTrial` decides, by measuring in turns, whether a replica drafts
ahead at all. Nothing here runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speclab.decoding.tree import TokenTree


def guess_path(tree: TokenTree) -> list[int]:
    """The verdict a tree most likely gets, as a node path (root first): from the root,
    the child with the highest draft probability (``q_prob``; the first on ties) at
    every level down to a leaf. A chain's is the whole chain."""
    path = [0]
    while tree.children[path[-1]]:
        kids = tree.children[path[-1]]
        path.append(max(kids, key=lambda c: (tree.q_prob[c], -c)))
    return path


def subtree(tree: TokenTree, node: int, max_depth: int) -> tuple[TokenTree, list[int]]:
    """The part of ``tree`` under ``node`` (included, as the new root) down to
    ``max_depth`` levels below it, in ``tree``'s node order, with each node's draft
    probability and how its children were drafted. Returns the tree and, per new node,
    its index in ``tree``."""
    out = TokenTree(tree.tokens[node])
    old = [node]
    new_of = {node: 0}
    for i in range(node + 1, len(tree.tokens)):
        parent = tree.parents[i]
        if parent in new_of and out.depths[new_of[parent]] < max_depth:
            new_of[i] = out.add(tree.tokens[i], new_of[parent], tree.q_prob[i],
                                tree.relaxed[i])
            old.append(i)
    for i, j in new_of.items():
        if i in tree.child_kind and out.children[j]:
            out.set_children_kind(j, tree.child_kind[i], tree.q_dist.get(i))
    return out, old


@dataclass
class Ahead:
    """A round drafted ahead: the sent tree's ``path`` it assumed accepted (nodes, root
    first), the ``tokens`` it told the drafter were committed (the translated path's),
    and the drafter's ``tree`` rooted at the path's last token (None: drafting failed),
    whose first-level children are the bonus tokens it covers."""

    path: list[int]
    tokens: list[int]
    tree: TokenTree | None


@dataclass
class RowAhead:
    """One request's drafting-ahead state; see the module docstring.

    The tree sent to the target may be a subtree of the drafter's own last tree: ``view``
    maps each sent node to the drafter's node, ``prefix_nodes`` are the drafter's nodes
    from its root down to the sent tree's root and ``prefix_tokens`` the tokens the
    drafter has not been told were committed (the bonus the subtree was chosen by).
    ``hits`` / ``rounds``: verdicts that matched / rounds drafted ahead; ``saved_s`` the
    draft time hits saved and ``lost_s`` the drafting ahead that was not hidden behind
    the target's call; ``on`` turns False for good once :meth:`worth_it` says so."""

    committed: int = 0  # tokens the drafter was told are committed (its rewind point)
    budget: int = 0  # levels the sent tree's round could draft
    prefix_nodes: list[int] = field(default_factory=lambda: [0])
    prefix_tokens: list[int] = field(default_factory=list)
    view: list[int] | None = None  # None: the sent tree IS the drafter's last tree
    sent: TokenTree | None = None
    pending: Ahead | None = None
    # a feature drafter's hits drafted on its own features: where its state was last
    # drafted on the target's (its committed count), the tokens committed since and the
    # target's features of them, fed to it at its next real draft (see DraftPool.propose)
    sync_at: int | None = None
    unsynced: list[int] = field(default_factory=list)
    deferred: list = field(default_factory=list)
    hits: int = 0
    rounds: int = 0
    saved_s: float = 0.0
    lost_s: float = 0.0
    on: bool = True

    def translate(self, path: list[int] | None, new: list[int]
                  ) -> tuple[list[int] | None, list[int]]:
        """A verdict on the sent tree (``path`` of its nodes, committed tokens ``new``)
        as the drafter's own tree sees it."""
        if path is None:
            return None, list(self.prefix_tokens) + list(new)
        nodes = [self.view[n] if self.view is not None else n for n in path[1:]]
        return self.prefix_nodes + nodes, list(self.prefix_tokens) + list(new)

    def sent_tree(self, tree: TokenTree | None, budget: int) -> None:
        """``tree`` (the drafter's own, not drafted ahead; ``budget`` levels allowed) goes
        to the target."""
        self.sent, self.view, self.budget = tree, None, budget
        self.prefix_nodes, self.prefix_tokens = [0], []

    def take(self, path: list[int] | None, new: list[int], budget: int
             ) -> TokenTree | None:
        """The verdict on the sent tree arrived and the next round may draft ``budget``
        levels: the tree drafted ahead for it (a subtree of the drafter's tree, which
        becomes the sent tree), or None on a miss (no tree drafted ahead, another path,
        a bonus it did not cover)."""
        ahead, self.pending = self.pending, None
        if ahead is None or path is None or ahead.tree is None or path != ahead.path:
            return None
        node = ahead.tree.find_child(0, new[-1])
        if node < 0 or budget < 1:
            return None
        out, old = subtree(ahead.tree, node, budget)
        self.sent, self.view, self.budget = out, old, budget
        self.prefix_nodes, self.prefix_tokens = [0, node], [int(new[-1])]
        return out

    def plan(self) -> tuple[list[int], list[int], list[int], int] | None:
        """What to draft ahead from the sent tree: its guessed path (sent nodes), that
        path as the drafter's nodes, the tokens to commit on the drafter and the levels
        to draft below the path's end (the bonus level + the next round's budget). None
        when there is nothing to guess (a root-only tree) or no next round to draft."""
        if self.sent is None:
            return None
        path = guess_path(self.sent)
        levels = self.budget - (len(path) - 1)  # the next round's budget, + 1 for the bonus
        if len(path) < 2 or levels < 2:
            return None
        mine, tokens = self.translate(path, [self.sent.tokens[n] for n in path[1:]])
        return path, mine, tokens, levels

    def record(self, hit: bool) -> None:
        """A round that had a tree drafted ahead ended in a hit or a miss."""
        self.rounds += 1
        self.hits += int(hit)

    def charge(self, saved_s: float = 0.0, lost_s: float = 0.0) -> None:
        """Draft time a hit saved, and drafting ahead that delayed a round."""
        self.saved_s += saved_s
        self.lost_s += lost_s

    def worth_it(self, warmup: int, min_hit_rate: float) -> bool:
        """Whether to keep drafting ahead: always for the first ``warmup`` rounds, then
        while the hit rate is at least ``min_hit_rate`` and the time hits saved exceeds
        the drafting ahead that delayed the rounds (``lost_s``)."""
        if self.rounds < warmup:
            return True
        return self.hits >= min_hit_rate * self.rounds and self.saved_s >= self.lost_s


class AheadTrial:
    """Whether a draft replica drafts ahead at all, decided by measuring it: drafting
    ahead runs beside the target's forward, and where the two share a machine (CPU
    cores, caches, memory bandwidth) it can slow the target down by more than the hits
    save. The replica alternates ``block`` batches with drafting ahead and ``block``
    without, compares the tokens committed per second of batch time (drafting + the
    target call), keeps the faster mode for ``hold`` batches, then measures again."""

    def __init__(self, block: int = 32, hold: int = 256) -> None:
        if block < 1 or hold < 0:
            raise ValueError(f"block must be >= 1 and hold >= 0, got {block}, {hold}")
        self.block, self.hold = block, hold
        self.sums = {True: [0, 0.0], False: [0, 0.0]}  # mode -> [tokens, seconds]
        self.counts = {True: 0, False: 0}
        self.chosen: bool | None = None  # the mode held after the last comparison
        self.held = 0
        self.rates: dict[bool, float] = {}  # tokens/s of each mode, last comparison

    def on(self) -> bool:
        """The mode of the next batch."""
        if self.chosen is not None and self.held < self.hold:
            return self.chosen
        return self.counts[True] < self.block  # a block with, then a block without

    def record(self, ahead: bool, tokens: int, seconds: float) -> None:
        """A batch ran in mode ``ahead``, committing ``tokens`` in ``seconds``."""
        if self.chosen is not None and self.held < self.hold:
            self.held += 1
            return
        self.counts[ahead] += 1
        self.sums[ahead][0] += tokens
        self.sums[ahead][1] += seconds
        if min(self.counts.values()) >= self.block:
            self.rates = {m: t / s if s > 0 else 0.0 for m, (t, s) in self.sums.items()}
            self.chosen = self.rates[True] > self.rates[False]
            self.held = 0
            self.sums = {True: [0, 0.0], False: [0, 0.0]}
            self.counts = {True: 0, False: 0}
