"""The error hierarchy of dsi: one base class and a few precise subclasses.

Every error raised on purpose by the library derives from :class:`DSIError`, so callers can
catch everything of ours with one ``except``. Messages name the offending value and what is
allowed (``lookahead=0 must be >= 1``).
"""

from __future__ import annotations


class DSIError(Exception):
    """Base class of every error raised on purpose by dsi."""


class ConfigError(DSIError, ValueError):
    """An argument or configuration value is invalid (bad lookahead, temperature, prompt...)."""


class ContextLengthError(ConfigError):
    """A sequence is longer than a model's declared context (its ``max_context``).

    Raised by a session before it runs the forward (the session is left unchanged). A drafter
    that raises it has only reached its limit: the engines stop drafting and go on with the
    target's own tokens.
    """


class ModelError(DSIError):
    """A model misbehaved or cannot be used (wrong output shape, NaN logits, load failure)."""


class VocabularyMismatchError(ModelError, ValueError):
    """Target and drafter do not share one vocabulary."""


class DraftUnavailable(DSIError):
    """A drafter has nothing to propose for the next position (e.g. a drafter with another
    tokenizer whose text has ended, or that cannot spell the context). Raised by a drafter session;
    the engines stop drafting for the moment and go on with the target's own tokens, as at a
    drafter's context limit. Never escapes the engine."""


class WorkerError(DSIError, RuntimeError):
    """A target server or the drafter failed while serving a request."""


class ServerLost(WorkerError):
    """A target server is gone or cannot be trusted: an engine that refused the connection, timed out,
    answered 5xx or answered garbage. Raised by a session; the pool treats the server as dead (its
    task re-queued on the others, the server restarted within its budget), never as a wrong answer."""


class DecoderClosed(DSIError, RuntimeError):
    """A decoder (or a pool) was used after ``close()``."""


class TaskCancelled(DSIError):
    """Raised inside a model forward that noticed its cancel flag; never escapes the engine."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


def is_int(value: object) -> bool:
    """Whether ``value`` is a Python integer and not a bool (``True`` is an ``int`` to Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters: a value from a user may be thousands of
    characters long, and an integer of more than 4,300 digits has no ``repr`` at all (Python refuses to convert
    it), which would turn the message that names it into a bare ``ValueError``."""
    if isinstance(value, int) and value.bit_length() > 3 * limit:  # more digits than the message may show
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except ValueError:  # an integer too long to convert, or a container holding one
        if isinstance(value, int):
            return f"<an integer of {value.bit_length()} bits>"
        return f"<a {type(value).__name__} holding an integer too long to show>"
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"
