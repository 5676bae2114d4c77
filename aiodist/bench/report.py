"""Turning per-rank timings into nccl-tests tables, latency rows, markdown and a plot.

The project's performance targets and their verdicts are repository tooling, not part of the
package: ``tools/bench_targets.py`` in the repository judges a run saved with ``--json``.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from aiodist.bench import cases
from aiodist.bench.worker import STREAM_BURST

__all__ = [
    "md_table",
    "RankReports",
    "Result",
    "add_latency_ratios",
    "add_ratios",
    "aggregate",
    "aiodist_key",
    "job_impls",
    "format_latency",
    "format_memory",
    "format_spread",
    "format_table_header",
    "format_table_row",
    "plot",
    "run_meta",
    "save",
    "size_text",
    "wrong_elements",
]

Result = dict[str, Any]
_GB = 1e9
MiB = 1 << 20


class RankReports:
    """Collects each rank's report of a case (or latency row) until every one of the ``n`` ranks
    has sent its own: the aiodist jobs and the MPI peer read their ranks' results the same way."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._pending: dict[tuple[str, str, int], dict[int, tuple[int, dict[str, Any]]]] = {}

    def add(self, item: Sequence[Any]) -> tuple[int, list[dict[str, Any]]] | None:
        """Take ``(kind, rank, op, nbytes, count, report)``; the case's element count and the
        reports in rank order once the last rank's came, else None."""
        kind, rank, op, nbytes, count, data = item
        slot = self._pending.setdefault((kind, op, nbytes), {})
        slot[rank] = (count, data)
        if len(slot) < self.n:
            return None
        del self._pending[(kind, op, nbytes)]
        return slot[0][0], [slot[r][1] for r in range(self.n)]


def _median_of_slowest(per_rank: Sequence[Sequence[float]]) -> tuple[float, list[float]]:
    """Per repetition the slowest rank's time; the median over repetitions (and the list)."""
    reps = [max(ts) for ts in zip(*per_rank, strict=True)]
    return statistics.median(reps), reps


def aiodist_key(impls: Iterable[str]) -> str:
    """aiodist's column among ``impls``: ``aiodist`` or ``aiodist-tcp``."""
    return next((k for k in impls if k.startswith("aiodist")), "aiodist")


def add_ratios(row: Result) -> None:
    """A table row's algbw ratios: ``speedup`` (aiodist / gloo) and ``vs_mpi`` (aiodist / MPI)."""
    impls = row["impls"]
    mine = impls.get(aiodist_key(impls))
    if not mine or mine["time_us"] <= 0:
        return
    for peer, key in (("gloo", "speedup"), ("mpi", "vs_mpi")):
        if peer in impls:
            row[key] = impls[peer]["time_us"] / mine["time_us"]


def add_latency_ratios(row: Result) -> None:
    """A latency row's time ratios: ``ratio`` (aiodist / gloo) and ``ratio_mpi`` (aiodist / MPI)."""
    impls = row["impls"]
    mine = impls.get(aiodist_key(impls))
    if not mine:
        return
    for peer, key in (("gloo", "ratio"), ("mpi", "ratio_mpi")):
        if peer in impls and impls[peer]["time_us"] > 0:
            row[key] = mine["time_us"] / impls[peer]["time_us"]


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
    add_ratios(row)
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
    add_latency_ratios(row)
    return row


def _latency_name(op: str, nbytes: int) -> str:
    return {
        "all_reduce": f"all_reduce {nbytes} B",
        "barrier": "barrier",
        "pingpong": f"ping-pong {nbytes} B one-way",
        "stream": f"stream of {nbytes} B sends, each",
    }.get(op, op)


def job_impls(job: dict[str, Any]) -> list[str]:
    """The columns of a job's tables, in order: aiodist (as it ran), then gloo and MPI if measured."""
    seen: dict[str, None] = {}
    for row in [*job.get("rows", []), *job.get("latency", [])]:
        for name in row["impls"]:
            seen[name] = None
    first = aiodist_key(seen) if seen else job.get("aiodist", "aiodist")
    return [first] + [p for p in ("gloo", "mpi") if p in seen]


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


#: ratio columns: (peer, row key, header).
_RATIO_COLS = (("gloo", "speedup", "vs gloo"), ("mpi", "vs_mpi", "vs mpi"))
_LATENCY_RATIO_COLS = (("gloo", "ratio", "aio/gloo"), ("mpi", "ratio_mpi", "aio/mpi"))


def format_table_header(op: str, impls: Sequence[str]) -> str:
    left = f"{'size':>12} {'count':>10} {'type':>6} {'redop':>5} {'root':>4}"
    names = "".join(f" {'-- ' + name + ' ':-<{_IMPL_W}}" for name in impls)
    cols = "".join(f" {_IMPL_COLS}" for _ in impls)
    units = "".join(f" {'':>10} {'':>{_SPREAD_W}} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}" for _ in impls)
    extra = "".join(f" {head:>7}" for peer, _, head in _RATIO_COLS if peer in impls)
    pad = " " * len(left)
    lines = [f"#{pad[1:]}{names}", f"#{left[1:]}{cols}{extra}", f"#{pad[1:]}{units}".rstrip()]
    return f"# {op}\n" + "\n".join(lines)


def format_table_row(row: Result, impls: Sequence[str] | None = None) -> str:
    """One row; ``impls``: the header's columns (a runtime missing from this row prints dashes)."""
    names = list(row["impls"]) if impls is None else list(impls)
    s = f"{row['size']:>12} {row['count']:>10} {row['type']:>6} {row['redop']:>5} {row['root']:>4}"
    for name in names:
        res = row["impls"].get(name)
        if res is None:
            s += f" {'-':>10} {'-':>{_SPREAD_W}} {'-':>7} {'-':>7} {'-':>6}"
            continue
        s += (
            f" {res['time_us']:>10.1f} {format_spread(res):>{_SPREAD_W}}"
            f" {res['algbw']:>7.3f} {res['busbw']:>7.3f} {res['wrong']:>6}"
        )
    for peer, key, _ in _RATIO_COLS:
        if peer in names:
            s += f" {row[key]:>7.2f}" if key in row else f" {'-':>7}"
    return s


def format_latency(rows: Sequence[Result], impls: Sequence[str] | None = None) -> str:
    if not rows:
        return ""
    names = list(rows[0]["impls"]) if impls is None else list(impls)
    lines = ["# latency (us per call, median of repetitions, slowest rank; min-max of the repetitions)"]
    head = f"{'# case':<34}" + "".join(f" {name:>11} {'min-max':>{_SPREAD_W}}" for name in names)
    head += "".join(f" {h:>9}" for peer, _, h in _LATENCY_RATIO_COLS if peer in names)
    lines.append(head)
    for row in rows:
        s = f"{row['case']:<34}"
        for k in names:
            res = row["impls"].get(k)
            s += (
                f" {res['time_us']:>11.1f} {format_spread(res):>{_SPREAD_W}}"
                if res
                else f" {'-':>11} {'-':>{_SPREAD_W}}"
            )
        for peer, key, _ in _LATENCY_RATIO_COLS:
            if peer in names:
                s += f" {row[key]:>9.2f}" if key in row else f" {'-':>9}"
        lines.append(s)
    return "\n".join(lines)


def format_memory(mem: dict[str, list[int]], nbytes: int) -> str:
    parts = []
    for name, deltas in mem.items():
        parts.append(f"{name} +{max(deltas) / MiB:.1f} MiB")
    return f"# memory: RSS added by a {nbytes / MiB:.0f} MiB all_reduce (max over ranks): " + ", ".join(parts)


def size_text(nbytes: int) -> str:
    """``4 B``, ``64 KiB``, ``16 MiB``: a size as the tables print it."""
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= f and nbytes % f == 0:
            return f"{nbytes // f} {unit}"
    return f"{nbytes} B"


# -- plot -----------------------------------------------------------------------------------------


def plot(jobs: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """algbw vs size, one panel per operation: aiodist (each face, each transport asked for), gloo
    and MPI, each world size (colour). aiodist async solid, sync dashed; its TCP runs in lighter,
    thinner lines; gloo dotted, MPI dash-dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in cases.COLLECTIVES if any(r["op"] == op for j in jobs for r in j.get("rows", []))]
    cols = 3
    nrows = max(1, -(-len(ops) // cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5.4 * cols, 3.9 * nrows), squeeze=False)
    colors = {2: "tab:blue", 4: "tab:red", 8: "tab:green"}
    peer_style = {"gloo": (":", "x"), "mpi": ("-.", "^")}
    for k, op in enumerate(ops):
        ax = axes[k // cols][k % cols]
        seen_peer: set[tuple[str, int]] = set()
        for job in jobs:
            n, face = job["nprocs"], job["face"]
            rows = [r for r in job.get("rows", []) if r["op"] == op]
            if not rows:
                continue
            color = colors.get(n, "black")
            me = aiodist_key(rows[0]["impls"])
            tcp = me != "aiodist"
            ax.plot(
                [r["size"] for r in rows],
                [r["impls"][me]["algbw"] for r in rows],
                color=color,
                linestyle="-" if face == "async" else "--",
                marker="v" if tcp else "o",
                markersize=3,
                linewidth=0.9 if tcp else 1.5,
                alpha=0.55 if tcp else 1.0,
                label=f"{me} {face} n={n}",
            )
            for peer, (style, marker) in peer_style.items():
                pts = [(r["size"], r["impls"][peer]["algbw"]) for r in rows if peer in r["impls"]]
                if not pts or (peer, n) in seen_peer:
                    continue
                seen_peer.add((peer, n))
                ax.plot(
                    [x for x, _ in pts],
                    [y for _, y in pts],
                    color=color,
                    linestyle=style,
                    marker=marker,
                    markersize=4,
                    alpha=0.8,
                    label=f"{peer} n={n}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("algbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    for k in range(len(ops), nrows * cols):
        axes[k // cols][k % cols].axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- markdown -------------------------------------------------------------------------------------


def md_table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table: ``head``, right-aligned after the first column, then ``rows``."""
    out = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|",
    ]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _peer_cell(values: Sequence[float], fmt: str) -> str:
    return format(statistics.median(values), fmt) if values else ""


def _headline(jobs: Sequence[dict[str, Any]], n: int) -> str:
    """One world size's headline: each aiodist job's figure with its ratios, then gloo and MPI."""
    mine = [j for j in jobs if j["nprocs"] == n]
    head = ["case"] + [f"{j['face']} {j.get('aiodist', 'aiodist')}" for j in mine] + ["gloo", "MPI"]
    rows: list[list[str]] = []

    def ratios(row: Result, keys: tuple[str, str]) -> str:
        got = [f"{row[k]:.2f}x {p}" for k, p in zip(keys, ("gloo", "MPI"), strict=True) if k in row]
        return f" ({', '.join(got)})" if got else ""

    names = [r["case"] for r in mine[0].get("latency", [])] if mine else []
    for case in names:
        cells = [f"{case} (µs)"]
        peers: dict[str, list[float]] = {"gloo": [], "mpi": []}
        for j in mine:
            row = next((r for r in j.get("latency", []) if r["case"] == case), None)
            if row is None:
                cells.append("")
                continue
            me = row["impls"][aiodist_key(row["impls"])]
            cells.append(f"{me['time_us']:.1f}{ratios(row, ('ratio', 'ratio_mpi'))}")
            for p in peers:
                if p in row["impls"]:
                    peers[p].append(row["impls"][p]["time_us"])
        cells += [_peer_cell(peers["gloo"], ".1f"), _peer_cell(peers["mpi"][:1], ".1f")]
        rows.append(cells)
    sizes = sorted({r["size"] for j in mine for r in j.get("rows", [])})
    for size in sizes[-1:]:
        for op in cases.COLLECTIVES:
            cells = [f"{op} {size_text(size)} algbw (GB/s)"]
            peers = {"gloo": [], "mpi": []}
            found = False
            for j in mine:
                row = next((r for r in j.get("rows", []) if r["op"] == op and r["size"] == size), None)
                if row is None:
                    cells.append("")
                    continue
                found = True
                me = row["impls"][aiodist_key(row["impls"])]
                cells.append(f"{me['algbw']:.2f}{ratios(row, ('speedup', 'vs_mpi'))}")
                for p in peers:
                    if p in row["impls"]:
                        peers[p].append(row["impls"][p]["algbw"])
            if found:
                cells += [_peer_cell(peers["gloo"], ".2f"), _peer_cell(peers["mpi"][:1], ".2f")]
                rows.append(cells)
    if any(j.get("memory") for j in mine):
        probe = max(j.get("memory_bytes", 0) for j in mine)
        cells = [f"RSS added by a {probe >> 20} MiB all_reduce (MiB)"]
        gloo_mem: list[float] = []
        mpi_mem: list[float] = []
        for j in mine:
            mem = j.get("memory", {})
            me_name = j.get("aiodist", "aiodist")
            cells.append(f"{max(mem[me_name]) / MiB:.1f}" if me_name in mem else "")
            if "gloo" in mem:
                gloo_mem.append(max(mem["gloo"]) / MiB)
            if "mpi" in mem:
                mpi_mem.append(max(mem["mpi"]) / MiB)
        cells += [_peer_cell(gloo_mem, ".1f"), _peer_cell(mpi_mem[:1], ".1f")]
        rows.append(cells)
    places = sorted({j["placement"] for j in mine if j.get("placement")})
    where = f" ({', '.join(places)})" if places else ""
    return (
        f"### {n} ranks{where}\n\naiodist cells: its figure (its ratio to gloo measured alternating in the same "
        "job, its ratio to MPI); latency ratios are time ratios (lower is better), bandwidth ratios "
        "algbw ratios (higher is better). gloo: the median of its figures in this world size's jobs.\n\n"
        + md_table(head, rows)
    )


def markdown(data: dict[str, Any]) -> str:
    """BENCHMARKS.md-ready tables of a saved run: the headline of each world size, then every table."""
    jobs = [j for j in data["jobs"] if "error" not in j]
    parts: list[str] = []
    meta = data.get("meta", {})
    parts.append(
        f"Run of {meta.get('date', '?')} on `{meta.get('host', '?')}` ({meta.get('cpus', '?')} CPUs, "
        f"Python {meta.get('python', '?')}, torch {meta.get('torch', '-')}); "
        f"`aiodist-bench {' '.join(meta.get('argv', []))}`."
    )
    launch = meta.get("launch")
    if launch:
        hosts = "; ".join(f"`{h['hostname']}` ranks {h['ranks_text']}" for h in launch.get("hosts", []))
        parts.append(f"Launched by {launch['launcher']} on {launch.get('placement') or '?'}: {hosts}.")
    mpi = meta.get("mpi")
    if mpi:
        parts.append(
            f"MPI: {mpi['library']} ({mpi['launcher']}), {mpi['transport']}."
            if "library" in mpi
            else f"MPI: not measured: {mpi.get('error', 'unavailable')}."
        )
    for n in sorted({j["nprocs"] for j in jobs}):
        parts.append(_headline(jobs, n))
    for j in jobs:
        impls = job_impls(j)
        body = []
        for op in cases.COLLECTIVES:
            rows_op = [r for r in j["rows"] if r["op"] == op]
            if not rows_op:
                continue
            body.append(f"**{op}**\n")
            h = ["size", "count", "type", "redop", "root"]
            for name in impls:
                h += [f"{name} time (µs)", "min-max (µs)", "algbw", "busbw", "#wrong"]
            ratio_cols = [(key, head) for peer, key, head in _RATIO_COLS if peer in impls]
            h += [head for _, head in ratio_cols]
            trs = []
            for r in rows_op:
                c: list[Any] = [r["size"], r["count"], r["type"], r["redop"], r["root"]]
                for name in impls:
                    x = r["impls"].get(name)
                    c += (
                        [
                            f"{x['time_us']:.1f}",
                            format_spread(x),
                            f"{x['algbw']:.3f}",
                            f"{x['busbw']:.3f}",
                            x["wrong"],
                        ]
                        if x
                        else ["-"] * 5
                    )
                c += [f"{r[key]:.2f}" if key in r else "-" for key, _ in ratio_cols]
                trs.append(c)
            body.append(md_table(h, trs) + "\n")
        parts.append(
            f"<details><summary>{j['face']} face, {j.get('aiodist', 'aiodist')}, {j['nprocs']} ranks: "
            "every table</summary>\n\n" + "\n".join(body) + "\n</details>"
        )
    return "\n\n".join(parts) + "\n"


# -- a run's record -------------------------------------------------------------------------------


def run_meta(started: datetime.datetime, argv: Sequence[str], title: str) -> dict[str, Any]:
    """The ``meta`` of a run's JSON: when, where (the host that printed the tables), how."""
    meta: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "argv": list(argv),
        "title": title,
    }
    # The installed version, without importing torch (seconds): a launched rank 0 writes its
    # results within the launcher's grace period after another rank failed.
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        meta["torch"] = importlib.metadata.version("torch")
    return meta


def wrong_elements(jobs: Sequence[dict[str, Any]]) -> int:
    """Every wrong element of every row of every runtime."""
    return sum(res["wrong"] for j in jobs for r in j["rows"] for res in r["impls"].values())


def save(
    data: dict[str, Any],
    *,
    json_path: str | None,
    markdown_path: str | None,
    plot_path: str | None,
) -> None:
    """Write the files asked for (``--json``, ``--markdown``, ``--plot``), a line for each."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(data, f, indent=1)
        print(f"# results written to {json_path}", flush=True)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(markdown(data))
        print(f"# markdown written to {markdown_path}", flush=True)
    if plot_path:
        try:
            plot(data["jobs"], plot_path, str(data["meta"].get("title", "")))
            print(f"# plot written to {plot_path}", flush=True)
        except ImportError:
            print("# no plot: matplotlib is not installed (pip install 'aiodist[bench]')", flush=True)
