"""The one exception type for mistakes a user can cause: the CLI prints its message and exits non-zero."""


class SpecDecodeError(Exception):
    """A user-facing error: bad input, a missing model, a corrupt file. Its message is the whole story."""
