"""The ghost rules, one module per layer family, and the plan of a model's rules.

Importing this package registers the built-in rules for Keras layers (dense,
einsum, embedding, normalization, convolution, LoRA). The keras-hub rules
(`ghost_rules.keras_hub`) are registered when a model is planned while
keras-hub is loaded, so that `import tf_megadp` never imports keras-hub.
A new layer is one `Rule` subclass in the module of its family, registered
with `rules.builtin_rule` (user code: `register_ghost_rule`), plus a row of
`tests/test_clipping_matrix.py`.
"""

from __future__ import annotations

import importlib
import sys

import keras

from tf_megadp import _keras_compat
from tf_megadp.clipping.ghost_rules import (convolution, dense, einsum, embedding, lora,
                                            normalization)
from tf_megadp.clipping.ghost_rules.fallback import fallback_rule
from tf_megadp.clipping.rules import SMALL_LAYERS, Rule, rule_for
from tf_megadp.errors import GhostClippingUnsupportedError

__all__ = ["convolution", "dense", "einsum", "embedding", "lora", "normalization",
           "plan_rules"]

# Rule modules for optional libraries: loaded once their library is.
_OPTIONAL = {"keras_hub": "tf_megadp.clipping.ghost_rules.keras_hub"}


def _load_optional_rules():
    # A model made of keras-hub layers has imported keras-hub already; one
    # that has not cannot contain them, so nothing is imported needlessly.
    for library, module in _OPTIONAL.items():
        if library in sys.modules:
            importlib.import_module(module)


def plan_rules(model: keras.Model, fallback: str) -> list[Rule]:
    """Assigns a rule to every layer that owns trainable variables.

    Args:
        model: a built model.
        fallback: "small" (layers without a ghost rule must be in
            `rules.SMALL_LAYERS`) or "any" (every such layer gets the exact
            per-layer fallback).

    Returns:
        The rules, one per intercepted layer. A layer none of whose
        variables the model trains (frozen) gets none.

    Raises:
        PrivacyConfigurationError: a layer has no rule under `fallback`, or a
            trainable variable is owned by no intercepted layer.
    """
    _load_optional_rules()
    rules, seen = [], set()
    unsupported = []
    # Only the model's trainable variables are clipped, noised and counted in
    # the norms: a frozen layer (a LoRA base model, a frozen backbone) needs
    # no rule, and its reads need no accounting.
    trainable = {id(v) for v in model.trainable_variables}
    trains = lambda variables: any(id(v) in trainable for v in variables)  # noqa: E731

    def visit(layer):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        rule = rule_for(layer)
        if rule is None and trains(_keras_compat.own_trainable_variables(layer)):
            if fallback == "any" or isinstance(layer, tuple(SMALL_LAYERS)):
                rule = fallback_rule(layer)
            else:
                unsupported.append(f"'{layer.name}' ({type(layer).__name__})")
        if rule is not None and not trains(rule.variables):
            rule = None
        if rule is not None:
            rules.append(rule)
            if rule.covers_sublayers:
                return
        for child in _keras_compat.child_layers(layer):
            visit(child)

    visit(model)
    if unsupported:
        raise GhostClippingUnsupportedError(
            "clipping='ghost' has no ghost-norm rule for layer(s) "
            f"{', '.join(unsupported)}. Use clipping='auto' (exact per-example "
            "gradients for those layers, ghost norms for the rest) or "
            "clipping='vectorized'."
        )
    covered = {id(v) for rule in rules for v in rule.variables}
    missing = [v.path for v in model.trainable_variables if id(v) not in covered]
    if missing:
        raise GhostClippingUnsupportedError(
            f"Trainable variables {missing} belong to no layer that ghost "
            "clipping can intercept. Use clipping='vectorized'."
        )
    return rules
