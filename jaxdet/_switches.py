"""Placeholder until the native branch lands (replaced by its version)."""

TESTING_ENV = "JAXDET_TESTING"


def active_testing_overrides():
    return {}
