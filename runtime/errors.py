"""Errors with messages a user can act on; the CLI and server print them without a trace."""


class LivedraftError(Exception):
    """Base class: the message says what was wrong and what to do."""


class RequestError(LivedraftError, ValueError):
    """A request the engine cannot serve (empty prompt, too long, bad parameters)."""


class ModelLoadError(LivedraftError):
    """A model or drafter could not be found, loaded or paired with the target."""
