"""The one error type users see: a one-line message, exit code 2 from the CLI."""
from __future__ import annotations


class KvslimError(ValueError):
    """A problem with the user's input (path, flags, checkpoint, request).

    The CLI prints ``str(err)`` as one line on stderr and exits with code 2; the server maps it to
    a 400. Subclasses ``ValueError`` so library callers can catch it generically.
    """


class UnsupportedArchitecture(KvslimError):
    """The checkpoint's ``architectures`` / ``model_type`` is not one kvslim can handle."""


class CheckpointError(KvslimError):
    """A checkpoint directory is missing, incomplete, truncated or misshapen."""
