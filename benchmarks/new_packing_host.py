"""Each packed backend's host time per call on a packing already seen and on a new packing each call, on any GPU.

    python benchmarks/new_packing_host.py --out results/h100_new_packing_host   # a GPU, with or without FA4

A packed step's first layer decides and prepares for its new packing; the layers after it share that. The
calibration keeps both times per backend (``host_us``, ``new_packing_us``: attnselect.bench.calibrate.host_times,
what ``benchmarks/calibrate.py --host-from`` runs on the GPU that calibrated); this runs the same measurement on a GPU
that has no calibration of its own, every host key of the packaged sm90 calibration that an installed backend serves
(128/128 native and 192/128 padded, at the packed ladder's smallest size, through attnselect.attention forced to each
candidate, side by side). Writes ``--out``.json and .md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from importlib import resources

import attnselect
from attnselect.bench import calibrate
from attnselect.choose import calibration


def packaged_keys() -> dict:
    """{backend: its host keys} of the packaged calibration of the H200."""
    packaged = json.loads(resources.files("attnselect").joinpath("data", "calibration_sm90_nvidia-h200.json")
                          .read_text())  # fmt: skip
    return {backend: list(keys) for backend, keys in packaged["host_us"].items()}


def measure(keys: dict) -> dict:
    """Host times of the installed backends at ``keys`` ({backend: host keys}): packed ones on a packing seen and on a
    new packing each call."""
    target = attnselect.Target.current()
    unmeasured = {backend: dict.fromkeys(times) for backend, times in keys.items()}
    data = {"fingerprint": calibration.fingerprint(target), "host_us": unmeasured}
    measured = calibrate.host_times(data, target, attention=attnselect.attention, progress=calibrate.print_progress)
    seen = {b: {k: us for k, us in times.items() if us is not None and k.startswith("thd")}
            for b, times in measured["host_us"].items()}  # fmt: skip
    return {
        "device": target.describe(),
        "date": time.strftime("%Y-%m-%d"),
        "seen_packing_us": {b: times for b, times in seen.items() if times},
        "new_packing_us": measured["new_packing_us"],
    }


def report(data: dict) -> str:
    lines = [
        "# Packed host time per call: a packing seen, a new packing each call",
        "",
        f"{data['device']}, {data['date']}. Produced by `benchmarks/new_packing_host.py` (method in its docstring): "
        "us a call, the least round's median of 5 rounds of 10 calls, the GPU kept busy.",
        "",
        "| backend | call | packing seen | new packing | extra |",
        "|---|---|---|---|---|",
    ]
    for backend, times in sorted(data["seen_packing_us"].items()):
        for key, seen in sorted(times.items()):
            new = data["new_packing_us"].get(backend, {}).get(key)
            extra = f"{new - seen:+.1f}" if new is not None else "-"
            lines.append(f"| {backend} | {key} | {seen:.1f} | {new if new is not None else '-'} | {extra} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="path without extension: .json and .md")
    a = ap.parse_args()
    data = measure(packaged_keys())
    pathlib.Path(a.out + ".json").write_text(json.dumps(data, indent=1))
    pathlib.Path(a.out + ".md").write_text(report(data))
    print(report(data))


if __name__ == "__main__":
    main()
