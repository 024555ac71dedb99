"""The packaged calibration of a GPU: ``attnselect calibrate`` in full, with its report.

    python benchmarks/calibrate.py --out results/h200_calibration           # on the GPU: .json and .md
    python benchmarks/calibrate.py --package results/h200_calibration.json  # here: the package data of its GPU
    # in parts, one device call each (--pairs 192/128,128/128 then --pairs 64/64,256/256), joined:
    python benchmarks/calibrate.py --merge part1.json part2.json --out results/h200_calibration
    # one part measured again on the GPU, into a copy: --host-from (host times), --first-calls-from (first calls)
    python benchmarks/calibrate.py --first-calls-from results/h200_calibration.json --out /tmp/h200_calibration

The calibration holds only for the GPU and library versions it ran on (attnselect.choose.calibration.fingerprint).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def report(data: dict) -> str:
    lines = [
        "# Calibration",
        "",
        f"{data['device']}, {data['date']}. Produced by `benchmarks/calibrate.py` (attnselect.bench.calibrate): the "
        "GPU's time of a call (median, queued behind a spin) over a ladder of sizes, 16 heads, causal, bf16; the "
        "host's time to issue one call at the smallest size; the first call's extra time.",
        "",
        f"Source: {data['source']}.",
        "",
        "## Host time per call (us)",
        "",
        "| backend | " + " | ".join(sorted({k for v in data["host_us"].values() for k in v})) + " |",
    ]
    keys = sorted({k for v in data["host_us"].values() for k in v})
    lines.append("|---|" + "---|" * len(keys))
    for backend, times in sorted(data["host_us"].items()):
        lines.append(f"| {backend} | " + " | ".join(str(times.get(k, "-")) for k in keys) + " |")
    titles = {  # packed: on a new packing each call, beside the time on a packing already seen
        "new_packing_us": "Host time per packed call on a new packing each call (us; on one seen: above)",
        "replayed_host_us": "Host time per call replayed, a shape called before (us; through the interface: above)",
    }
    for name, title in titles.items():
        times_by = data.get(name, {})
        if not times_by:
            continue
        keys = sorted({k for v in times_by.values() for k in v})
        lines += ["", f"## {title}", "", "| backend | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for backend, times in sorted(times_by.items()):
            lines.append(f"| {backend} | " + " | ".join(str(times.get(k, "-")) for k in keys) + " |")
    lines += [
        "",
        "## GPU time per call (us) by work (1e6 score pairs x heads x (d_qk + d_v); packed: as "
        "attnselect.choose.predict.work estimates it)",
        "",
    ]
    lines += ["| backend | curve | points (work: us) |", "|---|---|---|"]
    for backend, curves in sorted(data["gpu"].items()):
        for key, points in sorted(curves.items()):
            lines.append(f"| {backend} | {key} | " + ", ".join(f"{w}: {us}" for w, us in points) + " |")
    titles = {
        "first_call_ms": "First call of a new configuration, extra ms (the median configuration's, start-up left out)",
        "new_size_ms": "First call of a new size of a configuration that has run, extra ms (the median's)",
    }
    for name, title in titles.items():
        costs = {b: ms if isinstance(ms, dict) else {"every call": ms} for b, ms in data.get(name, {}).items()}
        if not costs:
            continue
        keys = sorted({k for v in costs.values() for k in v})
        lines += ["", f"## {title}", "", "| backend | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        lines += [f"| {b} | " + " | ".join(str(ms.get(k, "-")) for k in keys) + " |" for b, ms in sorted(costs.items())]
    return "\n".join(lines) + "\n"


def _merged_costs(into: dict, costs: dict) -> None:
    """``costs`` (a part's ``first_call_ms`` or ``new_size_ms``) into ``into``, the dearer kept per key."""
    for backend, ms in costs.items():
        have = into.get(backend, {})
        if isinstance(ms, dict) and isinstance(have, dict):
            into[backend] = {k: max(t, have.get(k, 0.0)) for k, t in {**have, **ms}.items()}
        else:  # a part of one figure per backend: the dearest of both
            into[backend] = max([*(have.values() if isinstance(have, dict) else [have]),
                                 *(ms.values() if isinstance(ms, dict) else [ms]), 0.0])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="path without extension: .json and .md")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--package", help="a calibration .json to install as the package data of its GPU model")
    ap.add_argument("--pairs", help="head-dim pairs, e.g. 192/128,128/128 (default: attnselect.bench.calibrate.PAIRS)")
    ap.add_argument("--merge", nargs="+", help="calibrations of one machine to join into --out")
    ap.add_argument("--host-from", help="a calibration of this machine whose host times to measure again into --out")
    ap.add_argument("--first-calls-from", help="a calibration of this machine whose first calls' costs to measure "
                    "again into --out (in a process that has run no attention yet)")  # fmt: skip
    a = ap.parse_args()
    from attnselect.bench import calibrate
    from attnselect.choose import calibration

    if not a.out and not a.package:
        ap.error("--out is needed (or --package)")
    if a.merge:
        parts = [json.loads(pathlib.Path(p).read_text()) for p in a.merge]
        for name, part in zip(a.merge, parts):
            if calibration._problem(part):
                raise SystemExit(f"{name}: {calibration._problem(part)}")
        if any(p["fingerprint"] != parts[0]["fingerprint"] for p in parts):
            raise SystemExit("the parts ran on different machines or versions")
        if any(p["host"] != parts[0]["host"] for p in parts):  # each host time the least over the parts: one host's
            raise SystemExit("the parts' host times were measured on different hosts (or not recorded in some)")
        data = dict(parts[0], host_us={}, new_packing_us={}, replayed_host_us={}, gpu={}, first_call_ms={},
                    new_size_ms={})  # fmt: skip
        for marker, says in (("--quick", " (merged with a --quick part)"), (calibrate.PARTIAL, calibrate.PARTIAL)):
            if any(marker in part["source"] for part in parts) and marker not in data["source"]:
                data["source"] += says  # what a part was not, the whole is not: --package refuses it
        for name in ("host_us", "new_packing_us", "replayed_host_us"):  # each kind's least over the parts that timed it
            data[name] = calibrate.least_times(*(part.get(name, {}) for part in parts))
        for part in parts:
            for backend, curves in part["gpu"].items():
                data["gpu"].setdefault(backend, {}).update(curves)
            for name in ("first_call_ms", "new_size_ms"):
                _merged_costs(data[name], part.get(name, {}))
        pathlib.Path(a.out + ".json").write_text(json.dumps(data, indent=1))
        pathlib.Path(a.out + ".md").write_text(report(data))
        return

    if a.package:
        data = json.loads(pathlib.Path(a.package).read_text())
        problem = calibration._problem(data)
        capability = data["fingerprint"]["capability"] if not problem else None
        if not problem and not capability:
            problem = "a CPU's calibration (the loader reads GPUs' alone)"
        if not problem and ("--quick" in data["source"] or calibrate.PARTIAL in data["source"]):
            problem = f"not a whole calibration ({data['source']})"  # a quick run's, or a run's checkpoint
        if problem:
            raise SystemExit(f"{a.package}: {problem}")
        arch = f"sm{capability[0]}{capability[1]}"
        target = ROOT / "src" / "attnselect" / "data" / calibration.file_name(arch, data["fingerprint"]["name"])
        shutil.copyfile(a.package, target)
        print(f"{a.package} -> {target.relative_to(ROOT)}")
        return
    import attnselect

    if a.host_from:
        data = calibrate.host_times(json.loads(pathlib.Path(a.host_from).read_text()), attention=attnselect.attention,
                                    progress=calibrate.print_progress)  # fmt: skip
        data["source"] += (
            "; host times measured again through attnselect.attention, side by side (packed: on a packing seen and "
            f"on a new packing each call; replayed too, where a backend replays), {time.strftime('%Y-%m-%d')}"
        )
        pathlib.Path(a.out + ".json").write_text(json.dumps(data, indent=1))
        pathlib.Path(a.out + ".md").write_text(report(data))
        print(report(data))
        return
    pairs = tuple(tuple(int(d) for d in p.split("/")) for p in a.pairs.split(",")) if a.pairs else calibrate.PAIRS
    if a.first_calls_from:
        data = json.loads(pathlib.Path(a.first_calls_from).read_text())
        target = attnselect.Target.current()
        if calibration.machine(data["fingerprint"]) != calibration.machine(calibration.fingerprint(target)):
            raise SystemExit(f"{a.first_calls_from} ran on {data['device']}, not here ({target.describe()})")
        costs = calibrate.first_call_costs(target, attention=attnselect.attention,
                                           pairs=[p for p in pairs if p != calibrate.START_UP],
                                           progress=calibrate.print_progress)  # fmt: skip
        for name, by_backend in costs.items():  # per backend: one not installed here keeps its measured costs
            data.setdefault(name, {}).update(by_backend)
        data["source"] += f"; first calls measured again, start-up left out, {time.strftime('%Y-%m-%d')}"
        pathlib.Path(a.out + ".json").write_text(json.dumps(data, indent=1))
        pathlib.Path(a.out + ".md").write_text(report(data))
        print(report(data))
        return

    def checkpoint(partial: dict) -> None:  # what a deadline or a crash would otherwise lose; --package refuses it
        partial = {**partial, "source": partial["source"] + calibrate.PARTIAL}
        pathlib.Path(a.out + ".json").write_text(json.dumps(partial, indent=1))

    data = calibrate.run(attention=attnselect.attention, quick=a.quick, pairs=pairs, progress=calibrate.print_progress,
                         checkpoint=checkpoint)  # fmt: skip
    pathlib.Path(a.out + ".json").write_text(json.dumps(data, indent=1))
    pathlib.Path(a.out + ".md").write_text(report(data))
    print(report(data))


if __name__ == "__main__":
    main()
