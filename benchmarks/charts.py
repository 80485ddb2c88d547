"""The results as charts: one small chart per question a user asks, ours beside its anchors on
a linear axis in units a user knows, each naming the machine, MPI and torch it was measured
on. ``report.py`` draws them from ``results/*.json``; a chart whose results are missing is
skipped, so a later run of a benchmark redraws what it measured."""

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from _harness import FLOOR, TP, mpi_name

OURS, IPC, STAGED = "ours", "ours, CUDA IPC", "ours, staged through host memory"
COLORS = {OURS: "tab:blue", IPC: "tab:blue", STAGED: "lightsteelblue", TP: "tab:orange"}
COLORS[FLOOR] = "lightsteelblue"
BOUNDS = ("4 log2(n) + 4", "4 KiB")  # many_ranks' targets, drawn as limits
COLORS |= dict.fromkeys(BOUNDS, "tab:red")
COLORS |= dict.fromkeys(["raw MPI", "raw MPI Send+Recv", "mpi4py request/reply loop"], "tab:gray")
SCALE = {"us": 1e6, "ms": 1e3, "s": 1.0, "GB/s": 1.0, "req/s": 1.0, "frames": 1.0, "B": 1.0}


@dataclass
class Chart:
    """``results/charts/<name>.png``: the question it answers as its title, a ``sentence``
    for the README saying what it shows, and ``draw(question, docs)``, which draws it from the
    result documents of ``benchmark`` (at least one)."""

    name: str
    benchmark: str
    question: str
    sentence: str
    draw: Callable[[str, list[dict]], object]

    def figure(self, docs: list[dict]):
        """The chart of ``docs``' results (a matplotlib figure), None if they have none."""
        mine = results(docs, self.benchmark)
        return self.draw(self.question, mine) if mine else None


def setup(doc: dict) -> dict[str, str]:
    """Where a result was measured: machine, MPI, torch, and the day."""
    e = doc["env"]
    machine = f"{e['host']}, {e['cpus']} CPUs" + (f", {doc['gpu']}" if doc.get("gpu") else "")
    mpi = mpi_name(e["mpi_library"]) + (f", {e['nodes']} nodes" if e["nodes"] > 1 else "")
    quick = " (--quick run)" if e["quick"] else ""
    return {
        "machine": machine,
        "mpi": mpi,
        "torch": f"torch {e['torch']}",
        "date": e["date"][:10] + quick,
    }


def describe(docs: list[dict]) -> tuple[str, list[str]]:
    """What all ``docs`` were measured on (a chart's subtitle), and what tells each apart
    (its label, a line each: the MPI, then the machine or torch where they differ)."""
    setups = [setup(d) for d in docs]
    common = {k: v for k, v in setups[0].items() if all(s[k] == v for s in setups)}
    labels = [
        "\n".join([s["mpi"], *(s[k] for k in ("machine", "torch") if k not in common)])
        for s in setups
    ]
    shared = [common[k] for k in ("machine", "mpi", "torch") if k in common]
    return "measured on " + ", ".join([*shared, days(docs)]), labels


def days(docs: list[dict]) -> str:
    """The day ``docs`` were measured on, or the first and the last."""
    dates = sorted({setup(d)["date"] for d in docs})
    return dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"


def order(doc: dict) -> tuple:
    """Result documents sort one node before several, fewer CPUs first, MPICH before Open MPI."""
    return doc["env"]["nodes"], doc["env"]["cpus"], setup(doc)["mpi"]


def results(docs: list[dict], name: str) -> list[dict]:
    """``name``'s result documents, in :func:`order`."""
    return sorted((d for d in docs if d["name"] == name), key=order)


def value(doc: dict, metric: str, anchor: str | None = None) -> float | None:
    """Ours (``anchor`` None) or the anchor named ``anchor`` of the row named ``metric``."""
    for r in doc["rows"]:
        if r["metric"] == metric and (anchor is None or r["anchor_name"] == anchor):
            return r["ours"] if anchor is None else r["anchor"]
    return None


def figure(question: str, subtitle: str, panels: int = 1, sharey: bool = False):
    """A figure of ``panels`` side by side under the question and where it was measured."""
    import matplotlib.pyplot as plt

    size = (3.9 * panels + 1.2, 3.6)
    fig, axes = plt.subplots(1, panels, figsize=size, squeeze=False, sharey=sharey)
    fig.text(0.5, 0.97, question, ha="center", va="top", fontsize=11, fontweight="bold")
    fig.text(0.5, 0.90, subtitle, ha="center", va="top", fontsize=8, color="dimgray")
    return fig, list(axes[0])


def bars(ax, groups: list[str], series: dict[str, list[float | None]], unit: str) -> None:
    """Grouped bars, one group per entry of ``groups``, each bar labelled with its value in
    ``unit``."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        shown = [(x, v * SCALE[unit]) for x, v in zip(xs, values, strict=True) if v is not None]
        if not shown:
            continue
        drawn = ax.bar(
            [x for x, _ in shown], [v for _, v in shown], width, label=name, color=COLORS.get(name)
        )
        # More than 9 bars in a panel are too narrow for their labels: these stand upright.
        upright = 90 if len(series) * len(groups) > 9 else 0
        ax.bar_label(drawn, [f"{v:.3g}" for _, v in shown], fontsize=7, padding=1, rotation=upright)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.margins(y=0.12)


def lines(ax, xs: list, series: dict[str, list[float | None]], unit: str) -> None:
    """One line per series over the categories ``xs`` (equally spaced), in ``unit``; gaps
    where None."""
    for name, values in series.items():
        ys = [float("nan") if v is None else v * SCALE[unit] for v in values]
        ax.plot(range(len(xs)), ys, "o-", label=name, color=COLORS.get(name), ms=4)
    ax.set_xticks(range(len(xs)), [str(x) for x in xs], fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def finish(fig, axes, xlabel: str, ylabel: str | None) -> object:
    """Axis labels (y once where the panels share it; None: as the panels have it), the
    first panel's legend under the panels (over them it hides bars), y from 0 (once every
    panel is drawn: a shared axis then spans them all)."""
    handles, labels = axes[0].get_legend_handles_labels()
    rows = -(-len(labels) // 2)
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.set_xlabel(xlabel)
        if ylabel and (ax is axes[0] or not ax.get_shared_y_axes().joined(ax, axes[0])):
            ax.set_ylabel(ylabel)
    fig.tight_layout(rect=(0, 0.065 * rows, 1, 0.86))
    return fig


# --- the kinds of chart -------------------------------------------------------------------


def matching(doc: dict, pattern: str) -> dict[str, str]:
    """``{what pattern's group caught (or the metric): metric}`` of the rows of ``doc`` whose
    metric matches ``pattern``, in the rows' order."""
    found = (re.fullmatch(pattern, r["metric"]) for r in doc["rows"])
    return {(m[1] if m.re.groups else m[0]): m[0] for m in found if m}


def anchors(doc: dict, metric: str) -> list[str]:
    """The anchors that ``doc`` measured ``metric`` beside, in the rows' order."""
    return list(dict.fromkeys(r["anchor_name"] for r in doc["rows"] if r["metric"] == metric))


def bars_by_setup(question: str, docs: list[dict], pattern: str, unit: str, ylabel: str):
    """A panel per metric matching ``pattern`` (titled with its group, if the pattern has
    one); in each, a group of bars per result document: ours and every anchor of the metric."""
    subtitle, labels = describe(docs)
    metrics = matching(docs[0], pattern)
    fig, axes = figure(question, subtitle, len(metrics))
    for ax, (caught, metric) in zip(axes, metrics.items(), strict=True):
        series = {OURS: [value(d, metric) for d in docs]}
        series |= {a: [value(d, metric, a) for d in docs] for a in anchors(docs[0], metric)}
        bars(ax, labels, series, unit)
        if caught != metric:
            ax.set_title(caught, fontsize=9)
    return finish(fig, axes, "", ylabel)


def lines_by_setup(
    question: str, docs: list[dict], pattern: str, unit: str, xlabel: str, ylabel: str
):
    """A panel per result document (sharing the y axis); in each, a line for ours and for
    every anchor over what ``pattern``'s group catches (sizes, ranks, trainers)."""
    subtitle, labels = describe(docs)
    fig, axes = figure(question, subtitle, len(docs), sharey=True)
    for ax, doc, label in zip(axes, docs, labels, strict=True):
        metrics = matching(doc, pattern)
        names = dict.fromkeys(a for m in metrics.values() for a in anchors(doc, m))
        series = {OURS: [value(doc, m) for m in metrics.values()]}
        series |= {a: [value(doc, m, a) for m in metrics.values()] for a in names}
        lines(ax, list(metrics), series, unit)
        ax.set_title(label, fontsize=9)
    return finish(fig, axes, xlabel, ylabel)


def cuda_variants(question: str, docs: list[dict]):
    """CUDA tensors: the echo's throughput and the design-note iteration, each by size, for
    ours over CUDA IPC, ours staged (the rows ``..., IPC off``) and TensorPipe."""
    doc = docs[-1]
    fig, axes = figure(question, describe([doc])[0], 2)
    panels = [
        (r"rpc_sync echo (\S+ \S+) on GPU: throughput", "GB/s", "rpc_sync echo, GB/s"),
        (r"design-note iteration (\S+) on GPU", "ms", "design-note iteration, ms"),
    ]
    for ax, (pattern, unit, ylabel) in zip(axes, panels, strict=True):
        sizes = matching(doc, pattern)
        series = {IPC: [value(doc, m) for m in sizes.values()]}
        series[STAGED] = [value(doc, f"{m}, IPC off") for m in sizes.values()]
        series[TP] = [value(doc, m, TP) for m in sizes.values()]
        bars(ax, list(sizes), series, unit)
        ax.set_ylabel(ylabel)
    return finish(fig, axes, "tensor size", None)


def per_rank_costs(question: str, docs: list[dict]):
    """Many ranks: what a rank sends in shutdown and receives in init_rpc, with their bounds,
    and its CPU seconds over the whole job, ours beside TensorPipe, against the rank count."""
    doc = docs[-1]
    fig, axes = figure(question, describe([doc])[0], 3)
    panels = [  # the first panel's ours and TensorPipe make the figure's legend
        (r"CPU, (\d+) ranks", "s", "CPU seconds per rank"),
        (r"frames a rank sends in shutdown, (\d+) ranks", "frames", "frames sent in shutdown"),
        (r"bytes a rank receives in init_rpc, (\d+) ranks", "B", "bytes received in init_rpc"),
    ]
    for ax, (pattern, unit, ylabel) in zip(axes, panels, strict=True):
        metrics = matching(doc, pattern)
        names = dict.fromkeys(a for m in metrics.values() for a in anchors(doc, m))
        series = {OURS: [value(doc, m) for m in metrics.values()]}
        series |= {a: [value(doc, m, a) for m in metrics.values()] for a in names}
        lines(ax, list(metrics), series, unit)
        bounds = [line for line in ax.get_lines() if line.get_label() in BOUNDS]
        for line in bounds:
            line.set_linestyle("--")
        if bounds:
            ax.legend(handles=bounds, fontsize=7, frameon=False, loc="center right")
        ax.set_ylabel(ylabel)
    return finish(fig, axes, "ranks", None)


# --- the charts ------------------------------------------------------------------------------

CHARTS = [
    Chart(
        "latency",
        "rpc_latency",
        "How long does a small RPC take?",
        "The round trip of an 8-byte `rpc_sync(torch.add)` between two ranks, in microseconds:"
        " ours, TensorPipe started in the same MPI job, an 8-byte MPI send and receive (what"
        " the MPI itself costs), and the same call's two messages pickled, framed and sent by one"
        " thread a side with no agent around them (what the messages' Python alone costs).",
        partial(
            bars_by_setup,
            pattern=r"8 B rpc_sync\(torch\.add\) round trip",
            unit="us",
            ylabel="round trip, µs",
        ),
    ),
    Chart(
        "bandwidth",
        "bandwidth",
        "How fast do large tensors travel?",
        "The throughput of an `rpc_sync` echo of a float32 tensor between two ranks of one"
        " machine (2 x its bytes / round trip), in GB/s, by tensor size: ours, TensorPipe (up"
        " to 1 GiB) and MPI `Send`/`Recv` between buffers allocated beforehand.",
        partial(
            lines_by_setup,
            pattern=r"rpc_sync echo (\S+ \S+): throughput",
            unit="GB/s",
            xlabel="tensor size",
            ylabel="GB/s",
        ),
    ),
    Chart(
        "design_note",
        "design_note",
        "How long does a distributed autograd iteration take?",
        "One iteration of the distributed autograd design note's example (two RPCs forward,"
        " the distributed backward pass through both) on 3x3 and 1024x1024 tensors, in"
        " milliseconds: ours and TensorPipe, the median of 5 jobs.",
        partial(
            bars_by_setup,
            pattern=r"iteration (\S+), median of \d+ jobs",
            unit="ms",
            ylabel="one iteration, ms",
        ),
    ),
    Chart(
        "scaling",
        "scaling",
        "Does a call cost more with more ranks?",
        "Every rank calling every other with `rpc_async` (8-byte `torch.add`, 8 calls in"
        " flight), the time per call (the wall time over all ranks' calls) in microseconds at"
        " 2 to 16 ranks: ours and a minimal mpi4py request/reply loop making the same exchange"
        " (where ranks outnumber cores, they share them).",
        partial(
            lines_by_setup,
            pattern=r"rpc_async all-to-all, (\d+) ranks",
            unit="us",
            xlabel="ranks",
            ylabel="per call, µs",
        ),
    ),
    Chart(
        "many_ranks",
        "many_ranks",
        "What do starting and ending RPC cost each rank as the job grows?",
        "At 8 to 64 ranks on one machine (oversubscribed: the ranks share its cores), a rank's"
        " CPU seconds over a job of `init_rpc`, a neighbour call, a two-rank backward pass and"
        " `shutdown()` (ours, and TensorPipe where it started), the frames it sends in"
        " `shutdown()` beside the bound 4 log2(n) + 4, and the bytes it receives in `init_rpc`"
        " beside 4 KiB.",
        per_rank_costs,
    ),
    Chart(
        "param_server",
        "param_server",
        "How many requests does a parameter server answer?",
        "Requests a second that one parameter server answers for 1 to 7 trainers, each step of"
        " a trainer fetching the parameters and pushing its gradients (two `rpc_sync` calls):"
        " ours and TensorPipe.",
        partial(
            lines_by_setup,
            pattern=r"(\d+) trainer\(s\), requests/s",
            unit="req/s",
            xlabel="trainers",
            ylabel="requests/s",
        ),
    ),
    Chart(
        "cuda",
        "cuda_rpc",
        "How fast do CUDA tensors travel?",
        "CUDA tensors between two ranks sharing one GPU: the `rpc_sync` echo's throughput in"
        " GB/s and the design note's iteration in milliseconds, for ours over CUDA IPC, ours"
        " staged through host memory (`LIGHTNING_DISTGRAD_CUDA_IPC=0`) and TensorPipe.",
        cuda_variants,
    ),
]
