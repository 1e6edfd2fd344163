"""Errors raised when a configuration would train with less privacy than reported."""

__all__ = ["GhostClippingUnsupportedError", "PrivacyConfigurationError"]


class PrivacyConfigurationError(ValueError):
    """A setting would silently weaken or void the differential-privacy guarantee.

    The message always names the fix. It subclasses `ValueError` so that code
    catching bad arguments also catches it.
    """

    # TensorFlow's autograph re-raises an error from traced code with its own
    # type only when that type's __init__ is Exception.__init__; otherwise the
    # user sees a generic StagingError. Keep our type visible from inside fit.
    __init__ = Exception.__init__


class GhostClippingUnsupportedError(PrivacyConfigurationError):
    """Ghost clipping cannot attribute part of this model's gradient to examples.

    Raised for what only the per-example gradients of `clipping="vectorized"`
    handle (weight regularizers, `add_loss`, a weight read outside its layer,
    a layer applied off the example axis). `clipping="ghost"` raises it;
    `clipping="auto"` catches it and clips that model with vectorized.
    It never means that examples are mixed: that error stays a
    `PrivacyConfigurationError`, whatever the strategy.
    """
