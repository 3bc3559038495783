"""Exceptions the SDK raises for configuration and tier set-up problems."""


class ConfigError(ValueError):
    """A configuration or tier option is wrong; the message names what and why."""


class TierError(RuntimeError):
    """A tier could not be found, validated or opened."""
