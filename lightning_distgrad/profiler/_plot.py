"""Draw a merged timeline as a picture: a lane per worker, its spans, message arrows."""

from __future__ import annotations

import json
import os

#: Span categories drawn (torch's own operator slices would hide the RPC structure).
DRAWN = ("user_annotation", "rpc_message")


def plot_timeline(trace_path: str | os.PathLike, out_path: str | os.PathLike) -> None:
    """Write a PNG of the merged trace at ``trace_path`` (see :func:`profiler.profile`).

    Example::
        >>> # xdoctest: +SKIP
        >>> plot_timeline("trace.json", "timeline.png")
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing a timeline needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(trace_path) as f:
        trace = json.load(f)
    names = trace.get("otherData", {}).get("workers") or sorted(
        {e["pid"] for e in trace["traceEvents"] if isinstance(e.get("pid"), int)}
    )
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in DRAWN]
    flows = {}
    for e in trace["traceEvents"]:
        if e.get("ph") in ("s", "f") and e.get("cat") == "rpc_message":
            flows.setdefault(e["id"], {})[e["ph"]] = e
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(names)))
    for e in spans:
        lane = len(names) - 1 - e["pid"]
        height = 0.25 if e.get("cat") == "rpc_message" else 0.6
        color = "tab:red" if e.get("cat") == "rpc_message" else "tab:blue"
        ax.broken_barh(
            [(e["ts"] / 1000, max(e.get("dur", 0) / 1000, 0.002))],
            (lane - height / 2, height),
            color=color,
            alpha=0.6,
        )
    for pair in flows.values():
        if "s" in pair and "f" in pair:
            s, f = pair["s"], pair["f"]
            ax.annotate(
                "",
                xy=(f["ts"] / 1000, len(names) - 1 - f["pid"]),
                xytext=(s["ts"] / 1000, len(names) - 1 - s["pid"]),
                arrowprops={"arrowstyle": "->", "color": "tab:gray", "lw": 0.6},
            )
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(list(reversed([str(n) for n in names])))
    ax.set_xlabel("time (ms)")
    ax.set_title("RPC timeline: spans per worker, arrows from send to receipt")
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
