"""The aiodist repository's benchmark targets, and their verdicts on a saved ``aiodist-bench`` run.

Repository tooling, not part of the installed package: ``aiodist-bench`` measures and saves
(``aiodist-bench --json RUN.json``); this script holds the project's performance targets and
judges a saved run against them, printing each as held, not held, or not judged (and why), with
the figures behind it. ``make bench`` runs it on the run it saves::

    python tools/bench_targets.py build/bench/bench.json
    python tools/bench_targets.py build/bench/bench.json --markdown targets.md

``--markdown FILE`` also writes the verdicts as a markdown section (for BENCHMARKS.md). The
verdicts are computed from the run's figures with the targets of this file (a ``targets`` list
that an older ``aiodist-bench`` saved in the JSON is not read). The exit status is 0 whatever the
verdicts (they are information, not failures), 2 when the run cannot be read (or the markdown
file cannot be written).

It imports the table helpers of ``aiodist.bench.report``: the tool depends on the package, never
the other way round. Importable too: ``targets(jobs)``, ``format_targets(verdicts)``,
``markdown_targets(verdicts)``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from aiodist.bench.report import MiB, Result, aiodist_key, md_table, size_text

__all__ = [
    "ABSOLUTE_TARGETS",
    "ENGINE_4_RANKS_VS_GLOO",
    "ENGINE_TARGETS_US",
    "GLOO_TARGETS_64M",
    "LARGE_FROM",
    "LARGE_VS_GLOO",
    "LARGE_VS_MPI",
    "LATENCY_TARGETS",
    "MANY_RANKS_VS_GLOO",
    "MID_FROM",
    "MID_VS_GLOO",
    "NONE_TO_JUDGE",
    "VS_PYTHON_SLACK",
    "format_targets",
    "load_run",
    "main",
    "markdown_targets",
    "targets",
    "verdict_word",
]

# -- the targets ----------------------------------------------------------------------------------

#: Latency targets, aiodist's time <= factor x gloo's: 2 ranks (the face's own limit; the sync
#: face pays a thread hop), then any other world size.
LATENCY_TARGETS: dict[int, dict[str, dict[str, float]]] = {
    2: {
        "async": {"all_reduce": 0.1, "pingpong": 0.1, "barrier": 0.25, "stream": 0.2},
        "sync": {"all_reduce": 0.25, "pingpong": 0.25, "barrier": 0.4, "stream": 0.4},
    },
    0: {
        "async": {"all_reduce": 0.25, "barrier": 0.25, "pingpong": 0.25, "stream": 0.2},
        "sync": {"all_reduce": 0.4, "barrier": 0.4, "pingpong": 0.4, "stream": 0.4},
    },
}
#: 2 ranks, 64 MiB: aiodist's algbw at least this many GB/s.
ABSOLUTE_TARGETS = {
    "broadcast": 8.0,
    "all_gather": 5.0,
    "all_to_all": 5.0,
    "sendrecv": 6.0,
    "all_reduce": 3.0,
}
#: 2 ranks, 64 MiB: aiodist's algbw at least this many times gloo's.
GLOO_TARGETS_64M = {"all_reduce": 2.5}
#: 2 ranks, every operation from this size: algbw at least these multiples of gloo's and MPI's.
LARGE_FROM = 1 << 20
LARGE_VS_GLOO = 3.0
LARGE_VS_MPI = 0.6
#: more than 2 ranks, every 64 MiB operation: algbw at least this many times gloo's.
MANY_RANKS_VS_GLOO = 2.0
#: every world size, every operation from 64 KiB: at least gloo's algbw.
MID_FROM = 64 << 10
MID_VS_GLOO = 1.0

#: The compiled engine's own targets (2 ranks with a core each, one host): µs per call at most, by
#: face and latency row (ping-pong one way; stream: each message).
ENGINE_TARGETS_US: dict[str, dict[str, float]] = {
    "async": {"pingpong": 3.0, "all_reduce": 5.0, "stream": 1.0},
    "sync": {"pingpong": 2.0, "all_reduce": 4.0},
}
#: ... and on 4 ranks, a 4 B all_reduce at most this many times gloo's time.
ENGINE_4_RANKS_VS_GLOO = 0.2
#: Nothing slower than the Python engine in the same run: each row's time (latency) or algbw
#: within this share of the Python engine's (the run's noise), every miss named.
VS_PYTHON_SLACK = 0.1

#: What is printed where a run has nothing to judge.
NONE_TO_JUDGE = "none to judge (they compare against gloo: run aiodist-bench with --compare gloo)"


# -- the verdicts ---------------------------------------------------------------------------------


def _verdict(job: dict[str, Any], target: str, measured: float, holds: bool | None, figures: str) -> Result:
    return {
        "face": job["face"],
        "nprocs": job["nprocs"],
        "impl": job.get("aiodist", "aiodist"),
        "target": target,
        "measured": measured,
        "holds": holds,
        "figures": figures,
    }


def _judged_jobs(jobs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The jobs the targets judge: aiodist with its default transport where it ran, else the rest."""
    ok = [j for j in jobs if "error" not in j]
    default = [j for j in ok if j.get("aiodist", "aiodist") == "aiodist"]
    return default or ok


def _ratio_verdict(
    job: dict[str, Any], rows: Sequence[Result], key: str, peer: str, limit: float, what: str
) -> Result | None:
    """One verdict over many rows: the worst ratio ``key`` against ``limit``, and every miss."""
    if not rows:
        return None
    judged = [r for r in rows if key in r]
    if not judged:
        why = job.get("mpi_error") if peer == "mpi" else None
        return _verdict(
            job,
            f"{what}: algbw >= {limit} x {peer}",
            float("nan"),
            None,
            f"no {peer} figures in this run" + (f" ({why})" if why else ""),
        )
    worst = min(judged, key=lambda r: r[key])
    misses = [r for r in judged if r[key] < limit]
    me = aiodist_key(worst["impls"])
    figures = (
        f"worst {worst['op']} {size_text(worst['size'])}: {worst['impls'][me]['algbw']:.2f} vs "
        f"{worst['impls'][peer]['algbw']:.2f} GB/s; {len(misses)} of {len(judged)} rows below"
    )
    v = _verdict(job, f"{what}: algbw >= {limit} x {peer}", worst[key], worst[key] >= limit, figures)
    v["misses"] = [f"{r['op']} {size_text(r['size'])} ({r[key]:.2f})" for r in misses]
    return v


def targets(jobs: Sequence[dict[str, Any]]) -> list[Result]:
    """Verdicts of the performance targets (``holds`` None: not judged, and ``figures`` says why).

    ``jobs``: a saved run's ``jobs``. They judge aiodist with its default transport (or, where
    only ``aiodist-tcp`` ran, that); ratios need gloo (``--compare gloo``) or MPI
    (``--compare mpi``) in the same run.
    """
    out: list[Result] = []
    for job in _judged_jobs(jobs):
        face, n = job["face"], job["nprocs"]
        limits = LATENCY_TARGETS.get(n, LATENCY_TARGETS[0])[face]
        for row in job.get("latency", []):
            limit = limits.get(row["op"])
            if limit is None or "ratio" not in row:
                continue
            me = aiodist_key(row["impls"])
            figures = f"{row['impls'][me]['time_us']:.1f} vs {row['impls']['gloo']['time_us']:.1f} us"
            if "ratio_mpi" in row:
                figures += f" (MPI {row['impls']['mpi']['time_us']:.1f} us)"
            out.append(
                _verdict(
                    job,
                    f"{row['case']}: time <= {limit} x gloo",
                    row["ratio"],
                    row["ratio"] <= limit,
                    figures,
                )
            )
        rows = [r for r in job.get("rows", []) if aiodist_key(r["impls"]) in r["impls"]]
        big = [r for r in rows if r["size"] >= (64 << 20) and r["size"] == max(x["size"] for x in rows)]
        if n == 2:
            for r in big:
                me = r["impls"][aiodist_key(r["impls"])]
                if r["op"] in ABSOLUTE_TARGETS:
                    limit = ABSOLUTE_TARGETS[r["op"]]
                    peers = ", ".join(
                        f"{p} {r['impls'][p]['algbw']:.2f}" for p in ("gloo", "mpi") if p in r["impls"]
                    )
                    out.append(
                        _verdict(
                            job,
                            f"{r['op']} 64 MiB: algbw >= {limit} GB/s",
                            me["algbw"],
                            me["algbw"] >= limit,
                            f"{me['algbw']:.2f} GB/s" + (f" ({peers})" if peers else ""),
                        )
                    )
                if r["op"] in GLOO_TARGETS_64M and "speedup" in r:
                    limit = GLOO_TARGETS_64M[r["op"]]
                    out.append(
                        _verdict(
                            job,
                            f"{r['op']} 64 MiB: algbw >= {limit} x gloo",
                            r["speedup"],
                            r["speedup"] >= limit,
                            f"{me['algbw']:.2f} vs {r['impls']['gloo']['algbw']:.2f} GB/s",
                        )
                    )
            large = [r for r in rows if r["size"] >= LARGE_FROM]
            for key, peer, limit in (("speedup", "gloo", LARGE_VS_GLOO), ("vs_mpi", "mpi", LARGE_VS_MPI)):
                if peer == "gloo" and not job.get("compare"):
                    continue
                v = _ratio_verdict(job, large, key, peer, limit, "every op >= 1 MiB")
                if v is not None:
                    out.append(v)
        elif job.get("compare"):
            v = _ratio_verdict(job, big, "speedup", "gloo", MANY_RANKS_VS_GLOO, "every op at 64 MiB")
            if v is not None:
                out.append(v)
        if job.get("compare"):
            mid = [r for r in rows if r["size"] >= MID_FROM]
            v = _ratio_verdict(job, mid, "speedup", "gloo", MID_VS_GLOO, "every op >= 64 KiB")
            if v is not None:
                out.append(v)
        out.extend(_engine_targets(job, jobs))
        mem = job.get("memory", {})
        me_name = job.get("aiodist", "aiodist")
        if me_name in mem:
            added = max(mem[me_name])
            probe = job.get("memory_bytes", 64 << 20)
            peers = ", ".join(f"{k} +{max(v) / MiB:.1f}" for k, v in mem.items() if k != me_name)
            out.append(
                _verdict(
                    job,
                    f"{probe >> 20} MiB all_reduce adds <= 1 buffer of RSS",
                    added / probe,
                    added <= probe,
                    f"+{added / MiB:.1f} MiB per rank (max)" + (f"; {peers} MiB" if peers else ""),
                )
            )
    return out


def _compiled(job: dict[str, Any]) -> bool:
    engine = job.get("engine") or {}
    return bool(engine) and all(v == "compiled" for v in engine.values())


def _engine_targets(job: dict[str, Any], jobs: Sequence[dict[str, Any]]) -> list[Result]:
    """The compiled engine's targets, on a job of aiodist's default transport that ran it:
    absolute latencies (2 ranks), the 4-rank all_reduce against gloo, and no row slower than
    the Python engine's job of the same face and world size (``--aiodist-transports shm,python``)."""
    if job.get("aiodist", "aiodist") != "aiodist" or not _compiled(job):
        return []
    out: list[Result] = []
    face, n = job["face"], job["nprocs"]
    latency = {row["op"]: row for row in job.get("latency", [])}
    for op, limit in ENGINE_TARGETS_US.get(face, {}).items() if n == 2 else ():
        row = latency.get(op)
        if row is None or "aiodist" not in row["impls"]:
            continue
        us = row["impls"]["aiodist"]["time_us"]
        figures = f"{us:.1f} us" + (
            f" (MPI {row['impls']['mpi']['time_us']:.1f} us)" if "mpi" in row["impls"] else ""
        )
        out.append(_verdict(job, f"{row['case']}: time <= {limit:g} us", us, us <= limit, figures))
    row = latency.get("all_reduce")
    if n == 4 and row is not None and "ratio" in row:
        figures = f"{row['impls']['aiodist']['time_us']:.1f} vs {row['impls']['gloo']['time_us']:.1f} us"
        out.append(
            _verdict(
                job,
                f"{row['case']}: time <= {ENGINE_4_RANKS_VS_GLOO} x gloo",
                row["ratio"],
                row["ratio"] <= ENGINE_4_RANKS_VS_GLOO,
                figures,
            )
        )
    py = next(
        (
            j
            for j in jobs
            if j.get("aiodist") == "aiodist-py"
            and j["face"] == face
            and j["nprocs"] == n
            and "error" not in j
        ),
        None,
    )
    if py is not None:
        out.append(_vs_python(job, py))
    return out


def _vs_python(job: dict[str, Any], py: dict[str, Any]) -> Result:
    """Every latency row and every bandwidth row of ``job`` against the Python engine's ``py``:
    the worst ratio of the compiled engine's time to the Python engine's, and the misses."""
    ratios: list[tuple[float, str]] = []  # (compiled time / Python time, the row)
    for kind, value, inverse in (("latency", "time_us", False), ("rows", "algbw", True)):
        theirs = {(r["op"], r["size"]): r for r in py.get(kind, [])}
        for r in job.get(kind, []):
            other = theirs.get((r["op"], r["size"]))
            if other is None or "aiodist" not in r["impls"] or "aiodist-py" not in other["impls"]:
                continue
            mine, them = r["impls"]["aiodist"][value], other["impls"]["aiodist-py"][value]
            if not (mine > 0 and them > 0):
                continue
            ratio = them / mine if inverse else mine / them
            ratios.append((ratio, r.get("case") or f"{r['op']} {size_text(r['size'])}"))
    target = f"every row: time <= {1 + VS_PYTHON_SLACK:g} x the Python engine's"
    if not ratios:
        return _verdict(job, target, float("nan"), None, "no rows of both engines in this run")
    worst = max(ratios)
    misses = [f"{case} ({ratio:.2f})" for ratio, case in ratios if ratio > 1 + VS_PYTHON_SLACK]
    v = _verdict(
        job,
        target,
        worst[0],
        not misses,
        f"worst {worst[1]}: {worst[0]:.2f}; {len(misses)} of {len(ratios)} rows slower",
    )
    v["misses"] = misses
    return v


# -- text and markdown ----------------------------------------------------------------------------


def verdict_word(v: Result) -> str:
    """``holds``, ``NOT HELD`` or ``not judged``."""
    if v["holds"] is None:
        return "not judged"
    return "holds" if v["holds"] else "NOT HELD"


def _counts(verdicts: Sequence[Result]) -> tuple[int, int]:
    """How many verdicts hold, and how many were judged."""
    held = sum(1 for v in verdicts if v["holds"])
    judged = sum(1 for v in verdicts if v["holds"] is not None)
    return held, judged


def format_targets(verdicts: Sequence[Result]) -> str:
    """The verdicts as a table of text, closed by ``# N of M judged targets hold``; "" if none."""
    if not verdicts:
        return ""
    lines = [
        "# targets (ratios against gloo and MPI in the same run)",
        f"#{'face':>5} {'ranks':>5} {'aiodist':<11}  {'target':<52} {'measured':>8}  verdict: figures",
    ]
    for v in verdicts:
        measured = "-" if v["holds"] is None else f"{v['measured']:.2f}"
        lines.append(
            f"{v['face']:>6} {v['nprocs']:>5} {v.get('impl', 'aiodist'):<11}  {v['target']:<52} {measured:>8}  "
            f"{verdict_word(v)}: {v.get('figures', '')}"
        )
    held, judged = _counts(verdicts)
    lines.append(f"# {held} of {judged} judged targets hold")
    return "\n".join(lines)


def markdown_targets(verdicts: Sequence[Result]) -> str:
    """The verdicts as a markdown section (``### Targets (N of M judged hold)`` and a table)."""
    if not verdicts:
        return f"### Targets\n\n{NONE_TO_JUDGE[0].upper()}{NONE_TO_JUDGE[1:]}.\n"
    held, judged = _counts(verdicts)
    return (
        f"### Targets ({held} of {judged} judged hold)\n\n"
        + md_table(
            ["face", "ranks", "aiodist", "target", "measured", "verdict", "figures"],
            [
                (
                    v["face"],
                    v["nprocs"],
                    v.get("impl", "aiodist"),
                    v["target"],
                    "-" if v["holds"] is None else f"{v['measured']:.2f}",
                    "holds" if v["holds"] else "**not held**" if v["holds"] is False else "not judged",
                    v.get("figures", ""),
                )
                for v in verdicts
            ],
        )
        + "\n"
    )


# -- the script -----------------------------------------------------------------------------------


def load_run(path: str) -> dict[str, Any]:
    """A run saved by ``aiodist-bench --json``; ValueError or OSError if it is not one."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list):
        raise ValueError("not a run saved by aiodist-bench --json (no list of jobs)")
    return data


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bench_targets.py",
        description="Judge a run saved by `aiodist-bench --json` against the aiodist repository's "
        "performance targets (ratios against gloo and MPI in the same run). Exit status 0 whatever "
        "the verdicts; 2 when the run cannot be read.",
    )
    ap.add_argument("run", metavar="RUN.json", help="the JSON file aiodist-bench --json wrote")
    ap.add_argument("--markdown", metavar="FILE", help="also write the verdicts as a markdown section")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        data = load_run(args.run)
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        print(f"bench_targets.py: cannot read {args.run}: {exc}", file=sys.stderr)
        return 2
    try:
        verdicts = targets(data["jobs"])
    except (KeyError, TypeError, ValueError) as exc:  # a job without the fields a saved run has
        print(
            f"bench_targets.py: cannot read {args.run}: not a run saved by aiodist-bench --json "
            f"({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
        return 2
    print(format_targets(verdicts) or f"# targets: {NONE_TO_JUDGE}", flush=True)
    if args.markdown:
        try:
            with open(args.markdown, "w", encoding="utf-8") as f:
                f.write(markdown_targets(verdicts))
        except OSError as exc:
            print(f"bench_targets.py: cannot write {args.markdown}: {exc}", file=sys.stderr)
            return 2
        print(f"# markdown written to {args.markdown}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
