"""The one exception type for mistakes a user can cause: the CLI prints its message and exits non-zero."""


class SpecDecodeError(Exception):
    """A user-facing error: bad input, a missing model, a corrupt file. Its message is the whole story.

    `param` names the request field at fault where there is one (the server reports it in OpenAI's error body).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def quoted(value: object, limit: int = 60) -> str:
    """A user's value as a message quotes it: its repr, cut to about `limit` characters, so that a 10 KB method
    name or model id is not echoed back whole."""
    shown = repr(value)
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(str(value))} characters)"
