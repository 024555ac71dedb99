"""TransformerEngine's backend selection, emulated on attnselect's verdicts: a named comparison policy for
``attnselect bench`` (never the choice of a call).

Source: docs/sources/te_backend_selection.md, from TransformerEngine's
``dot_product_attention/utils.py``. TE weighs FlashAttention, fused (cuDNN) and unfused (math) attention, in
the order flash > fused > unfused, and on sm90+ drops flash when fused also serves. PR #3339 pads only when the
native shape gets unfused and the padded one does not, or when the native shape gets FlashAttention-2.
"""

from __future__ import annotations

from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target


def te_choice(problem: AttentionProblem, target: Target, supported: set) -> Candidate | None:
    """TransformerEngine's choice with PR #3339's pad decision, on our verdicts."""
    packed = problem.layout == "thd"
    flash = "varlen_fa2" if packed else "sdpa_flash"
    fused = "cudnn_frontend" if packed and Candidate("cudnn_frontend") in supported else "sdpa_cudnn"

    def backend_for(pad_to):
        has = lambda name: Candidate(name, pad_to) in supported  # noqa: E731
        if has(flash) and has(fused) and target.is_cuda and target.capability >= (9, 0):
            return fused
        for name in (flash, fused):
            if has(name):
                return name
        return "sdpa_math"

    native = backend_for(None)
    pad_to = problem.pad_target
    if problem.different_head_dims:  # PR #3339 pads MLA's V, never equal head dims
        padded = backend_for(pad_to)
        if native == "sdpa_math" and padded != "sdpa_math":
            return Candidate(padded, pad_to)
        if native == flash and Candidate(flash, pad_to) in supported:  # FA2 needs equal head dims: TE pads for it
            return Candidate(flash, pad_to)
    return Candidate(native) if Candidate(native) in supported else None
