"""Exceptions raised by attnselect."""

from __future__ import annotations


class AttnSelectError(Exception):
    """Base class of every error attnselect raises on purpose."""


class InvalidInputError(AttnSelectError, ValueError):
    """An argument of an attention call or problem is malformed.

    The message names the argument, the value seen and what was expected. It is raised
    before any kernel runs.
    """


class NoSupportedCandidateError(AttnSelectError, RuntimeError):
    """No (backend, padding) candidate can serve the problem on the target.

    The message lists every candidate with the reasons it was rejected.
    """


class ForcedChoiceError(AttnSelectError, ValueError):
    """A backend or padding forced by the caller does not exist or cannot serve the problem."""
