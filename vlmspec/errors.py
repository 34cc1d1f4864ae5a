"""The errors vlmspec raises at its edges, each with a message that says what to do.

The CLI turns them into one line and exit code 2; the server into an OpenAI-shaped 4xx.
"""

from __future__ import annotations


class VlmspecError(Exception):
    """Base of every error vlmspec reports to a user."""


class ConfigError(VlmspecError, ValueError):
    """An engine could not be built from what was asked (unknown device, model or drafter)."""


class TargetLoadError(VlmspecError, RuntimeError):
    """The target could not be loaded (or cannot build a prompt)."""


class DrafterLoadError(VlmspecError, ValueError):
    """A drafter checkpoint is missing, malformed, or was trained for another target."""


class ContextLengthError(VlmspecError, ValueError):
    """The prompt does not fit the target's context window."""


class InputError(VlmspecError, ValueError):
    """Bad user input (an image that is not one, too large, a malformed URL, ...).

    `param` names the offending request field when there is one, `code` is a short machine-readable
    reason and `status` the HTTP status the server answers with.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type
