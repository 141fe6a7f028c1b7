"""specops: the application layer that composes serving, trainer, registry and streams."""

__version__ = "0.1.0"
