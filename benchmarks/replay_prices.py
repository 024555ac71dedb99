"""What a packaged calibration's replay pricing chooses for dense calls of one shape each, lengths from short to long.

    python benchmarks/replay_prices.py --gpu "NVIDIA H100 80GB HBM3" --out results/cpu_replay_prices_h100

Any machine (nothing runs): the GPU's packaged calibration at its versions, FlashAttention-4 installed as the target
says, its configuration paid (as after ``attnselect.warmup``), so each new length prices only FA4's calls before
its forward replays (attnselect.choose.first_calls). Per length, B1 16 heads 192/128 causal bf16 inference: FA4's
predicted time replayed and through its interface (a stack's, ``Prediction.total_us``), the candidate chosen, and
its rental (the calls it runs before FA4, the price, the time a call loses meanwhile). Writes ``--out``.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import tempfile
import time

LENGTHS = (256, 512, 1024, 1536, 2048, 3000, 4096, 8192)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="NVIDIA H100 80GB HBM3", help="a GPU model with a packaged calibration")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ["ATTNSELECT_CACHE_DIR"] = tempfile.mkdtemp()  # the packaged calibration, no user's
    import torch

    import attnselect
    from attnselect.choose import calibration, first_calls
    from attnselect.spec.options import Candidate
    from attnselect.spec.target import Target

    probe = dataclasses.replace(Target.preset("h200"), name=a.gpu)
    data = calibration.packaged(probe)
    if data is None:
        raise SystemExit(f"no packaged calibration for {a.gpu}")
    fp = data["fingerprint"]
    target = dataclasses.replace(Target.preset("h200", packages=fp["packages"], torch_version=fp["torch"],
                                               cudnn_version=fp["cudnn"]), name=a.gpu)  # fmt: skip
    fa4 = Candidate("flash_attn4")

    def problem(length: int):
        return attnselect.AttentionProblem(1, length, length, 16, 16, 192, 128, mask="causal", dtype=torch.bfloat16)

    first_calls.ran(fa4, problem(2056))  # its configuration compiled, at a length not below
    rows = []
    for length in LENGTHS:
        decision = attnselect.select(problem(length), target=target)
        mine = decision.predictions[fa4]
        through = mine.before_replay_total_us
        rental, chosen = decision.rental, decision.predictions[decision.chosen]
        rows.append({"length": length, "fa4_replayed_us": round(mine.total_us, 1),
                     "fa4_through_interface_us": round(through, 1) if through else None,
                     "chosen": str(decision.chosen), "chosen_us": round(chosen.total_us, 1),
                     "rental_calls": rental.calls if rental else 0,
                     "price_ms": round(rental.compile_ms, 3) if rental else 0.0,
                     "lost_us": round(rental.lost_us, 1) if rental else 0.0})  # fmt: skip
    meta = {"gpu": a.gpu, "calibration": decision.calibration, "date": time.strftime("%Y-%m-%d"),
            "versions": fp}  # fmt: skip
    pathlib.Path(a.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# Replay pricing of a packaged calibration, one shape per length",
        "",
        f"{a.gpu}, {meta['calibration']}, {meta['date']}; produced by `benchmarks/replay_prices.py` (method in its "
        "docstring): B1 16 heads 192/128 causal bf16 inference, FA4's configuration paid; predicted us a call in a "
        "stack.",
        "",
        "| length | FA4 replayed | FA4 through its interface | chosen | its time | rental calls | price (ms) | "
        "lost a call |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['length']} | {r['fa4_replayed_us']} | {r['fa4_through_interface_us']} | {r['chosen']} | "
                     f"{r['chosen_us']} | {r['rental_calls']} | {r['price_ms']} | {r['lost_us']} |")  # fmt: skip
    pathlib.Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
