#!/usr/bin/env python3
"""Plots step_bench results: per scenario, the step time of the overlapped
schedule (the scenario's own: exact or speculative), of "delayed" and of the
sequential one beside the bound (top, seconds, log scale), and ratio_to_bound
with the issue's 1.10 target (bottom).

    /usr/bin/python3 scripts/plot_step_bench.py OUT.png RESULT.json [RESULT.json ...]

Several JSON files (one step_bench run each) are drawn as one figure, in the
order given; a scenario that appears in several (a run with --overlap delayed
beside the default one) is one group of bars, its sequential schedule from
the first file. Needs matplotlib (Debian: python3-matplotlib); the benchmark
itself does not.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SCHEDULES = [("overlapped", "#1f77b4"), ("delayed", "#2ca02c"), ("sequential", "#ff7f0e")]
TARGET = 1.10


def load(paths):
    rows = []
    index = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for sc in doc["scenarios"]:
            by = {s["schedule"]: s for s in sc["schedules"]}
            name = sc["scenario"]
            if "speculative" in by and "overlapped" not in by:  # the nvme scenarios' own schedule
                by["overlapped"] = by.pop("speculative")
            if name in index:  # the same scenario again: add its other schedules
                known = rows[index[name]][2]
                for k, v in by.items():
                    known.setdefault(k, v)
                continue
            index[name] = len(rows)
            rows.append((name, sc, by))
    return rows


def main(argv):
    if len(argv) < 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out, paths = argv[1], argv[2:]
    rows = load(paths)
    if not rows:
        print("plot_step_bench: no scenarios in the input", file=sys.stderr)
        return 1
    n = len(rows)
    present = [k for k in SCHEDULES if any(k[0] in by for _, _, by in rows)]
    width = 0.8 / len(present)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7.0, 1.5 * n + 2), 7.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    xs = list(range(n))
    for k, (name, color) in enumerate(present):
        offset = (k - (len(present) - 1) / 2) * width
        steps, ratios = [], []
        for _, _, by in rows:
            s = by.get(name)
            steps.append(s["step_s"] if s else 0.0)
            ratios.append(s["ratio_to_bound"] if s else 0.0)
        pos = [x + offset for x in xs]
        label = "exact / speculative" if name == "overlapped" else name
        top.bar(pos, steps, width, color=color, label=f"{label} step time")
        bars = bottom.bar(pos, ratios, width, color=color, label=label)
        for b, r in zip(bars, ratios):
            bottom.annotate(f"{r:.2f}", (b.get_x() + b.get_width() / 2, r), ha="center", va="bottom", fontsize=8)
    # The bound of each schedule, as a black tick over its bar.
    for x, (_, _, by) in zip(xs, rows):
        for k, (name, _) in enumerate(present):
            s = by.get(name)
            if not s:
                continue
            left = x + (k - len(present) / 2) * width
            top.hlines(s["bound_s"], left, left + width, colors="black", linewidth=2.5,
                       label="bound (busiest resource, isolated)" if x == 0 and k == 0 else None)
    top.set_yscale("log")
    top.set_ylabel("seconds per step (median)")
    top.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    top.grid(axis="y", which="both", alpha=0.3)
    bottom.axhline(TARGET, color="red", linestyle="--", linewidth=1, label=f"target {TARGET:.2f}")
    bottom.axhline(1.0, color="black", linewidth=0.8)
    bottom.set_ylabel("step time / bound")
    top_ratio = max([TARGET] + [s["ratio_to_bound"] for _, _, by in rows for s in by.values()])
    bottom.set_ylim(0, 1.2 * top_ratio)
    bottom.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    bottom.grid(axis="y", alpha=0.3)
    labels = []
    for name, sc, by in rows:
        s = by.get("overlapped") or next(iter(by.values()))
        labels.append(f"{name}\n{sc['placement']}, {sc['precision']}\n{s['busiest']} > {s['second']} "
                      f"({s['second_to_busiest']:.2f})")
    bottom.set_xticks(xs)
    bottom.set_xticklabels(labels, fontsize=8)
    fig.suptitle("step_bench: step time against its bound", y=0.995)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
