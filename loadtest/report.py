"""Write results: rich console table, summary.json, requests.jsonl, summary.csv, report.html (plots)."""

from __future__ import annotations

import base64
import csv
import html
import io
import math
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from .runner import RunResult
from .summary import Summary


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _money(x: float | None) -> str:
    return "-" if x is None else f"${x:.4g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _rows(s: Summary) -> list[tuple[str, str]]:
    eng = s.engine or {}
    rows = [
        ("requests ok/failed", f"{s.completed}/{s.failed}" + (f" (+{s.warmup} warm-up)" if s.warmup else "")),
        ("duration s", _fmt(s.duration_s, 2)),
        ("request throughput /s", _fmt(s.request_throughput, 2)),
        ("output tokens /s", _fmt(s.output_token_throughput)),
        ("total tokens /s", _fmt(s.total_token_throughput)),
    ]
    if s.goodput is not None:
        rows.append(("goodput req/s (SLO met)", f"{_fmt(s.goodput, 2)} ({_pct(s.goodput_fraction)})"))
    for name, d in (("TTFT ms", s.ttft_ms), ("TPOT ms", s.tpot_ms), ("ITL ms", s.itl_ms), ("E2E ms", s.e2e_ms)):
        rows.append((f"{name} p50/p90/p99", f"{_fmt(d.p(50))} / {_fmt(d.p(90))} / {_fmt(d.p(99))}"))
        rows.append((f"{name} mean/max", f"{_fmt(d.mean)} / {_fmt(d.max)}"))
    rows.append(("output tok/s per request p50", _fmt(s.output_tps_per_request.p(50))))
    rows.append(("tokens/e2e s per request p50", _fmt(s.e2e_output_tps_per_request.p(50))))
    rows.append(("cached-token ratio (usage)", _pct(s.cached_ratio)))
    if eng:
        rows.append(("prefix-cache hit ratio (engine)", _pct(eng.get("prefix_hit_ratio"))))
        if eng.get("spec_acceptance_rate") is not None:
            rows.append(("spec-decode acceptance", f"{_pct(eng['spec_acceptance_rate'])} "
                         f"(mean accepted len {_fmt(eng.get('spec_mean_accepted_length'), 2)})"))
    rows.append(("cost total" + (f" ({s.cost_source})" if s.cost_source else ""), _money(s.cost_total)))
    rows.append(("cost / request", _money(s.cost_per_request)))
    rows.append(("cost / 1M tokens (in+out)", _money(s.cost_per_1m_tokens)))
    rows.append(("cost / 1M output tokens", _money(s.cost_per_1m_output_tokens)))
    if s.errors:
        rows.append(("errors", ", ".join(f"{k}={v}" for k, v in sorted(s.errors.items()))))
    rows.append(("client CPU µs / request", _fmt(s.client_cpu_us_per_request)))
    if s.send_lag_ms is not None and s.offered_rate is not None:
        rows.append(("send lag ms p99 (client)", _fmt(s.send_lag_ms.p(99), 2)))
    return rows


_RATIO_KEYS = (
    ("request throughput", lambda s: s.request_throughput, True),
    ("output tokens/s", lambda s: s.output_token_throughput, True),
    ("TTFT p50", lambda s: s.ttft_ms.p(50), False),
    ("TPOT p50", lambda s: s.tpot_ms.p(50), False),
    ("E2E p50", lambda s: s.e2e_ms.p(50), False),
    ("cost / 1M tokens", lambda s: s.cost_per_1m_tokens, False),
)


def print_summary(results: list[RunResult], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="yieldgate loadtest", show_lines=False)
    table.add_column("metric", style="bold")
    for r in results:
        table.add_column(r.target, justify="right")
    rows = [_rows(r.summary) for r in results]
    labels = [k for k, _ in rows[0]]
    for row in rows[1:]:
        labels += [k for k, _ in row if k not in labels]
    maps = [dict(row) for row in rows]
    for label in labels:
        table.add_row(label, *(m.get(label, "-") for m in maps))
    if len(results) > 1:
        base = results[0].summary
        table.add_section()
        for name, get, _ in _RATIO_KEYS:
            b = get(base)
            cells = []
            for r in results:
                v = get(r.summary)
                cells.append("-" if not b or v is None or (isinstance(v, float) and math.isnan(v))
                             or (isinstance(b, float) and math.isnan(b)) else f"{v / b:.2f}x")
            table.add_row(f"{name} vs {results[0].target}", *cells)
    console.print(table)
    for r in results:
        if r.steps:
            sweep = Table(title=f"rate sweep: {r.target}" + (f" — stopped: {r.stop_reason}" if r.stop_reason else ""))
            for col in ("offered /s", "sent /s", "achieved /s", "ok/failed", "TTFT p50", "TTFT p99", "TPOT p50", "out tok/s",
                        "goodput /s"):
                sweep.add_column(col, justify="right")
            for st in r.steps:
                s = st.summary
                sweep.add_row(_fmt(s.offered_rate, 2), _fmt(s.sent_rate, 2), _fmt(s.request_throughput, 2), f"{s.completed}/{s.failed}",
                              _fmt(s.ttft_ms.p(50)), _fmt(s.ttft_ms.p(99)), _fmt(s.tpot_ms.p(50)),
                              _fmt(s.output_token_throughput), _fmt(s.goodput, 2))
            console.print(sweep)


def ratios(results: list[RunResult]) -> dict[str, dict[str, float | None]]:
    """Each target's key figures divided by the first target's."""
    base = results[0].summary
    out: dict[str, dict[str, float | None]] = {}
    for r in results:
        row: dict[str, float | None] = {}
        for name, get, _ in _RATIO_KEYS:
            b, v = get(base), get(r.summary)
            ok = b and v is not None and not math.isnan(b) and not math.isnan(v)
            row[name] = v / b if ok else None
        out[r.target] = row
    return out


_CSV_FIELDS = (
    "target", "offered_rate", "sent_rate", "concurrency", "requests", "completed", "failed", "duration_s", "request_throughput",
    "output_token_throughput", "total_token_throughput", "goodput", "ttft_p50", "ttft_p90", "ttft_p99",
    "tpot_p50", "tpot_p90", "tpot_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p90", "e2e_p99", "cached_ratio",
    "e2e_output_tps_p50", "prefix_hit_ratio", "spec_acceptance_rate", "cost_total", "cost_per_request", "cost_per_1m_tokens",
    "client_cpu_us_per_request",
)


def _csv_row(s: Summary) -> dict[str, Any]:
    eng = s.engine or {}
    row = {k: getattr(s, k, None) for k in _CSV_FIELDS}
    for name, d in (("ttft", s.ttft_ms), ("tpot", s.tpot_ms), ("itl", s.itl_ms), ("e2e", s.e2e_ms)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}"] = d.p(q)
    row["e2e_output_tps_p50"] = s.e2e_output_tps_per_request.p(50)
    row["prefix_hit_ratio"] = eng.get("prefix_hit_ratio")
    row["spec_acceptance_rate"] = eng.get("spec_acceptance_rate")
    return {k: row.get(k) for k in _CSV_FIELDS}


def write_outputs(results: list[RunResult], out_dir: str | Path, *, meta: dict[str, Any] | None = None,
                  html_report: bool = True) -> dict[str, Path]:
    """Write every output file; returns {kind: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "summary.json", "jsonl": out / "requests.jsonl", "csv": out / "summary.csv"}
    doc = {"meta": meta or {}, "results": [r.to_summary_dict() for r in results],
           "ratios_vs_first": ratios(results) if len(results) > 1 else None}
    paths["json"].write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=2))
    enc = msgspec.json.Encoder()
    with paths["jsonl"].open("wb") as f:
        for r in results:
            for rec in r.records:
                f.write(enc.encode(rec))
                f.write(b"\n")
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=("step",) + _CSV_FIELDS)
        w.writeheader()
        for r in results:
            w.writerow({"step": "all", **_csv_row(r.summary)})
            for i, st in enumerate(r.steps):
                w.writerow({"step": i, **_csv_row(st.summary)})
    if html_report:
        paths["html"] = out / "report.html"
        paths["html"].write_text(render_html(results, meta or {}))
    return paths


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def plots(results: list[RunResult]) -> dict[str, str]:
    """Base64 PNGs: latency CDFs, throughput vs rate (sweeps), cache hit and cost per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, str] = {}
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT", "TPOT", "end-to-end latency")):
        for r in results:
            vals = sorted(getattr(x, key) for x in r.records if x.ok and not x.warmup and getattr(x, key) is not None)
            if vals:
                ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], label=r.target)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    out["latency_cdf"] = _png(fig)

    if any(r.steps for r in results):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.6))
        for r in results:
            rates = [st.summary.offered_rate for st in r.steps]
            a1.plot(rates, [st.summary.request_throughput for st in r.steps], "o-", label=f"{r.target} achieved")
            if any(st.summary.goodput is not None for st in r.steps):
                a1.plot(rates, [st.summary.goodput or 0 for st in r.steps], "x--", label=f"{r.target} goodput")
            a2.plot(rates, [st.summary.ttft_ms.p(50) for st in r.steps], "o-", label=f"{r.target} p50")
            a2.plot(rates, [st.summary.ttft_ms.p(99) for st in r.steps], "x--", label=f"{r.target} p99")
        a1.set_title("throughput vs offered rate")
        a1.set_xlabel("offered req/s")
        a1.set_ylabel("req/s")
        a2.set_title("TTFT vs offered rate")
        a2.set_xlabel("offered req/s")
        a2.set_ylabel("ms")
        for a in (a1, a2):
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
        out["sweep"] = _png(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.6))
    names = [r.target for r in results]
    usage = [r.summary.cached_ratio or 0.0 for r in results]
    engine = [((r.summary.engine or {}).get("prefix_hit_ratio") or 0.0) for r in results]
    xs = range(len(results))
    a1.bar([x - 0.2 for x in xs], usage, width=0.4, label="usage cached_tokens")
    a1.bar([x + 0.2 for x in xs], engine, width=0.4, label="engine /metrics")
    a1.set_xticks(list(xs), names, rotation=15, fontsize=7)
    a1.set_ylim(0, 1)
    a1.set_title("prefix-cache hit ratio")
    a1.legend(fontsize=7)
    a2.bar(list(xs), [r.summary.cost_per_1m_tokens or 0.0 for r in results])
    a2.set_xticks(list(xs), names, rotation=15, fontsize=7)
    a2.set_title("cost per 1M tokens (USD)")
    out["cache_cost"] = _png(fig)

    fig, ax = plt.subplots(figsize=(12, 3.2))
    for r in results:
        from .stats import throughput_windows

        ev = [(x.end_s, float(x.completion_tokens)) for x in r.records if x.ok and not x.warmup]
        if ev:
            win = max(0.25, (max(t for t, _ in ev) - min(t for t, _ in ev)) / 40)
            w = throughput_windows(ev, win)
            ax.step([t for t, _ in w], [v for _, v in w], where="post", label=r.target)
    ax.set_title("output tokens/s over time")
    ax.set_xlabel("s since start")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    out["timeline"] = _png(fig)
    return out


def render_html(results: list[RunResult], meta: dict[str, Any]) -> str:
    imgs = plots(results)
    head = "".join(f"<th>{html.escape(r.target)}</th>" for r in results)
    maps = [dict(_rows(r.summary)) for r in results]
    labels = list(maps[0])
    for m in maps[1:]:
        labels += [k for k in m if k not in labels]
    body = "".join(
        f"<tr><td>{html.escape(k)}</td>" + "".join(f"<td>{html.escape(m.get(k, '-'))}</td>" for m in maps) + "</tr>"
        for k in labels
    )
    sweeps = ""
    for r in results:
        if not r.steps:
            continue
        cells = "".join(
            f"<tr><td>{_fmt(st.summary.offered_rate, 2)}</td><td>{_fmt(st.summary.sent_rate, 2)}</td>"
            f"<td>{_fmt(st.summary.request_throughput, 2)}</td><td>{st.summary.completed}/{st.summary.failed}</td>"
            f"<td>{_fmt(st.summary.ttft_ms.p(50))}</td><td>{_fmt(st.summary.ttft_ms.p(99))}</td>"
            f"<td>{_fmt(st.summary.tpot_ms.p(50))}</td><td>{_fmt(st.summary.goodput, 2)}</td></tr>"
            for st in r.steps)
        stop = f" — stopped: {html.escape(r.stop_reason)}" if r.stop_reason else ""
        sweeps += (f"<h2>rate sweep: {html.escape(r.target)}{stop}</h2><table><tr><th>offered /s</th>"
                   "<th>sent /s</th><th>achieved /s</th><th>ok/failed</th><th>TTFT p50</th><th>TTFT p99</th>"
                   f"<th>TPOT p50</th><th>goodput /s</th></tr>{cells}</table>")
    pics = "".join(f'<h2>{html.escape(k.replace("_", " "))}</h2><img src="data:image/png;base64,{v}"/>'
                   for k, v in imgs.items())
    meta_txt = html.escape(msgspec.json.format(msgspec.json.encode(meta), indent=2).decode())
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>yieldgate loadtest</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}td:first-child{{text-align:left}}
img{{max-width:100%}}pre{{background:#f6f6f6;padding:1em}}</style></head><body>
<h1>yieldgate loadtest report</h1><table><tr><th>metric</th>{head}</tr>{body}</table>{sweeps}{pics}
<h2>run settings</h2><pre>{meta_txt}</pre></body></html>"""
