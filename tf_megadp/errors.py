"""Errors raised when a configuration would train with less privacy than reported."""

__all__ = ["PrivacyConfigurationError"]


class PrivacyConfigurationError(ValueError):
    """A setting would silently weaken or void the differential-privacy guarantee.

    The message always names the fix. It subclasses `ValueError` so that code
    catching bad arguments also catches it.
    """
