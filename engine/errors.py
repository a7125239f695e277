"""Errors the engine raises for bad input; the CLI prints them as one line."""


class KVChatError(Exception):
    """Base class for errors with a message meant for the user."""


class ModelLoadError(KVChatError):
    """A model is missing, corrupt or of an unsupported kind."""


class RequestError(KVChatError, ValueError):
    """A request cannot be served (a bad field, an empty prompt, too long for the context...).

    Also a ValueError: a bad field is a bad value, whichever front end passed it.
    """


class OutOfBlocksError(KVChatError):
    """The KV pool has no free block for an allocation."""


class RequestTooLargeError(RequestError):
    """A request that can never fit: beyond the context or the whole KV pool."""


class EngineStoppedError(KVChatError):
    """The engine has shut down and takes no more requests."""
