"""Does the self-check's saved-tensor hook change flex's training compile? Grid rows judged as the correctness grid
judges them (benchmarks/correctness_grid.py judge_candidate, flex unpadded, or ``--backend``), with the self-check's
rerun under four pack hooks, each (row, hook) in a fresh process, which counts the tensors its hook packed:

- ``detached``: the library's (attnselect.self_check.judge packs saved tensors detached);
- ``as themselves``: the hook before d486533 (``lambda t: t``), which kept graphs alive;
- ``Tensor.detach``: ``torch.Tensor.detach`` itself, a method rather than a Python function (d486533's first form);
- ``none``: no hook at all.

    python benchmarks/flex_hooks_probe.py --ids 17,11,4 --timeout 300 --out results/h200_flex_hooks_probe

A process that runs past ``--timeout`` is killed (with inductor's compile workers); its row says the stage it had
reached. Each process writes to its own files (a full pipe would stall it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HOOKS = ("detached", "as themselves", "Tensor.detach", "none")


def child(row_id: int, hook: str, backend: str) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import correctness_grid as grid

    os.environ["ATTNSELECT_ALLOWLIST"] = "0"
    os.environ["ATTNSELECT_SELF_CHECK"] = "0"
    from attnselect.spec.options import Candidate

    real, packed = torch.autograd.graph.saved_tensors_hooks, [0]

    def counted(pack):
        def counting(t):
            packed[0] += 1
            return pack(t)

        return counting

    variants = {
        "detached": lambda pack, unpack: real(counted(pack), unpack),  # the library's own hook, counted
        "as themselves": lambda pack, unpack: real(counted(lambda t: t), lambda t: t),
        "Tensor.detach": lambda pack, unpack: real(counted(torch.Tensor.detach), lambda t: t),
        "none": lambda pack, unpack: contextlib.nullcontext(),
    }
    torch.autograd.graph.saved_tensors_hooks = variants[hook]  # self_check.judge looks it up when it runs
    row = next(r for r in grid.rows() if r["id"] == row_id)
    problem, q, k, v, packing = grid.build(row, "cuda" if torch.cuda.is_available() else "cpu")
    print(json.dumps({"stage": "compiling and judging", "at": time.time()}), flush=True)
    started = time.perf_counter()
    found = grid.judge_candidate(problem, Candidate(backend), q, k, v, packing)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    status = "passed" if found["passed"] else (found["error"] or f"wrong: {found.get('failures')}")
    print(json.dumps({"status": status, "seconds": round(time.perf_counter() - started, 1), "packed": packed[0]}),
          flush=True)  # fmt: skip


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")] if path.exists() else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ids", default="17,11,4")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="flex", help="the candidate judged, unpadded")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(int(a.child[0]), a.child[1], a.backend)
        return
    import torch

    import attnselect

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import correctness_grid as grid

    ids = [int(i) for i in a.ids.split(",")]
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "1"))
    logs = Path(tempfile.mkdtemp(prefix="flex_hooks_probe_"))
    started = time.time()
    procs = {}
    for i in ids:
        for hook in HOOKS:
            name = f"{i}-{hook.replace(' ', '_')}"
            with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
                command = [sys.executable, __file__, "--out", a.out, "--backend", a.backend, "--child", str(i), hook]
                procs[i, hook] = (
                    name,
                    subprocess.Popen(command, stdout=out, stderr=err, env=env, start_new_session=True),
                )

    def kill_the_unfinished() -> None:  # at the deadline, every process still running, whichever is waited for
        for _, proc in procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # inductor's compile workers too

    watchdog = threading.Timer(max(0.0, started + a.timeout - time.time()), kill_the_unfinished)
    watchdog.start()
    rows = []
    for (i, hook), (name, proc) in procs.items():
        proc.wait()
        lines = _lines(logs / f"{name}.out")
        results = [x for x in lines if "status" in x]
        stages = [x for x in lines if "stage" in x]
        if results:  # it finished, whether or not the timeout came before its exit
            result = results[-1]
        elif proc.returncode == -signal.SIGKILL:
            stage = stages[-1] if stages else {"stage": "starting", "at": started}
            result = {"status": f"killed at {a.timeout:.0f} s while {stage['stage']}",
                      "seconds": round(time.time() - stage["at"], 1)}  # fmt: skip
        else:
            result = {"status": f"died: {(logs / f'{name}.err').read_text()[-300:]}"}
        row = next(r for r in grid.rows() if r["id"] == i)
        rows.append({"row": row, "hook": hook, **result})
        print(json.dumps(rows[-1]), flush=True)
    watchdog.cancel()
    meta = {"device": attnselect.Target.current().describe(), "torch": torch.__version__, "date": time.strftime("%F"),
            "processes_at_once": len(procs), "compile_threads": env["TORCHINDUCTOR_COMPILE_THREADS"],
            "backend": a.backend}  # fmt: skip
    Path(a.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"# {a.backend} training in the self-check's rerun, by saved-tensor hook\n",
        f"{meta['device']}, {meta['date']}. Produced by `benchmarks/flex_hooks_probe.py`: each (row, hook) in a fresh "
        f"process, {len(procs)} at once, TORCHINDUCTOR_COMPILE_THREADS={meta['compile_threads']}; {a.backend} "
        "unpadded, "
        "judged as the correctness grid judges it; seconds include the compile; packed: the tensors the hook packed.\n",
        "| row | pair | gqa | layout | mask | dtype | size | hook | status | seconds | packed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        w = r["row"]
        lines.append(
            f"| {w['id']} | {w['pair'][0]}/{w['pair'][1]} | {w['gqa']} | {w['layout']} | {w['mask']} | {w['dtype']} "
            f"| {w['size']} | {r['hook']} | {r['status'][:160]} | {r.get('seconds', '')} | {r.get('packed', '')} |"
        )
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
