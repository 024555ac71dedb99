"""The call's options (attnselect.spec.options): CallOptions are attention()'s keyword options."""

from __future__ import annotations

import attnselect
from attnselect.spec.options import CallOptions


def test_call_options_are_attention_s_keyword_options_in_its_order_with_its_defaults():
    import inspect

    keywords = [p for p in inspect.signature(attnselect.attention).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert tuple(p.name for p in keywords) == CallOptions._fields
    assert all(CallOptions._field_defaults[p.name] == p.default for p in keywords)
