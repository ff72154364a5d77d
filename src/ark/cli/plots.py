"""Paper-ready figures from sweep records (CLI layer: the library never plots)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib import ticker

STYLE = {
    "ecmp": dict(color="#d62728", marker="o", label="ECMP"),
    "ark": dict(color="#1f77b4", marker="s", label="ARK"),
    "ark-balance": dict(color="#2ca02c", marker="^", label="ARK-balance"),
    "spray": dict(color="#7f7f7f", marker="x", linestyle="--", label="ideal spray"),
    "ark-split": dict(color="#17becf", marker="D", label="ARK-split"),
    "ecmp-split": dict(color="#ff7f0e", marker="v", linestyle=":", label="ECMP-split"),
    "plb": dict(color="#9467bd", marker="P", linestyle="-.", label="PLB"),
    "letflow": dict(color="#8c564b", marker="*", linestyle="-.", label="LetFlow"),
    "conga": dict(color="#e377c2", marker="h", linestyle="-.", label="CONGA"),
    "hedera": dict(color="#bcbd22", marker="X", linestyle="-.", label="Hedera"),
    "oracle-path": dict(color="#000000", marker=".", linestyle=":", label="single-path oracle"),
}


def seeds_text(records: Sequence[dict[str, Any]]) -> str:
    """``seeds 0, 1, 2`` (or ``seed 4``): which runs a figure averages or pools."""
    seeds = sorted({int(r["seed"]) for r in records})
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


def log_axis(ax: Any, axis: str = "y") -> None:
    """A log axis whose ticks read as plain numbers (0.2, 0.5, 1, 2, 5), never 2x10^0."""
    target = ax.yaxis if axis == "y" else ax.xaxis
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    lo, hi = ax.get_ylim() if axis == "y" else ax.get_xlim()  # call once the data are drawn
    wide = lo > 0 and np.log10(hi / lo) > 2.5  # 1, 2, 5 per decade would crowd: 1 per decade
    target.set_major_locator(ticker.LogLocator(base=10, subs=(1.0,) if wide else (1.0, 2.0, 5.0), numticks=12))
    target.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    target.set_minor_formatter(ticker.NullFormatter())


def legend_outside(fig: Any, ax: Any, ncol: int = 1) -> None:
    """The legend in a column right of the plots, off the data."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize=8, ncol=ncol)


def _dodge(qs: Sequence[float], i: int, k: int) -> list[float]:
    """x positions of the i-th of k series, spread by a small share of the closest QPS gap, so
    that schemes with equal values do not hide one another."""
    gaps = np.diff(sorted(set(qs)))
    step = 0.5 * float(gaps.min()) / max(k, 1) if len(gaps) else 0.1
    return [q + (i - (k - 1) / 2) * step for q in qs]


def _series(records: Sequence[dict[str, Any]], scheme: str, metric: str) -> tuple[list[float], list[float], list[float], list[float]]:
    by_q: dict[float, list[float]] = {}
    for r in records:
        if r["scheme"] == scheme:
            by_q.setdefault(r["qps"], []).append(r[metric])
    qs = sorted(by_q)
    mean = [float(np.mean(by_q[q])) for q in qs]
    lo = [float(np.min(by_q[q])) for q in qs]
    hi = [float(np.max(by_q[q])) for q in qs]
    return qs, mean, lo, hi


def _metric_figure(records: Sequence[dict[str, Any]], metrics: Sequence[tuple[str, str]], path: Path, title: str) -> Path:
    schemes = [s for s in STYLE if any(r["scheme"] == s for r in records)]
    schemes += sorted({r["scheme"] for r in records} - set(schemes))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.8), squeeze=False)
    for ax, (metric, label) in zip(axes[0], metrics, strict=True):
        for i, s in enumerate(schemes):
            qs, mean, lo, hi = _series(records, s, metric)
            st = _style(s)
            err = np.array([np.subtract(mean, lo), np.subtract(hi, mean)])
            # Hollow markers, dodged sideways: a scheme equal to another stays visible.
            ax.errorbar(_dodge(qs, i, len(schemes)), mean, yerr=err, capsize=2, linewidth=1.3, markersize=5,
                        markerfacecolor="none", markeredgewidth=1.2, **st)
        ax.set_xlabel("load (QPS)")
        ax.set_ylabel(label)
        log_axis(ax)
        ax.grid(True, which="major", alpha=0.3)
    legend_outside(fig, axes[0][0])
    return _save(fig, path, title, dpi=150)


def fct_vs_qps(records: Sequence[dict[str, Any]], out: Path) -> Path:
    return _metric_figure(
        records,
        [("fct_mean_s", "mean KV-transfer FCT (s)"), ("fct_p95_s", "P95 KV-transfer FCT (s)")],
        out / "fct_vs_qps.png",
        f"KV-cache flow completion time (mean over {seeds_text(records)}; bars: min-max)",
    )


def compare_fct(records: Sequence[dict[str, Any]], out: Path) -> Path:
    return _metric_figure(
        records,
        [("fct_mean_s", "mean KV-transfer FCT (s)"), ("fct_p99_s", "P99 KV-transfer FCT (s)")],
        out / "compare_fct.png",
        f"every scheme on the same workloads (mean over {seeds_text(records)}; bars: min-max)",
    )


def ttft_vs_qps(records: Sequence[dict[str, Any]], out: Path) -> Path:
    return _metric_figure(
        records,
        [("ttft_mean_s", "mean TTFT (s)"), ("ttft_p95_s", "P95 TTFT (s)")],
        out / "ttft_vs_qps.png",
        f"Time to first token (mean over {seeds_text(records)}; bars: min-max)",
    )


def spine_concurrency(timelines: dict[str, list[tuple[float, tuple[int, ...]]]], qps: float | None, out: Path,
                      seed: int = 0, seeds: Sequence[int] = (0,)) -> Path | None:
    """Concurrent KV flows on each spine (numbered from 0, as the CLI and the records do) over
    one run per scheme: the first seed's, named in the title."""
    shown = [s for s in ("ecmp", "ark", "ark-balance") if s in timelines]
    if not shown:
        return None
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 2.6 * len(shown)), sharex=True, sharey=True, squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, s in zip(axes[:, 0], shown, strict=True):
        tl = timelines[s]
        if not tl:
            continue
        t = np.array([p[0] for p in tl])
        c = np.array([p[1] for p in tl])
        for k in range(c.shape[1]):
            ax.step(t, c[:, k], where="post", linewidth=0.9, color=colors(k), label=f"spine {k}")
        ax.set_ylabel("concurrent flows")
        peak = ", ".join(map(str, c.max(axis=0).tolist()))
        ax.set_title(f"{STYLE.get(s, {}).get('label', s)}: max per spine (0..{c.shape[1] - 1}) {peak}", fontsize=10)
        ax.grid(True, alpha=0.3)
    legend_outside(fig, axes[0, 0])
    axes[-1, 0].set_xlabel("time (s)")
    others = [x for x in seeds if x != seed]
    more = f"; the records' max_concurrent_per_spine is the max over seeds {', '.join(map(str, seeds))}" if others else ""
    where = f" at QPS {qps:g}" if qps is not None else ""
    fig.suptitle(f"KV flows on each spine over time{where}, seed {seed}{more}", fontsize=10)
    fig.tight_layout()
    path = out / "spine_concurrency.png"
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


def polarisation(rows: Sequence[dict[str, Any]], out: Path) -> Path:
    """Mean and P95 FCT vs QPS: ECMP and ARK on a polarised and on a per-switch-seeded 3-tier fabric."""
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 3.8), squeeze=False)
    for ax, (metric, label) in zip(axes[0], (("fct_mean_s", "mean KV-transfer FCT (s)"),
                                             ("fct_p95_s", "P95 KV-transfer FCT (s)")), strict=True):
        for fabric, dash in (("seed per switch", "-"), ("polarised", ":")):
            for scheme in ("ecmp", "ark"):
                rs = sorted((r for r in rows if r["fabric"] == fabric and r["scheme"] == scheme), key=lambda r: r["qps"])
                st = dict(STYLE[scheme])
                st.update(linestyle=dash, label=f"{st['label']}, {fabric}")
                ax.plot([r["qps"] for r in rs], [r[metric] for r in rs], linewidth=1.6, markersize=5,
                        markerfacecolor="none", **st)
        ax.set_xlabel("load (QPS)")
        ax.set_ylabel(label)
        log_axis(ax)
        ax.grid(True, which="major", alpha=0.3)
    legend_outside(fig, axes[0][0])
    fig.suptitle("3-tier Clos, 16 paths between pods: one hash and seed everywhere leaves 4 reachable")
    fig.tight_layout()
    path = out / "polarisation.png"
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


def control_plane(rows: Sequence[dict[str, Any]], out: Path) -> Path:
    """Per-agent control-plane CPU (busiest agent) and received messages against cluster
    size, one line per placement and dissemination (arbiter mode: replies received)."""
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 3.8))
    series = sorted({(r["placement"], r["mode"]) for r in rows})
    for placement, mode in series:
        pts = sorted((r["hosts"], r["cpu_percent_max"], r["received_per_s_max"]) for r in rows
                     if (r["placement"], r["mode"]) == (placement, mode))
        linestyle, marker = {"scoped": ("-", "s"), "arbiter": (":", "^")}.get(mode, ("--", "o"))
        style = dict(linestyle=linestyle, marker=marker, label=f"{placement}, {mode}")
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], **style)
        axes[1].plot([p[0] for p in pts], [max(p[2], 0.1) for p in pts], **style)
    axes[0].axhline(5.0, color="#7f7f7f", linewidth=0.8, linestyle=":")
    for ax, label in ((axes[0], "busiest agent's CPU (% of one core)"), (axes[1], "data messages received / s")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        log_axis(ax)
        ax.set_xlabel("hosts (GPUs)")
        ax.set_ylabel(label)
        ax.grid(True, which="major", alpha=0.3)
    legend_outside(fig, axes[0])
    fig.suptitle("reservation control plane: full broadcast, scoped dissemination, arbiter")
    fig.tight_layout()
    fig.savefig(out, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return out


def _save(fig: Any, path: Path, title: str, dpi: int = 130) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, bbox_inches="tight")  # the legend right of the plots stays in
    plt.close(fig)
    return path


def _style(scheme: str) -> dict[str, Any]:
    return dict(STYLE.get(scheme, dict(label=scheme)))


def fct_cdf(flows: dict[tuple[str, float, int], tuple[list[int], list[float], list[float]]], out: Path) -> Path:
    """FCT CDF per scheme, one panel per QPS, seeds pooled."""
    qs = sorted({k[1] for k in flows})
    schemes = list(dict.fromkeys(k[0] for k in flows))
    cols = min(4, len(qs))
    rows = -(-len(qs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, q in zip(axes.flat, qs, strict=False):
        for i, s in enumerate(schemes):
            f = np.sort(np.concatenate([np.asarray(v[2]) for k, v in flows.items() if k[0] == s and k[1] == q]))
            st = _style(s)
            # Sparse hollow markers, each scheme's at other quantiles: equal curves stay told apart.
            marks = np.linspace(0, len(f) - 1, 6).astype(int)[1:-1] + i % 4 * max(1, len(f) // 40)
            ax.plot(f, np.arange(1, len(f) + 1) / len(f), linewidth=1.2, markevery=list(np.clip(marks, 0, len(f) - 1)),
                    markersize=4, markerfacecolor="none", **st)
        log_axis(ax, "x")
        ax.set_title(f"QPS {q:g}", fontsize=10)
        ax.set_xlabel("KV-transfer FCT (s)")
        ax.set_ylabel("fraction of flows")
        ax.grid(True, which="major", alpha=0.3)
    for ax in list(axes.flat)[len(qs):]:
        ax.set_visible(False)
    legend_outside(fig, axes[0][0])
    named = seeds_text([{"seed": k[2]} for k in flows])
    return _save(fig, out / "fct_cdf.png", f"FCT distribution per scheme ({named} pooled)")


def slowdown(rows: Sequence[dict[str, Any]], out: Path, seeds: str = "seeds") -> Path | None:
    """Mean slowdown (FCT over size / NIC goodput) against flow size, per scheme."""
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    for i, s in enumerate(schemes):
        rs = [r for r in rows if r["scheme"] == s]
        x = [float(np.sqrt(r["size_lo"] * r["size_hi"])) / 1e9 for r in rs]
        # Dodged by a few percent of each bin (a log axis): equal schemes stay visible.
        x = [v * (1 + 0.025 * (i - (len(schemes) - 1) / 2)) for v in x]
        ax.plot(x, [r["slowdown"] for r in rs], linewidth=1.3, markersize=5, markerfacecolor="none", **_style(s))
    log_axis(ax, "x")
    log_axis(ax)
    ax.set_xlabel("KV-flow size (GB, bin centres)")
    ax.set_ylabel("mean slowdown (FCT / ideal)")
    ax.grid(True, which="major", alpha=0.3)
    legend_outside(fig, ax)
    return _save(fig, out / "slowdown.png", f"slowdown against flow size at QPS {rows[0]['qps']:g} ({seeds} pooled)")


def race_window(rows: Sequence[dict[str, Any]], schemes: Sequence[str], out: Path, placement: str) -> Path:
    """ARK's gain over ECMP and races per 1,000 flows against the one-way control delay."""
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 3.8))
    for s in schemes:
        rs = sorted((r for r in rows if r["scheme"] == s and r["sweep"] == "delay"), key=lambda r: r["delay_us"])
        st = _style(s)
        axes[0].plot([r["delay_us"] for r in rs], [100 * r["gain_vs_ecmp"] for r in rs], **st)
        axes[1].plot([r["delay_us"] for r in rs], [max(r["races_per_1000"], 0.1) for r in rs], **st)
    axes[0].axhline(0.0, color="#7f7f7f", linewidth=0.8)
    for ax, label in ((axes[0], "mean-FCT gain over ECMP (%)"), (axes[1], "races per 1,000 flows (0 drawn at 0.1)")):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("one-way control-plane delay (us)")
        ax.set_ylabel(label)
        ax.grid(True, which="major", alpha=0.3)
    log_axis(axes[1])
    legend_outside(fig, axes[0])
    return _save(fig, out / "race_window.png", f"the race window: {placement}")


def scaling(rows: Sequence[dict[str, Any]], out: Path) -> Path:
    """CPU time, wall time and peak memory of the scale benchmark against GPUs (at each
    request count run at several GPU counts) and against requests (at each GPU count run
    with several)."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11.0, 4.2))
    for scheme in sorted({r["scheme"] for r in rows}):
        mine = [r for r in rows if r["scheme"] == scheme]
        for axis, fixed, ax in (("gpus", "requests", axes[0]), ("requests", "gpus", axes[1])):
            for value in sorted({r[fixed] for r in mine}):
                pts = sorted((r[axis], r["cpu_s"], r["wall_s"], r["peak_rss_mb"]) for r in mine if r[fixed] == value)
                if len(pts) < 2:
                    continue
                label, color = f"{scheme}, {value:,} {fixed}", _style(scheme).get("color")
                xs = [p[0] for p in pts]
                ax.plot(xs, [p[1] for p in pts], marker="o", label=f"{label}: CPU s", color=color)
                ax.plot(xs, [p[2] for p in pts], marker=".", linestyle="--", linewidth=0.8, alpha=0.6,
                        label=f"{label}: wall s", color=color)
                ax.plot(xs, [p[3] for p in pts], marker="s", linestyle=":", label=f"{label}: peak MB", color=color)
                ax.set_xticks(xs)
    for ax, label in ((axes[0], "GPUs"), (axes[1], "requests")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(label)
        ax.set_ylabel("seconds (CPU, wall) / peak memory (MB)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(frameon=False, fontsize=6.5)
    fig.suptitle("the fluid simulator's cost: 3-tier pods of 128 GPUs, offered load about 0.76")
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out
