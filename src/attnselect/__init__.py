"""attnselect: run every attention call on the fastest kernel that can correctly serve it, and say why.

Public API: :func:`attention`, :func:`select`, :func:`explain`, :class:`AttentionProblem`,
:class:`Target`, plus :class:`Decision`, :func:`overrides`, :func:`clear_cache`, :func:`warmup` and the error
classes.
"""

from attnselect.api import attention, explain, warmup
from attnselect.choose.decision import Decision
from attnselect.choose.selection import select
from attnselect.choose.settings import overrides
from attnselect.errors import AttnSelectError, ForcedChoiceError, InvalidInputError, NoSupportedCandidateError
from attnselect.memos import clear_cache
from attnselect.spec.options import Candidate, Verdict
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target
from attnselect.version import __version__ as __version__

__all__ = [
    "attention",
    "select",
    "explain",
    "AttentionProblem",
    "Target",
    "Decision",
    "Candidate",
    "Verdict",
    "clear_cache",
    "overrides",
    "warmup",
    "AttnSelectError",
    "InvalidInputError",
    "NoSupportedCandidateError",
    "ForcedChoiceError",
]
