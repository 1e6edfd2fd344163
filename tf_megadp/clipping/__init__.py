"""Per-example clipping strategies behind one interface.

`get_clipping_strategy(name)` maps the `clipping=` argument of `DPOptimizer`
to a strategy object.
"""

from tf_megadp.clipping import independence
from tf_megadp.clipping.base import ClippedBatch, ClippingStrategy
from tf_megadp.clipping.auto import AutoClipping
from tf_megadp.clipping.ghost import GhostClipping
from tf_megadp.clipping.rules import Rule, register_ghost_rule, unregister_ghost_rule
from tf_megadp.clipping.terms import Explicit, Gather, Outer, Term
from tf_megadp.clipping.vectorized import VectorizedClipping

__all__ = [
    "AutoClipping",
    "ClippedBatch",
    "ClippingStrategy",
    "Explicit",
    "Gather",
    "GhostClipping",
    "Outer",
    "Rule",
    "Term",
    "VectorizedClipping",
    "get_clipping_strategy",
    "independence",
    "register_ghost_rule",
    "unregister_ghost_rule",
]

_STRATEGIES = {
    "vectorized": VectorizedClipping,
    "ghost": GhostClipping,
    "auto": AutoClipping,
}


def get_clipping_strategy(name: str) -> ClippingStrategy:
    """Returns a new strategy for `name` ('vectorized', 'ghost' or 'auto')."""
    try:
        return _STRATEGIES[name]()
    except KeyError:
        raise ValueError(
            f"Unknown clipping={name!r}; choose one of {sorted(_STRATEGIES)}."
        ) from None
