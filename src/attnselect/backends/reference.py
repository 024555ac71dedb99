"""``reference``: eager matmul + softmax in PyTorch, on any device and dtype (float64 included).

Half-precision inputs are computed in float32 and the output cast back; float64 stays float64.
Rows with no visible key give a zero output and lse = -inf. The lse is float32 (float64 for float64 input,
which sinks rescale by; attnselect.attention returns it as float32) and carries a gradient; the max logit is
float32 (Hq,), over the batch, the queries and the visible keys.
"""

from __future__ import annotations

import torch

from attnselect.backends.base import ALL_DTYPES, Backend, Surface, expand_kv_heads
from attnselect.spec import masks
from attnselect.spec.options import KernelCall

_SURFACE = Surface(dtypes=ALL_DTYPES, lse_gradient=True, softcap=True, max_logit=True)


class Reference(Backend):
    name = "reference"
    summary = "eager matmul + softmax: every feature, any device and dtype, slow; the correctness oracle"
    layout = "bhsd"
    surfaces = {"cuda": _SURFACE, "cpu": _SURFACE}

    def run(self, q, k, v, call: KernelCall):
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        k, v = expand_kv_heads(q, k, v)
        scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * call.scale
        if call.softcap is not None:  # Gemma 2: the scaled logits are capped before the mask
            scores = call.softcap * torch.tanh(scores / call.softcap)
        allowed = masks.visible(call.mask, call.window, q.shape[-2], k.shape[-2], q.device)
        max_logit = None
        if call.return_max_logit:
            visible = scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))
            max_logit = visible.detach().amax(dim=(0, 2, 3)).float()
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
            empty_row = ~allowed.any(-1, keepdim=True)  # (Sq, 1)
            scores = scores.masked_fill(empty_row, 0.0)  # keep softmax and its gradient finite
        probs = torch.softmax(scores, dim=-1)
        lse = torch.logsumexp(scores, dim=-1) if call.return_lse else None
        if allowed is not None:
            probs = probs.masked_fill(empty_row, 0.0)
            if lse is not None:
                lse = lse.masked_fill(empty_row.squeeze(-1), float("-inf"))
        if call.dropout_p:
            probs = torch.nn.functional.dropout(probs, p=call.dropout_p)
        out = torch.matmul(probs, v.to(compute)).to(q.dtype)
        lse = lse.float() if lse is not None and compute != torch.float64 else lse  # float64 in: kept for sinks
        return (out, lse) if max_logit is None else (out, lse, max_logit)
