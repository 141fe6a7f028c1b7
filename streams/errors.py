"""Typed errors of the streams package.

Callers catch :class:`StreamError`; the subclasses say what went wrong and whether a
retry can help (:class:`StreamUnavailableError` is the only transient one).
"""

from __future__ import annotations


class StreamError(Exception):
    """Base class of every error raised by ``streams``."""


class StreamConfigError(StreamError, ValueError):
    """A stream URL or setting is invalid. The message says what to change."""


class StreamUnavailableError(StreamError):
    """The backend cannot be reached or did not acknowledge in time. Retry later."""


class CommitFailedError(StreamError):
    """Offsets could not be committed (for example, the partitions were reassigned to
    another consumer of the group). The uncommitted records will be delivered again."""


class OffsetOutOfRangeError(StreamError):
    """A consumer group's committed offset lies beyond everything the partition ever held
    (the log was replaced or restored, or the offset file was edited). The message names
    the partition, the offset and the log's end; the group does not silently restart."""


class RecordValidationError(StreamError, ValueError):
    """A record failed to decode or validate.

    ``field`` names the offending field (``"header"`` for framing problems) and
    ``reason`` says what is wrong with it; ``str(err)`` combines both.
    """

    def __init__(self, record_type: str, field: str, reason: str) -> None:
        self.record_type = record_type
        self.field = field
        self.reason = reason
        super().__init__(f"{record_type}.{field}: {reason}")
