#!/usr/bin/python3
"""Draws a strata.trace (Chrome trace-event JSON) as one row per track.

Usage: plot_trace.py OUT.png TRACE.json [--last-steps N]

With --last-steps N, shows the window from the N-th last "fetch <first group>"
span on the step track to the end (the last N steps when the framework
fetches the first group once per forward)."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, path = argv[1], argv[2]
    last = int(argv[argv.index("--last-steps") + 1]) if "--last-steps" in argv else 0
    with open(path) as f:
        data = json.load(f)
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e.get("ph") == "M" and "tid" in e}
    spans = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    if not spans:
        print(f"{path}: no spans", file=sys.stderr)
        return 1
    start = min(e["ts"] for e in spans)
    if last > 0:
        first_group = min((e for e in spans if e["tid"] == 1 and e["name"].startswith("fetch ")),
                          key=lambda e: e["ts"])["name"]
        starts = sorted(e["ts"] for e in spans if e["tid"] == 1 and e["name"] == first_group)
        if len(starts) >= last:
            start = starts[-last]
    spans = [e for e in spans if e["ts"] + e["dur"] >= start]
    tids = sorted({e["tid"] for e in spans})
    fig, ax = plt.subplots(figsize=(14, 0.5 * len(tids) + 1.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, tid in enumerate(tids):
        bars = [((max(e["ts"], start) - start) / 1e3, e["dur"] / 1e3) for e in spans if e["tid"] == tid]
        ax.broken_barh(bars, (row - 0.4, 0.8), color=colors[row % len(colors)])
    ax.set_yticks(range(len(tids)))
    ax.set_yticklabels([names.get(t, str(t)) for t in tids])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.set_title(path.split("/")[-1])
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
