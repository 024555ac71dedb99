"""The bench's report: a markdown table of every policy's choice, a PNG chart, and per-policy summaries."""

from __future__ import annotations

import statistics

POLICIES = ("rules", "measure", "te", "always-pad", "never-pad", "torch-default")
NAMED_BACKENDS = ("flash_attn4",)  # each gets a column (its fastest candidate) where it was timed


def report_markdown(report: dict) -> str:
    meta = report["meta"]
    # Columns for the backends a user compares against by name, where the run timed them (installed).
    named = [
        b for b in NAMED_BACKENDS if any(c.startswith(b + " ") for e in report["results"] for c in e["candidates"])
    ]
    lines = [
        "# attnselect bench: every policy on real model shapes\n",
        f"{meta['device']}, {meta['date']}. TFLOP/s on useful causal work (fwd; fwd+bwd counted as 3.5x). "
        "Each cell: the policy's choice and its speed relative to the fastest candidate of that problem"
        + (f"; {', '.join(named)}: its fastest candidate, forced" if named else "")
        + ".\n",
        "| models | problem | " + " | ".join((*POLICIES, *named)) + " | fastest |",
        "|---" * (len(POLICIES) + len(named) + 3) + "|",
    ]
    for entry in report["results"]:
        cells = []
        for policy in POLICIES:
            c = entry["policies"].get(policy, {})
            mark = "*" if "was" in c else ""
            if "median_ms" in c and entry["best_ms"]:
                cells.append(f"{c['candidate']}{mark}: {c['tflops']:.3g} ({entry['best_ms'] / c['median_ms']:.0%})")
            else:
                cells.append(f"{c.get('candidate')}: {c.get('error', 'n/a')}"[:60])
        for backend in named:
            timed = [
                (name, r)
                for name, r in entry["candidates"].items()
                if name.startswith(backend + " ") and "median_ms" in r
            ]
            name, r = min(timed, key=lambda item: item[1]["median_ms"], default=(None, {}))
            cells.append(
                f"{name.partition(' ')[2]}: {r['tflops']:.3g} ({entry['best_ms'] / r['median_ms']:.0%})"
                if name and entry["best_ms"]
                else "-"
            )
        best = min(
            (r for r in entry["candidates"].items() if "median_ms" in r[1]),
            key=lambda r: r[1]["median_ms"],
            default=(None, {}),
        )
        cells.append(f"{best[0]}: {best[1].get('tflops', 0):.3g}")
        lines.append(f"| {entry.get('models', '')} | {entry['describe']} | " + " | ".join(cells) + " |")
    rechosen = [(e["describe"], p, c) for e in report["results"] for p, c in e["policies"].items() if "was" in c]
    if rechosen:
        lines.append(
            "\n\\* re-derived with the current rules on this run's timings (the rules changed after the "
            "problem was timed; `bench.rechoose`): " + "; ".join(f"{d}, {p}: was {c['was']}" for d, p, c in rechosen)
        )
    return "\n".join(lines) + "\n"


def chart(report: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = report["results"]
    fig, ax = plt.subplots(figsize=(10, 1 + len(results) * 0.42))
    height = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        values = [e["policies"].get(policy, {}).get("tflops", 0) for e in results]
        ax.barh([y + i * height for y in range(len(results))], values, height, label=policy)
    ax.set_yticks([y + 0.4 for y in range(len(results))])
    ax.set_yticklabels([_short_label(e) for e in results], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("useful TFLOP/s (causal; forward+backward counted as 3.5x the forward)")
    ax.set_title(report["meta"]["device"], fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _short_label(entry: dict) -> str:
    p = entry["problem"]
    model = (entry.get("models") or "").split(", ")[0]
    n = p["seqlen_q"]
    length = f"{n // 1024}k" if n >= 1024 else str(n)
    return f"{model} {p['layout']} {length} {'train' if p['training'] else 'infer'}"


def summary(report: dict) -> dict:
    """Per policy: the share of problems within 2% / 5% of the fastest candidate, and the worst ratio."""
    out = {}
    for policy in POLICIES:
        ratios = [
            e["best_ms"] / e["policies"][policy]["median_ms"]
            for e in report["results"]
            if e["best_ms"] and "median_ms" in e["policies"].get(policy, {})
        ]
        if ratios:
            out[policy] = {
                "problems": len(ratios),
                "within_2pct": sum(r >= 0.98 for r in ratios) / len(ratios),
                "within_5pct": sum(r >= 0.95 for r in ratios) / len(ratios),
                "median_ratio": statistics.median(ratios),
                "worst_ratio": min(ratios),
            }
    return out
