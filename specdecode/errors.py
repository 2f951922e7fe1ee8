"""The one exception type for mistakes a user can cause: the CLI prints its message and exits non-zero."""


class SpecDecodeError(Exception):
    """A user-facing error: bad input, a missing model, a corrupt file. Its message is the whole story.

    `param` names the request field at fault where there is one (the server reports it in OpenAI's error body).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
