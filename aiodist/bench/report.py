"""Turning per-rank timings into nccl-tests tables, latency rows, target verdicts and a plot."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aiodist.bench import cases
from aiodist.bench.worker import STREAM_BURST

__all__ = [
    "Result",
    "aggregate",
    "format_latency",
    "format_memory",
    "format_spread",
    "format_table_header",
    "format_table_row",
    "format_targets",
    "plot",
    "targets",
]

Result = dict[str, Any]
_GB = 1e9
MiB = 1 << 20


def _median_of_slowest(per_rank: Sequence[Sequence[float]]) -> tuple[float, list[float]]:
    """Per repetition the slowest rank's time; the median over repetitions (and the list)."""
    reps = [max(ts) for ts in zip(*per_rank, strict=True)]
    return statistics.median(reps), reps


def aggregate(op: str, nbytes: int, count: int, n: int, reports: Sequence[dict[str, Any]]) -> Result:
    """One table row from every rank's report of one case."""
    row: Result = {"op": op, "size": count * 4 if count else nbytes, "count": count, **cases.describe(op)}
    impls: dict[str, Any] = {}
    for name in reports[0]:
        t, reps = _median_of_slowest([r[name][0] for r in reports])
        wrong = sum(int(r[name][1]) for r in reports)
        algbw = row["size"] / t / _GB if t > 0 else 0.0
        impls[name] = {
            "time_us": t * 1e6,
            "min_us": min(reps) * 1e6,
            "max_us": max(reps) * 1e6,
            "algbw": algbw,
            "busbw": algbw * cases.busbw_factor(op, n),
            "wrong": wrong,
            "reps_us": [x * 1e6 for x in reps],
        }
    row["impls"] = impls
    if "gloo" in impls and "aiodist" in impls and impls["aiodist"]["time_us"] > 0:
        row["speedup"] = impls["gloo"]["time_us"] / impls["aiodist"]["time_us"]
    return row


def latency_row(op: str, nbytes: int, n: int, reports: Sequence[dict[str, Any]]) -> Result:
    """A latency row: µs per call (ping-pong: one way; stream: per message)."""
    scale = 0.5 if op == "pingpong" else 1.0 / STREAM_BURST if op == "stream" else 1.0
    row: Result = {"case": _latency_name(op, nbytes), "op": op, "size": nbytes, "impls": {}}
    for name in reports[0]:
        t, reps = _median_of_slowest([r[name][0] for r in reports])
        row["impls"][name] = {
            "time_us": t * scale * 1e6,
            "min_us": min(reps) * scale * 1e6,
            "max_us": max(reps) * scale * 1e6,
            "reps_us": [x * scale * 1e6 for x in reps],
        }
    if "gloo" in row["impls"]:
        row["ratio"] = row["impls"]["aiodist"]["time_us"] / row["impls"]["gloo"]["time_us"]
    return row


def _latency_name(op: str, nbytes: int) -> str:
    return {
        "all_reduce": f"all_reduce {nbytes} B",
        "barrier": "barrier",
        "pingpong": f"ping-pong {nbytes} B one-way",
        "stream": f"stream of {nbytes} B sends, each",
    }.get(op, op)


# -- text -----------------------------------------------------------------------------------------

_SPREAD_W = 15
_IMPL_COLS = f"{'time(us)':>10} {'min-max(us)':>{_SPREAD_W}} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
_IMPL_W = len(_IMPL_COLS)


def format_spread(res: dict[str, Any]) -> str:
    """``min-max`` of the repetitions (µs per call), as many digits as the size of the figures needs."""
    lo, hi = res.get("min_us"), res.get("max_us")
    if lo is None or hi is None:  # a run saved before the spread was recorded: from its repetitions
        reps = res.get("reps_us")
        if not reps:
            return "-"
        lo, hi = min(reps), max(reps)
    digits = 1 if hi < 1000 else 0
    return f"{lo:.{digits}f}-{hi:.{digits}f}"


def format_table_header(op: str, impls: Sequence[str]) -> str:
    left = f"{'size':>12} {'count':>10} {'type':>6} {'redop':>5} {'root':>4}"
    names = "".join(f" {'-- ' + name + ' ':-<{_IMPL_W}}" for name in impls)
    cols = "".join(f" {_IMPL_COLS}" for _ in impls)
    units = "".join(f" {'':>10} {'':>{_SPREAD_W}} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}" for _ in impls)
    extra = f" {'speedup':>7}" if "gloo" in impls else ""
    pad = " " * len(left)
    lines = [f"#{pad[1:]}{names}", f"#{left[1:]}{cols}{extra}", f"#{pad[1:]}{units}".rstrip()]
    return f"# {op}\n" + "\n".join(lines)


def format_table_row(row: Result) -> str:
    s = f"{row['size']:>12} {row['count']:>10} {row['type']:>6} {row['redop']:>5} {row['root']:>4}"
    for res in row["impls"].values():
        s += (
            f" {res['time_us']:>10.1f} {format_spread(res):>{_SPREAD_W}}"
            f" {res['algbw']:>7.3f} {res['busbw']:>7.3f} {res['wrong']:>6}"
        )
    if "speedup" in row:
        s += f" {row['speedup']:>7.2f}"
    return s


def format_latency(rows: Sequence[Result]) -> str:
    if not rows:
        return ""
    impls = list(rows[0]["impls"])
    lines = ["# latency (us per call, median of repetitions, slowest rank; min-max of the repetitions)"]
    head = f"{'# case':<34}" + "".join(f" {name:>10} {'min-max':>{_SPREAD_W}}" for name in impls)
    if "gloo" in impls:
        head += f" {'aiodist/gloo':>12}"
    lines.append(head)
    for row in rows:
        s = f"{row['case']:<34}" + "".join(
            f" {row['impls'][k]['time_us']:>10.1f} {format_spread(row['impls'][k]):>{_SPREAD_W}}"
            for k in impls
        )
        if "ratio" in row:
            s += f" {row['ratio']:>12.2f}"
        lines.append(s)
    return "\n".join(lines)


def format_memory(mem: dict[str, list[int]], nbytes: int) -> str:
    parts = []
    for name, deltas in mem.items():
        parts.append(f"{name} +{max(deltas) / MiB:.1f} MiB")
    return f"# memory: RSS added by a {nbytes / MiB:.0f} MiB all_reduce (max over ranks): " + ", ".join(parts)


# -- targets --------------------------------------------------------------------------------------

#: Latency targets: aiodist's time <= factor x gloo's, per face (the sync face pays a thread hop).
LATENCY_TARGETS = {
    "async": {"all_reduce": 0.25, "barrier": 0.25, "pingpong": 0.25, "stream": 0.2},
    "sync": {"all_reduce": 0.4, "barrier": 0.4, "pingpong": 0.4, "stream": 0.4},
}
#: 64 MiB algbw targets: aiodist >= factor x gloo's (by world size; None: any).
BANDWIDTH_TARGETS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 1.5 if n == 2 else 1.1,
    "broadcast": lambda n: 1.2,
    "all_gather": lambda n: 2.0,
    "reduce_scatter": lambda n: 2.0,
    "all_to_all": lambda n: 2.0,
}


def targets(jobs: Iterable[dict[str, Any]]) -> list[Result]:
    """Verdicts of the performance targets for every job that ran with ``--compare gloo``."""
    out: list[Result] = []
    for job in jobs:
        if not job.get("compare"):
            continue
        face, n = job["face"], job["nprocs"]
        for row in job.get("latency", []):
            limit = LATENCY_TARGETS[face].get(row["op"])
            if limit is None or "ratio" not in row:
                continue
            out.append(
                {
                    "face": face,
                    "nprocs": n,
                    "target": f"{row['case']}: time <= {limit} x gloo",
                    "measured": row["ratio"],
                    "holds": row["ratio"] <= limit,
                }
            )
        rows = job.get("rows", [])
        big = max((r["size"] for r in rows), default=0)
        for row in rows:
            if (
                row["size"] == big
                and big >= (64 << 20)
                and row["op"] in BANDWIDTH_TARGETS
                and "speedup" in row
            ):
                limit = BANDWIDTH_TARGETS[row["op"]](n)
                out.append(
                    {
                        "face": face,
                        "nprocs": n,
                        "target": f"{row['op']} 64 MiB: algbw >= {limit} x gloo",
                        "measured": row["speedup"],
                        "holds": row["speedup"] >= limit,
                    }
                )
        mid = [r for r in rows if r["size"] >= (64 << 10) and "speedup" in r]
        if mid:
            worst = min(mid, key=lambda r: r["speedup"])
            out.append(
                {
                    "face": face,
                    "nprocs": n,
                    "target": "every op, every size >= 64 KiB: algbw >= 1.0 x gloo",
                    "measured": worst["speedup"],
                    "holds": worst["speedup"] >= 1.0,
                    "worst": f"{worst['op']} {worst['size']} B",
                    "misses": [
                        f"{r['op']} {r['size']} B ({r['speedup']:.2f})" for r in mid if r["speedup"] < 1.0
                    ],
                }
            )
        mem = job.get("memory", {})
        if "aiodist" in mem:
            added = max(mem["aiodist"])
            limit_b = job.get("memory_bytes", 64 << 20)
            out.append(
                {
                    "face": face,
                    "nprocs": n,
                    "target": f"{limit_b >> 20} MiB all_reduce adds <= 1 buffer of RSS",
                    "measured": added / limit_b,
                    "holds": added <= limit_b,
                }
            )
    return out


def format_targets(verdicts: Sequence[Result]) -> str:
    if not verdicts:
        return ""
    lines = [
        "# targets (ratios against gloo in the same run)",
        f"#{'face':>5} {'ranks':>5}  {'target':<58} {'measured':>8}  verdict",
    ]
    for v in verdicts:
        extra = f"  worst: {v['worst']}" if v.get("worst") and not v["holds"] else ""
        lines.append(
            f"{v['face']:>6} {v['nprocs']:>5}  {v['target']:<58} {v['measured']:>8.2f}  "
            f"{'holds' if v['holds'] else 'MISSED'}{extra}"
        )
    return "\n".join(lines)


# -- plot -----------------------------------------------------------------------------------------


def plot(jobs: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """algbw vs size, one panel per operation; aiodist (each face) and gloo, each world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in cases.COLLECTIVES if any(r["op"] == op for j in jobs for r in j.get("rows", []))]
    cols = 3
    nrows = max(1, -(-len(ops) // cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    colors = {2: "tab:blue", 4: "tab:red", 8: "tab:green"}
    seen_gloo: set[tuple[str, int]] = set()
    for k, op in enumerate(ops):
        ax = axes[k // cols][k % cols]
        for job in jobs:
            n, face = job["nprocs"], job["face"]
            rows = [r for r in job.get("rows", []) if r["op"] == op]
            if not rows:
                continue
            xs = [r["size"] for r in rows]
            color = colors.get(n, "black")
            ys = [r["impls"]["aiodist"]["algbw"] for r in rows]
            ax.plot(
                xs,
                ys,
                color=color,
                linestyle="-" if face == "async" else "--",
                marker="o" if face == "async" else "s",
                markersize=3,
                label=f"aiodist {face} n={n}",
            )
            if "gloo" in rows[0]["impls"] and (op, n) not in seen_gloo:
                seen_gloo.add((op, n))
                gy = [r["impls"]["gloo"]["algbw"] for r in rows]
                ax.plot(
                    xs,
                    gy,
                    color=color,
                    linestyle=":",
                    marker="x",
                    markersize=4,
                    alpha=0.7,
                    label=f"gloo n={n}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("algbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for k in range(len(ops), nrows * cols):
        axes[k // cols][k % cols].axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- markdown -------------------------------------------------------------------------------------


def _md_table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    out = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|",
    ]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def markdown(data: dict[str, Any], *, with_targets: bool = False) -> str:
    """BENCHMARKS.md-ready tables of a saved run: headline, targets (if asked), then every table."""
    jobs = [j for j in data["jobs"] if "error" not in j]
    parts: list[str] = []
    meta = data.get("meta", {})
    parts.append(
        f"Run of {meta.get('date', '?')} on `{meta.get('host', '?')}` ({meta.get('cpus', '?')} CPUs, "
        f"Python {meta.get('python', '?')}, torch {meta.get('torch', '-')}); "
        f"`aiodist-bench {' '.join(meta.get('argv', []))}`."
    )
    head = ["case"] + [f"{j['face']} {j['nprocs']}r: aiodist / gloo (ratio)" for j in jobs]
    cases_ = [row["case"] for row in jobs[0].get("latency", [])] if jobs else []
    rows = []
    for i, name in enumerate(cases_):
        cells = [f"{name} (µs)"]
        for j in jobs:
            r = j["latency"][i]
            g = r["impls"].get("gloo")
            cells.append(
                f"{r['impls']['aiodist']['time_us']:.0f} / {g['time_us']:.0f} ({r['ratio']:.2f}x)"
                if g
                else f"{r['impls']['aiodist']['time_us']:.0f}"
            )
        rows.append(cells)
    big = max((r["size"] for j in jobs for r in j["rows"]), default=0)
    for op in cases.COLLECTIVES:
        cells = [f"{op} {big >> 20} MiB algbw (GB/s)"]
        found = False
        for j in jobs:
            r = next((r for r in j["rows"] if r["op"] == op and r["size"] == big), None)
            if r is None:
                cells.append("")
                continue
            found = True
            a, g = r["impls"]["aiodist"], r["impls"].get("gloo")
            cells.append(
                f"{a['algbw']:.2f} / {g['algbw']:.2f} ({r['speedup']:.2f}x)" if g else f"{a['algbw']:.2f}"
            )
        if found:
            rows.append(cells)
    if any(j.get("memory") for j in jobs):
        probe = max(j.get("memory_bytes", 0) for j in jobs)
        mrow = [f"RSS added by a {probe >> 20} MiB all_reduce (MiB)"]
        for j in jobs:
            mem = j.get("memory", {})
            mrow.append(
                " / ".join(f"{max(mem[k]) / MiB:.1f}" for k in ("aiodist", "gloo") if k in mem) if mem else ""
            )
        rows.append(mrow)
    parts.append(
        "### Headline (latency: time ratio, lower is better; bandwidth: algbw ratio, higher is better)\n\n"
        + _md_table(head, rows)
    )
    verdicts = (data.get("targets") or targets(jobs)) if with_targets else []
    if verdicts:
        parts.append(
            "### Targets\n\n"
            + _md_table(
                ["face", "ranks", "target", "measured", "verdict"],
                [
                    (
                        v["face"],
                        v["nprocs"],
                        v["target"],
                        f"{v['measured']:.2f}",
                        "holds"
                        if v["holds"]
                        else "**missed**" + (f" ({'; '.join(v['misses'])})" if v.get("misses") else ""),
                    )
                    for v in verdicts
                ],
            )
        )
    for j in jobs:
        impls = ["aiodist"] + (["gloo"] if j.get("compare") else [])
        body = []
        for op in cases.COLLECTIVES:
            rows_op = [r for r in j["rows"] if r["op"] == op]
            if not rows_op:
                continue
            body.append(f"**{op}**\n")
            h = ["size", "count", "type", "redop", "root"]
            for name in impls:
                h += [f"{name} time (µs)", "min-max (µs)", "algbw", "busbw", "#wrong"]
            if "gloo" in impls:
                h.append("speedup")
            trs = []
            for r in rows_op:
                c: list[Any] = [r["size"], r["count"], r["type"], r["redop"], r["root"]]
                for name in impls:
                    x = r["impls"][name]
                    c += [
                        f"{x['time_us']:.1f}",
                        format_spread(x),
                        f"{x['algbw']:.3f}",
                        f"{x['busbw']:.3f}",
                        x["wrong"],
                    ]
                if "speedup" in r:
                    c.append(f"{r['speedup']:.2f}")
                trs.append(c)
            body.append(_md_table(h, trs) + "\n")
        parts.append(
            f"<details><summary>{j['face']} face, {j['nprocs']} ranks: every table</summary>\n\n"
            + "\n".join(body)
            + "\n</details>"
        )
    return "\n\n".join(parts) + "\n"
