"""Drafters propose a TokenTree from the committed context; one module per method, each
with its typed config (see :mod:`speclab.drafters.registry`).

Methods (the 11 built-ins of ``BUILTIN`` in :mod:`speclab.drafters.registry`): ``ar``
(the empty drafter), ``chain`` (Leviathan, fixed gamma), ``tree`` (EAGLE-2 dynamic beam
tree), ``optimal`` (optimal tree search, SALF Algorithm 2 without stopping), ``salf``
(Algorithm 2 with stopping at low further gains), ``specdecpp`` (adaptive chain length
from an acceptance head), ``pld`` (prompt lookup), ``rest`` (datastore retrieval),
``aasd`` (PLD + alignment sampling + conditional verification), ``eagle`` (EAGLE feature
drafter over the target's features, EAGLE-2 or optimal / SALF trees), ``medusa`` (Medusa
heads on the target's last feature filling a tree template). More can be registered at
run time (:func:`speclab.config.method.register`).
"""

from speclab.drafters.base import Drafter, ModelDrafter
from speclab.drafters.chain import ChainDrafter
from speclab.drafters.eagle2 import Eagle2TreeDrafter, build_eagle2_tree
from speclab.drafters.optimal import OptimalTreeDrafter, build_optimal_tree

__all__ = [
    "ChainDrafter",
    "Drafter",
    "Eagle2TreeDrafter",
    "ModelDrafter",
    "OptimalTreeDrafter",
    "build_eagle2_tree",
    "build_optimal_tree",
]
