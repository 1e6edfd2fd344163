"""A holder for values that must stay in memory: out of `vars()`, reprs, pickles and copies.

The DP guarantee holds only while some values stay secret (the sampling
secret, keys of in-step randomness). Keeping them in a private attribute is
not enough: `vars(obj)`, `obj.__dict__` and `repr(vars(obj))` show private
attributes too, and experiment trackers and debuggers print exactly those.
A `Secret` has no `__dict__` (its one slot is not listed by `vars`), prints
as `<secret>`, and refuses to be pickled or copied.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Secret"]


class Secret:
    """Holds one value that no `vars()`, `repr`, pickle or copy shows.

    Args:
        value: the secret (e.g. 128 bits of OS entropy).

    Example:
    ```python
    secret = Secret(secrets.randbits(128))
    rng = np.random.default_rng(secret.value)
    repr(secret)   # '<secret>'
    vars(secret)   # TypeError: no __dict__
    ```
    """

    __slots__ = ("_value",)

    def __init__(self, value: Any):
        object.__setattr__(self, "_value", value)

    @property
    def value(self) -> Any:
        """The secret itself: pass it on, never log or store it."""
        return self._value

    def __setattr__(self, name, value):
        raise AttributeError("A Secret cannot be changed; create a new one.")

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__

    def __reduce_ex__(self, protocol):
        # Pickling writes the value out; copy and deepcopy go through here too.
        raise TypeError("A Secret cannot be pickled or copied: it must stay in memory.")
