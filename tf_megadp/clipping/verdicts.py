"""When a private `fit` keeps the independence verdicts of the last one.

The full independence check (`independence`: forward, then the per-example
gradient norms) runs on the first call of each compiled step of the ghost
and auto strategies: each traced call site has its own flag, which only a
passed check sets (`ghost._CheckedSignatures`). Before issue 42 the private
`fit` cleared every flag at its start, so each `fit` paid a full check
(+1.5 steps at BERT-mini, m = 256), also when it only continued the last one
on the same data: a loop of `fit(epochs=1)` calls paid it every epoch, and
one `fit(epochs=E)` once.

Whether a compiled step mixes examples can change between two fits only
through what the step reads when it runs, or through a new trace:

- a new trace (a recompile, a new input signature, `make_private` again, a
  new model or optimizer) calls the strategy again at trace time, which
  gives the call site a new, unchecked flag: Python-level changes to the
  model (a layer swapped, a `call` replaced, a `Dropout` rate) reach the
  compiled step only that way;
- the variables the step reads (weights, non-trainable state, a variable
  a `Lambda` closes over): set from outside (`set_weights`,
  `load_weights`, an assignment, a non-private model sharing a layer);
- the data: mixing that depends on the data shows on new data.

So a fit keeps the flags only when all of this is what the last fit left
(`FitVerdicts`): the model's layers (their identity, class, `call` and
plain attributes), a digest of every variable the strategy's traced
functions read, compared with its value when the last fit *ended* (the
private steps in between change weights legitimately; nothing else may),
and the same data (`tf_megadp.data.fit_inputs.data_identity`: arrays of
the same content and batch size, or the same dataset object). Two such
fits are then checked like one fit of two epochs: the secret random
forward rechecks (`RECHECK_PROBABILITY`) run on every step of both. A
traced function that reads what no digest covers (a resource that is not
a variable, such as a lookup table; a Python function through
`tf.py_function`) keeps nothing: every fit checks again.
"""

from __future__ import annotations

import hashlib
import re
import types
import weakref
from typing import NamedTuple

import keras
import numpy as np

from tf_megadp import _keras_compat

__all__ = ["FitVerdicts", "state_digest", "structure_digest"]

# Graph ops that run Python when the step runs: what they do is not in any digest.
_PYTHON_OPS = frozenset({"EagerPyFunc", "PyFunc", "PyFuncStateless"})
_PLAIN = (bool, int, float, str, type(None))
# What Keras's fit, evaluate and predict loops set on a model as they run
# (`test_function`, `stop_evaluating`, ...): not how the model computes.
_LOOP_STATE = re.compile(r"\w*_function|stop_\w+")


class _Context(NamedTuple):
    """What the verdicts of a fit stand for (digests only; None: never equal)."""

    structure: bytes
    state: bytes | None
    data: bytes | None


class FitVerdicts:
    """Decides, for one model and strategy, whether a fit keeps the last fit's verdicts.

    `begin` at the start of every private fit, `end` when it returned. A
    fit that raised (or was interrupted) leaves no record, so the next one
    checks again. Plain holder: never saved, and its digests are never
    shown (they cover the in-memory randomness key among the variables).

    Example:
    ```python
    verdicts = FitVerdicts()
    if not verdicts.begin(model, functions, data_identity(arguments)):
        strategy.reset_checks(model)
    model.fit(...)
    verdicts.end(model, functions)
    ```
    """

    def __init__(self):
        self._ended: _Context | None = None
        self._data: bytes | None = None
        # Per concrete function: whether the variable digest covers what it reads.
        self._covered = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"<FitVerdicts: {'a fit ended' if self._ended else 'no fit ended'}>"

    def begin(self, model, functions, data: bytes | None) -> bool:
        """Whether this fit keeps the verdicts (nothing that can change mixing changed).

        Args:
            model: the private model.
            functions: the strategy's `tf.function`s for `model` (those it
                traced the model's passes in).
            data: `data_identity` of what this fit reads (None: unknown).

        Returns:
            True when the last fit ended normally and the model's structure,
            the state its traced functions read and the data are the ones
            it ended with; the caller resets the checks otherwise.
        """
        ended, self._ended, self._data = self._ended, None, data
        if ended is None or ended.state is None or data is None or data != ended.data:
            return False
        if structure_digest(model) != ended.structure:
            return False
        return state_digest(model, functions, self._covered) == ended.state

    def end(self, model, functions) -> None:
        """Records what the verdicts stand for, now that the fit returned."""
        self._ended = _Context(structure_digest(model),
                               state_digest(model, functions, self._covered), self._data)

    def forget(self) -> None:
        """The next fit keeps nothing (`reset_checks` was called from elsewhere)."""
        self._ended = None


def structure_digest(model) -> bytes:
    """A digest of the model's layers as Python sees them.

    Per layer (the model included): its identity and class, its `call`
    (the class's, or one set on the instance), its plain attributes (bool,
    int, float, str, None: a `Dropout` rate, `trainable`), the Python
    functions it holds (a `Lambda`'s function, an activation), and its
    weights' paths, shapes and dtypes. Such changes reach a compiled step
    only through a new trace, which is checked anyway; the digest makes a
    fit after any of them check again regardless.
    """
    digest = hashlib.blake2b(digest_size=16)
    for layer in _keras_compat.flatten_layers(model):
        kind = type(layer)
        digest.update(f"{id(layer)} {kind.__module__}.{kind.__qualname__}".encode())
        call = vars(layer).get("call", kind.call)
        digest.update(_function_digest(call))
        for name, value in sorted(vars(layer).items()):
            if _LOOP_STATE.fullmatch(name):
                continue
            if isinstance(value, _PLAIN):
                digest.update(f"{name}={value!r};".encode())
            elif isinstance(value, (types.FunctionType, types.MethodType)):
                digest.update(name.encode() + _function_digest(value))
        for weight in layer.weights:
            digest.update(f"{id(weight)} {weight.path} {tuple(weight.shape)} "
                          f"{weight.dtype};".encode())
    return digest.digest()


def _function_digest(function) -> bytes:
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    body = b"" if code is None else code.co_code + repr(code.co_consts).encode()
    name = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"
    return f"{id(function)} {name}".encode() + hashlib.blake2b(body, digest_size=8).digest()


def state_digest(model, functions, covered=None) -> bytes | None:
    """A digest of every variable the traced `functions` read (exact values), or None.

    The model's weights and every other variable its passes read (a
    seed-generator state, a variable a `Lambda` closes over, the in-memory
    randomness key), each once. None when a traced function reads what no
    digest covers: a captured resource that is not a variable (a lookup
    table, a variable read through its raw handle) or a Python function
    (`tf.py_function`, `tf.numpy_function`).

    Args:
        model: the private model.
        functions: the `tf.function`s the strategy traced its passes in.
        covered: a `weakref.WeakKeyDictionary` that keeps, per concrete
            function, whether it reads only variables (read once per trace).
    """
    covered = weakref.WeakKeyDictionary() if covered is None else covered
    digest = hashlib.blake2b(digest_size=16)
    seen = set()
    for function in functions:
        for concrete in _keras_compat.concrete_functions(function):
            variables = [v for v in concrete.variables if v is not None]
            if concrete not in covered:
                covered[concrete] = _reads_only_variables(concrete, variables)
            if not covered[concrete]:
                return None
            for variable in variables:
                if id(variable) in seen:
                    continue
                seen.add(id(variable))
                value = np.ascontiguousarray(keras.ops.convert_to_numpy(variable))
                digest.update(f"{variable.name} {value.dtype} {value.shape};".encode())
                digest.update(value.tobytes())
    for weight in model.weights:  # Also those no trace reads (yet).
        if id(weight.value) in seen:
            continue
        digest.update(f"{weight.path} {weight.dtype};".encode())
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(weight)).tobytes())
    return digest.digest()


def _reads_only_variables(concrete, variables) -> bool:
    """Whether every resource `concrete` captures is one of `variables`, and it runs no Python."""
    try:
        handles = {id(variable.handle) for variable in variables}
    except (AttributeError, ValueError):  # A variable without one handle (distributed).
        return False
    if any(capture.dtype.name == "resource" and id(capture) not in handles
           for capture in concrete.captured_inputs):
        return False
    graph = concrete.graph.as_graph_def()
    ops = {node.op for node in graph.node}
    for library_function in graph.library.function:
        ops.update(node.op for node in library_function.node_def)
    return not ops & _PYTHON_OPS
