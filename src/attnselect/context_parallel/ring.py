"""The p2p ring of context-parallel attention: K and V travel around the group, each step's chunk pair runs on this
rank's queries, and the partial results merge exactly by their log-sum-exp.

Schedule (N ranks; rank r holds chunks r and 2N-1-r; at step i it holds the K/V of rank src = (r - i) mod N), as
TransformerEngine's AttnFuncWithCPAndKVP2P: without a mask every step is all queries against all keys. Under a causal
mask step 0 is the local diagonal (causal within the shard), a step with src < r is all queries against the first
half of the keys (chunk src; chunk 2N-1-src lies in every local query's future), and a step with src > r is the
second half of the queries (chunk 2N-1-r) against all keys; the other chunk pairs are hidden by the mask and skipped.
Every step thus has the same work on every rank (the point of the layout).

Merge: ``lse = logaddexp(lse, lse_i)`` and ``out = out * exp(lse_old - lse) + out_i * exp(lse_i - lse)``, in
float32 (float64 for float64 input). Backward runs the ring again: each step recomputes its chunk pair's (out_i,
lse_i) and back-propagates ``d out_i = w_i dO`` and ``d lse_i = w_i (dO.out_i - dO.out + d lse)`` with
``w_i = exp(lse_i - lse)``, the exact gradient of the merge, so the chunk kernel's lse must carry a gradient;
dQ accumulates here, and the dK/dV of each block travel the ring with it (float32) back to their owner.

Cost per rank and step, for a shard of T tokens (per batch row, dense), Hkv key heads, head dims d_qk and d_v,
element size e: K/V sent ``T * Hkv * (d_qk + d_v) * e`` bytes, N - 1 times forward; backward sends K/V N - 1 times
and dK/dV (float32) N times. Attention per step: T x T pairs without a mask; under a causal mask T x T causal at
step 0 and T x T/2 after it, T^2/2 pairs every step on every rank. The backward recomputes each step's forward
(about 1.3x the attention work of forward + backward). Each step's send and receive are posted before its
attention runs, so the transfer overlaps it: on CUDA, NCCL runs point-to-point operations on its own stream, ordered
after the work queued when they are posted, and ``Work.wait()`` orders the current stream after the transfer
(torch ProcessGroupNCCL). NCCL's stream is the side stream: posting from another stream of ours would only order
the transfer after that stream's work instead of the tensors' producer. docs/context_parallel.md has the cost model
in numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from attnselect.execution import lse_as_rows, rows_as_lse

Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]  # (q, k, v) -> (out, lse, *max_logit)


@dataclass(frozen=True)
class Halves:
    """Where the two chunks of this rank's shard lie: the first and second half of the sequence axis (dense), or of
    every packed sequence (thd: ``index`` holds the token positions of each half, on the tensors' device)."""

    layout: str
    length: int  # tokens of the shard along the sequence axis (dense: per batch row)
    index: tuple[torch.Tensor, torch.Tensor] | None = None  # thd only
    boundaries: torch.Tensor | None = None  # thd only: int32 cu_seqlens of either half (the shard's, halved)

    def take(self, x: torch.Tensor, half: int, *, lse: bool = False) -> torch.Tensor:
        axis = self._axis(lse)
        if self.index is not None:
            return x.index_select(axis, self.index[half])
        return x.narrow(axis, half * (self.length // 2), self.length // 2)

    def add_(self, x: torch.Tensor, half: int, value: torch.Tensor) -> None:
        if self.index is not None:
            x.index_add_(self._axis(False), self.index[half], value)
        else:
            self.take(x, half).add_(value)

    def put_(self, x: torch.Tensor, half: int, value: torch.Tensor, *, lse: bool = False) -> None:
        if self.index is not None:
            x.index_copy_(self._axis(lse), self.index[half], value)
        else:
            self.take(x, half, lse=lse).copy_(value)

    def _axis(self, lse: bool) -> int:
        if self.layout == "thd":
            return 1 if lse else 0  # lse (Hq, T)
        return 2 if lse else {"bshd": 1, "sbhd": 0, "bhsd": 2}[self.layout]  # lse (B, Hq, S)


def thd_halves(cu_seqlens: torch.Tensor, tokens: int) -> Halves:
    """The halves of every sequence of a thd shard whose local lengths are even, without a host read: half
    position p of sequence b (cu_seqlens // 2 holds the halves' boundaries h) is token p + h[b] of its first half
    and p + h[b + 1] of its second."""
    h = torch.div(cu_seqlens, 2, rounding_mode="floor")
    p = torch.arange(tokens // 2, device=cu_seqlens.device)
    b = torch.searchsorted(h[1:].long(), p, right=True)
    return Halves("thd", tokens, (p + h[b], p + h[b + 1]), h)


@dataclass(frozen=True)
class Ring:
    """One context-parallel call's ring: the group, the schedule and the chunk pairs' kernels."""

    group: object  # torch.distributed.ProcessGroup
    rank: int  # in the group
    size: int
    causal: bool
    layout: str
    halves: Halves | None  # causal only
    pairs: dict[str, Run]  # "diagonal", "kv_half", "q_half" (causal) or "full": run(q, k, v)

    def kind(self, step: int) -> str:
        if not self.causal:
            return "full"
        source = (self.rank - step) % self.size
        return "diagonal" if step == 0 else "kv_half" if source < self.rank else "q_half"

    def forward(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(out in q's dtype, lse float32 or float64, [max logit] or []); no autograd."""
        kv, out, lse, maxima = (k.contiguous(), v.contiguous()), None, None, []
        for step in range(self.size):
            incoming = self._exchange(kv) if step < self.size - 1 else None
            kind = self.kind(step)
            out_i, lse_i, *max_logit = self.pairs[kind](*self._operands(kind, q, *kv))
            maxima += max_logit
            if out is None:  # step 0 covers every query
                out, lse = out_i.to(_accumulator(q)), lse_i.to(_accumulator(q))
            elif kind == "q_half":
                merged_out, merged_lse = _merge(self.halves.take(out, 1), self.halves.take(lse, 1, lse=True), out_i,
                                                lse_i, self.layout)  # fmt: skip
                self.halves.put_(out, 1, merged_out)
                self.halves.put_(lse, 1, merged_lse, lse=True)
            else:
                out, lse = _merge(out, lse, out_i, lse_i, self.layout)
            if incoming is not None:
                kv = incoming()
        return out.to(q.dtype), lse, ([torch.stack(maxima).amax(0)] if maxima else [])

    def backward(self, q, k, v, out, lse, d_out, d_lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = _accumulator(q)
        d_row = rows_as_lse((d_out.to(acc) * out.to(acc)).sum(-1), self.layout)  # dO . out per query row
        rows = (lse, d_out, d_lse, d_row)
        d_q = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, returning = (k.contiguous(), v.contiguous()), None
        for step in range(self.size):
            incoming = self._exchange(kv) if step < self.size - 1 else None
            kind = self.kind(step)
            if kind == "q_half":
                part_rows = [self.halves.take(x, 1, lse=is_lse) for x, is_lse in zip(rows, (True, False, True, True))]
            else:
                part_rows = rows
            grad_q, *grad_kv = _pair_gradients(self.pairs[kind], self.layout, *self._operands(kind, q, *kv), *part_rows)
            if kind == "q_half":
                self.halves.add_(d_q, 1, grad_q.to(acc))
            else:
                d_q += grad_q
            if returning is None:  # this rank's own block: its first contribution
                d_kv = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in kv]
            else:
                d_kv = returning()
            for total, grad in zip(d_kv, grad_kv):
                if kind == "kv_half":
                    self.halves.add_(total, 0, grad.to(acc))
                else:
                    total += grad
            returning = self._exchange(d_kv)  # to the next rank, which holds this block at the next step
            if incoming is not None:
                kv = incoming()
        d_k, d_v = returning()  # every rank's contribution to this rank's own K/V
        return d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype)

    def _operands(self, kind, q, k, v):
        """The queries and keys one step's chunk pair attends (module docstring)."""
        if kind == "kv_half":
            return q, self.halves.take(k, 0), self.halves.take(v, 0)
        if kind == "q_half":
            return self.halves.take(q, 1), k, v
        return q, k, v

    def _exchange(self, tensors) -> Callable[[], list[torch.Tensor]]:
        """Send ``tensors`` to the next rank and receive the previous rank's; returns the wait for the latter."""
        received = [torch.empty_like(t) for t in tensors]
        after = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        before = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        ops = [dist.P2POp(dist.isend, t, after, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, before, self.group) for t in received]
        works = dist.batch_isend_irecv(ops)

        def wait():
            for work in works:
                work.wait()
            return received

        return wait


class RingAttention(torch.autograd.Function):
    """The ring with its backward: ``apply(q, k, v, ring) -> (out, lse, *max_logit)``; lse carries a gradient."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        out, lse, max_logit = ring.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.mark_non_differentiable(*max_logit)
        return out, lse, *max_logit

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out, d_lse, *_):
        q, k, v, out, lse = ctx.saved_tensors
        return *ctx.ring.backward(q, k, v, out, lse, d_out, d_lse), None


def _pair_gradients(run: Run, layout: str, q, k, v, lse, d_out, d_lse, d_row):
    """dq, dk, dv of one step's chunk pair: its (out_i, lse_i) recomputed, then the merge's exact gradient
    (module docstring); ``lse`` ... ``d_row`` are the merged rows of the queries it attends."""
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out_i, lse_i, *_ = run(q, k, v)
    weight = _weight(lse_i.detach().to(lse.dtype), lse)
    own = rows_as_lse((d_out.to(weight.dtype) * out_i.detach().to(weight.dtype)).sum(-1), layout)
    grad_out = (d_out.to(weight.dtype) * lse_as_rows(weight, layout)[..., None]).to(out_i.dtype)
    grad_lse = (weight * (own - d_row + d_lse)).to(lse_i.dtype)
    pairs = [(x, g) for x, g in ((out_i, grad_out), (lse_i, grad_lse)) if x.requires_grad]  # an empty shard's lse
    grads = torch.autograd.grad([x for x, _ in pairs], (q, k, v), [g for _, g in pairs], allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v))]


def _accumulator(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _weight(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(lse_part - lse): a chunk pair's share of each row's softmax; 0 on rows that see no key at all."""
    return torch.where(lse == float("-inf"), 0.0, torch.exp(lse_part - lse))


def _merge(out, lse, out_i, lse_i, layout: str):
    """Two partial results over disjoint keys as one, exactly (rows that see no key yet keep 0 and -inf)."""
    lse_i = lse_i.to(lse.dtype)
    merged = torch.logaddexp(lse, lse_i)
    kept, added = (lse_as_rows(_weight(x, merged), layout)[..., None] for x in (lse, lse_i))
    return out * kept + out_i.to(out.dtype) * added, merged
