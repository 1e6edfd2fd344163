"""Errors raised when a configuration would train with less privacy than reported."""

__all__ = ["PrivacyConfigurationError"]


class PrivacyConfigurationError(ValueError):
    """A setting would silently weaken or void the differential-privacy guarantee.

    The message always names the fix. It subclasses `ValueError` so that code
    catching bad arguments also catches it.
    """

    # TensorFlow's autograph re-raises an error from traced code with its own
    # type only when that type's __init__ is Exception.__init__; otherwise the
    # user sees a generic StagingError. Keep our type visible from inside fit.
    __init__ = Exception.__init__
