"""A few training steps of a torchtitan DeepSeek-V3 model (MLA 192/128, packed documents) three ways: torchtitan's
default attention (flex, compiled), its varlen path (torch's varlen_attn; FA3/FA4 as torchtitan activates them per
GPU) and attnselect (``attnselect.integrations.torchtitan.apply`` on the flex model).

    python benchmarks/torchtitan_steps.py --out results/h200_torchtitan_steps      # a GPU: .json and .md
    python benchmarks/torchtitan_steps.py --smoke --out /tmp/titan                  # tiny, the CPU (attnselect only)

Each way builds the same model from the same seed (torchtitan's ``debugmodel`` flavor of DeepSeek-V3 with
``--layers`` layers, bf16 parameters on the GPU), trains ``--steps`` steps with AdamW on the same token batches
(``--batch`` rows of ``--seqlen`` tokens, documents of lognormal lengths starting where ``positions == 0``), and
records the loss of every step, the step time (synchronised, after ``--warmup`` untimed steps) as tokens/s, and the
attention's forward time a step (CUDA events around each inner attention call, summed). The losses of the three ways
should agree within bf16 noise; the report gives each step's largest difference from the default's.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path

import torch


def batches(steps: int, batch: int, seqlen: int, vocab: int, device: str, seed: int = 0):
    """(tokens, labels, positions) a step: documents of lognormal lengths (median about 700 tokens)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        positions = []
        for _ in range(batch):
            row = []
            while len(row) < seqlen:
                length = min(max(int(rng.lognormvariate(6.5, 1.0)), 16), seqlen - len(row))
                row += list(range(length))
            positions.append(row)
        tokens = torch.randint(0, vocab, (batch, seqlen + 1), generator=g)
        out.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device), torch.tensor(positions, device=device)))
    return out


def torch_stand_ins() -> list[str]:
    """What torchtitan 0.3.0 uses of a newer torch than this one, given stand-ins (before torchtitan is imported), by
    name. On torch 2.11 (the H200's):

    - ``torch.distributed.fsdp.DataParallelMeshDims`` does not exist; DeepSeek-V3's MTP module imports it for the
      annotations of its FSDP helper, which single-GPU steps never call;
    - ``create_block_mask`` has no ``separate_full_blocks`` argument; torchtitan passes True outside batch-invariant
      mode, which is what this torch always does (full blocks kept apart from partial ones), so the stand-in drops
      True and refuses False."""
    import inspect

    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex

    added = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
        added.append("torch.distributed.fsdp.DataParallelMeshDims")
    if "separate_full_blocks" not in inspect.signature(flex.create_block_mask).parameters:
        original = flex.create_block_mask

        def create_block_mask(*args, separate_full_blocks: bool = True, **kwargs):
            if not separate_full_blocks:
                raise NotImplementedError("this torch's create_block_mask always keeps full blocks apart")
            return original(*args, **kwargs)

        flex.create_block_mask = create_block_mask
        added.append("create_block_mask(separate_full_blocks=True)")
    return added


def varlen_implementation() -> str:
    """The flash-attention implementation torchtitan's varlen path gets here. torchtitan 0.3.0 activates FA3 on
    sm90 and FA4 on sm100 (``torchtitan.tools.utils.get_cuda_flash_attention_impl``); where FA3's package
    (``flash_attn_interface``) is not installed, this makes it activate FA4 where that is installed, else none
    (torch's own FlashAttention-2 under ``varlen_attn``), and says which."""
    import importlib.util

    import torchtitan.tools.utils as utils

    wanted = utils.get_cuda_flash_attention_impl()
    if wanted != "FA3" or importlib.util.find_spec("flash_attn_interface") is not None:
        return f"{wanted or 'torch FlashAttention-2'} (torchtitan's choice)"
    fa4 = importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("flash_attn.cute") is not None
    utils.get_cuda_flash_attention_impl = lambda: "FA4" if fa4 else None
    return ("FA4" if fa4 else "torch FlashAttention-2") + " (torchtitan chose FA3, whose package is not installed)"


def build(backend: str, layers: int, device: str, dtype: torch.dtype):
    from torchtitan.models.deepseek_v3 import model_registry

    config = model_registry("debugmodel", attn_backend=backend).model
    config = dataclasses.replace(config, layers=config.layers[:layers])
    torch.manual_seed(0)
    with torch.device(device):
        model = config.build()
        model.init_states()
    return model.to(dtype)


class AttentionTimer:
    """CUDA events around every inner attention forward: its milliseconds, summed per step."""

    def __init__(self, model, enabled: bool):
        from torchtitan.models.common.attention import FlexAttention, VarlenAttention

        self.events: list = []
        self.enabled = enabled
        for module in model.modules():
            if enabled and isinstance(module, (FlexAttention, VarlenAttention)):
                module.register_forward_pre_hook(self._start)
                module.register_forward_hook(self._stop)

    def _start(self, module, args):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self.events.append([start, None])

    def _stop(self, module, args, out):
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        self.events[-1][1] = stop

    def take(self) -> float | None:
        if not self.enabled:
            return None
        torch.cuda.synchronize()
        ms = sum(a.elapsed_time(b) for a, b in self.events if b is not None)
        self.events.clear()
        return ms


def run_way(name: str, model, data, a) -> dict:
    cuda = a.device == "cuda"
    timer = AttentionTimer(model, cuda)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    losses, step_ms, attention_ms = [], [], []
    for i, (tokens, labels, positions) in enumerate(data):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        masks = model.get_attention_masks(positions)
        logits = model(tokens, positions, masks)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - started) * 1e3
        losses.append(float(loss))
        attention = timer.take()
        if i >= a.warmup:
            step_ms.append(elapsed)
            if attention is not None:
                attention_ms.append(attention)
        print(f"{name} step {i}: loss {losses[-1]:.4f}, {elapsed:.1f} ms", flush=True)
    tokens_a_step = a.batch * a.seqlen
    median = statistics.median(step_ms) if step_ms else None
    return {
        "losses": losses,
        "step_ms": step_ms,
        "tokens_per_s": tokens_a_step / (median / 1e3) if median else None,
        "attention_ms_a_step": statistics.median(attention_ms) if attention_ms else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument(
        "--ways",
        default="flex,attnselect,varlen",
        help="varlen last: building it switches torch's flash-attention implementation for the process",
    )
    a = ap.parse_args()
    import attnselect
    import attnselect.integrations.torchtitan as titan

    a.device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    if a.smoke:
        a.steps, a.warmup, a.layers, a.batch, a.seqlen, a.ways = 3, 1, 2, 1, 128, "attnselect"
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    data = batches(a.steps, a.batch, a.seqlen, 2048, a.device)
    report = {"device": attnselect.Target.current(a.device).describe(), "date": time.strftime("%Y-%m-%d"),
              "args": {k: v for k, v in vars(a).items() if k != "out"}, "ways": {}}  # fmt: skip
    report["stand-ins"] = torch_stand_ins()
    try:
        from importlib.metadata import version

        import torchtitan  # noqa: F401

        report["torchtitan"] = version("torchtitan")
    except ImportError:
        raise SystemExit("torchtitan is not installed (scripts/fetch_device_wheels.sh puts it in .whl)") from None
    base = build("flex", a.layers, a.device, dtype)
    for way in a.ways.split(","):
        model = None
        try:
            if way == "attnselect":
                model = titan.apply(copy.deepcopy(base))
            else:
                if way == "varlen":
                    report["varlen implementation"] = varlen_implementation()
                model = build(way, a.layers, a.device, dtype)
                model.load_state_dict(base.state_dict())
            report["ways"][way] = run_way(way, model, data, a)
        except Exception as exc:  # a way that cannot run here is reported, not fatal
            report["ways"][way] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        del model
    Path(a.out + ".json").write_text(json.dumps(report, indent=1))
    Path(a.out + ".md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = [f"# torchtitan DeepSeek-V3 training steps\n\n{report['device']}, torchtitan {report.get('torchtitan')}, "
             f"{report['date']}. Produced by `benchmarks/torchtitan_steps.py` (method in its docstring); "
             f"{report['args']}."
             + (f" Stand-ins for names this torch lacks: {', '.join(report['stand-ins'])}." if report.get("stand-ins")
                else "")
             + (f" varlen ran on {report['varlen implementation']}." if report.get("varlen implementation") else "")
             + "\n", "| way | tokens/s | step ms (median) | attention fwd ms a step | largest loss "
             "difference from flex | error |", "|---|---|---|---|---|---|"]  # fmt: skip
    reference = report["ways"].get("flex", {}).get("losses")
    for way, r in report["ways"].items():
        if "error" in r:
            lines.append(f"| {way} | | | | | {r['error']} |")
            continue
        diff = max(abs(x - y) for x, y in zip(r["losses"], reference)) if reference else None
        step = statistics.median(r["step_ms"]) if r["step_ms"] else None
        lines.append(
            f"| {way} | {r['tokens_per_s'] or 0:.0f} | {step or 0:.1f} | {r['attention_ms_a_step'] or 0:.2f} | "
            f"{'' if diff is None else f'{diff:.4f}'} | |"
        )
    lines.append("\nLosses per step:\n")
    for way, r in report["ways"].items():
        if "losses" in r:
            lines.append(f"- {way}: " + ", ".join(f"{x:.4f}" for x in r["losses"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
