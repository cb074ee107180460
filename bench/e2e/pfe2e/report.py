"""Results of a run: the JSON-lines records the harness writes, and what is made of them —
the TTFT table (markdown), the physical-floor table (item 4 of bench/e2e/README.md), the
multi-request summary, the goal checks and an SVG chart of TTFT against context length.
Plain Python: runs anywhere, also on a run's partial output (`python3 -m pfe2e.report OUT`).

Records (one JSON object per line, `kind` says which): `env` (card, versions, bus rates),
`cold` (TTFT of one forward over the whole prompt), `suffix_alone` (the suffix forward on
an already built cache), `hit` (one server, tier and context length: per-rep phase times,
byte and logit checks), `trace` (the multi-request run), `stage` (a stage's end, done or
failed, with why), `note` (anything said along the way). Never imports torch.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Iterable, Sequence

# --------------------------------------------------------------------------------------------
# records
# --------------------------------------------------------------------------------------------


def read_records(path: str | Path) -> list[dict]:
    """The records of a results file; lines that are not JSON objects are skipped (a run
    killed mid-line leaves one)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if isinstance(r, dict):
                    out.append(r)
    except FileNotFoundError:
        pass
    return out


def median(xs: Sequence[float]) -> float | None:
    """The median, `None` for no values."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (`q` in 0..100), `None` for no values."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = max(1, math.ceil(q / 100.0 * len(xs)))
    return xs[min(k, len(xs)) - 1]


def mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def fmt_ms(s: float | None, digits: int = 1) -> str:
    """Seconds as milliseconds, `–` for none."""
    if s is None:
        return "–"
    ms = s * 1000.0
    if ms >= 100:
        return f"{ms:.0f}"
    return f"{ms:.{digits}f}"


def fmt_tokens(n: int) -> str:
    """`1K`, `32K`, or the plain number when not a multiple of 1024."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


# --------------------------------------------------------------------------------------------
# the TTFT table
# --------------------------------------------------------------------------------------------

#: Columns of the TTFT table: (server, tier, backend or None for any, header).
HIT_COLUMNS = [
    ("ours", "dram", None, "ours DRAM hit"),
    ("ours", "ssd", None, "ours SSD hit"),
    ("ours", "peer", None, "ours peer hit"),
    ("pegaflow", "dram", "direct", "PegaFlow DRAM hit (direct)"),
    ("pegaflow", "dram", "kernel", "PegaFlow DRAM hit (kernel)"),
    ("pegaflow", "ssd", None, "PegaFlow SSD hit"),
]


def hit_index(records: Iterable[dict]) -> dict[tuple[str, str, str, int], dict]:
    """`hit` records by (server, tier, backend, tokens); a later record replaces an earlier."""
    out = {}
    for r in records:
        if r.get("kind") == "hit":
            out[(r.get("server"), r.get("tier"), r.get("backend"), int(r.get("tokens", 0)))] = r
    return out


def cold_index(records: Iterable[dict]) -> dict[int, dict]:
    """`cold` records by tokens, the first server stage's first (all measure the same GPU work)."""
    out: dict[int, dict] = {}
    for r in records:
        if r.get("kind") == "cold":
            out.setdefault(int(r["tokens"]), r)
    return out


def find_hit(hits: dict, server: str, tier: str, backend: str | None, tokens: int) -> dict | None:
    for (s, t, b, n), r in hits.items():
        if s == server and t == tier and n == tokens and (backend is None or b == backend):
            return r
    return None


def hit_cell(r: dict | None) -> str:
    """A table cell: the median TTFT in ms, marked when not exact or not a whole hit."""
    if r is None:
        return "–"
    if r.get("status") != "ok":
        return f"✗ ({r.get('status', 'failed')})"
    cell = fmt_ms(r.get("median_ttft_s"))
    if not (r.get("byte_exact") and r.get("logit_exact")):
        cell += " ✗exact"
    return cell


def ttft_table(records: Sequence[dict]) -> str:
    """The markdown TTFT table: one row per context length, medians in ms."""
    hits = hit_index(records)
    colds = cold_index(records)
    lengths = sorted(set(colds) | {k[3] for k in hits})
    cols = [c for c in HIT_COLUMNS if any(k[0] == c[0] and k[1] == c[1] and (c[2] is None or k[2] == c[2]) for k in hits)]
    head = ["context", "KV (GiB)", "cold prefill"] + [c[3] for c in cols] + ["cold / ours DRAM", "exact (bytes, logits)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in lengths:
        cold = colds.get(n)
        cold_s = cold.get("median_s") if cold else None
        row_hits = [find_hit(hits, c[0], c[1], c[2], n) for c in cols]
        kv = next((h.get("kv_bytes") for h in row_hits if h and h.get("kv_bytes")), None)
        dram = find_hit(hits, "ours", "dram", None, n)
        speedup = "–"
        if cold_s and dram and dram.get("status") == "ok" and dram.get("median_ttft_s"):
            speedup = f"{cold_s / dram['median_ttft_s']:.1f}×"
        done = [h for h in row_hits if h and h.get("status") == "ok"]
        exact = "–" if not done else ("yes" if all(h.get("byte_exact") and h.get("logit_exact") for h in done) else "NO")
        cells = [fmt_tokens(n), "–" if kv is None else f"{kv / 2**30:.2f}", fmt_ms(cold_s)] + [hit_cell(h) for h in row_hits] + [speedup, exact]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the physical floor (item 4)
# --------------------------------------------------------------------------------------------


def floor_rows(records: Sequence[dict], server: str = "ours", tier: str = "dram") -> list[dict]:
    """Per context length of `server`'s `tier` hits: the median phases, the floor
    (`kv_bytes / h2d_bus_bytes_per_s + suffix_alone_s`) and where the time above it goes."""
    env = next((r for r in records if r.get("kind") == "env"), {})
    bus = env.get("h2d_bytes_per_s")
    alone = {int(r["tokens"]): r.get("median_s") for r in records if r.get("kind") == "suffix_alone"}
    rows = []
    for (s, t, b, n), r in sorted(hit_index(records).items(), key=lambda kv: kv[0][3]):
        if s != server or t != tier or r.get("status") != "ok":
            continue
        reps = r.get("reps") or []
        ph = {k: median([x.get(k) for x in reps]) for k in ("query_s", "load_s", "rebuild_s", "suffix_s", "ttft_s")}
        kv = r.get("kv_bytes") or 0
        bus_s = kv / bus if bus else None
        sa = alone.get(n)
        floor = bus_s + sa if bus_s is not None and sa is not None else None
        total = r.get("median_ttft_s")
        rows.append({
            "tokens": n, "backend": b, "kv_bytes": kv, "ttft_s": total, **ph,
            "bus_s": bus_s, "suffix_alone_s": sa, "floor_s": floor,
            "ratio": (total / floor) if total and floor else None,
            "load_over_bus_s": (ph["load_s"] - bus_s) if ph["load_s"] is not None and bus_s is not None else None,
            "suffix_over_alone_s": (ph["suffix_s"] - sa) if ph["suffix_s"] is not None and sa is not None else None,
            "load_gbps": (kv / ph["load_s"] / 1e9) if ph["load_s"] else None,
        })
    return rows


def floor_table(records: Sequence[dict], server: str = "ours", tier: str = "dram") -> str:
    """The markdown table of `floor_rows`."""
    rows = floor_rows(records, server, tier)
    if not rows:
        return ""
    head = ["context", "hit TTFT", "query", "load", "load GB/s", "rebuild", "suffix fwd", "floor = KV/bus + suffix alone", "hit / floor",
            "load − KV/bus", "suffix − alone"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            fmt_tokens(r["tokens"]), fmt_ms(r["ttft_s"], 2), fmt_ms(r["query_s"], 2), fmt_ms(r["load_s"], 2),
            "–" if r["load_gbps"] is None else f"{r['load_gbps']:.1f}", fmt_ms(r["rebuild_s"], 2), fmt_ms(r["suffix_s"], 2),
            f"{fmt_ms(r['floor_s'], 2)} ({fmt_ms(r['bus_s'], 2)} + {fmt_ms(r['suffix_alone_s'], 2)})",
            "–" if r["ratio"] is None else f"{r['ratio']:.2f}×", fmt_ms(r["load_over_bus_s"], 2), fmt_ms(r["suffix_over_alone_s"], 2),
        ]) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# goals
# --------------------------------------------------------------------------------------------


def goal_lines(records: Sequence[dict]) -> list[str]:
    """The issue's goals checked against the records (each line says met / not met / not measured)."""
    hits = hit_index(records)
    colds = cold_index(records)
    out = []
    lengths = sorted(colds)

    def ok(r):
        return r is not None and r.get("status") == "ok"

    big = max(lengths) if lengths else None
    if big is not None:
        d = find_hit(hits, "ours", "dram", None, big)
        c = colds[big].get("median_s")
        if ok(d) and c:
            ratio = d["median_ttft_s"] / c
            out.append(f"DRAM hit at {fmt_tokens(big)}: {fmt_ms(d['median_ttft_s'])} ms = 1/{1 / ratio:.1f} of cold {fmt_ms(c)} ms "
                       f"(goal ≤ 1/10): {'met' if ratio <= 0.1 else 'NOT met'}")
    for r in floor_rows(records):
        if r["ratio"] is not None:
            out.append(f"hit/floor at {fmt_tokens(r['tokens'])}: {r['ratio']:.2f}× (goal ≤ 1.2×): {'met' if r['ratio'] <= 1.2 else 'NOT met'}")
    for n in lengths:
        d = find_hit(hits, "ours", "dram", None, n)
        pf = [h for (s, t, b, m), h in hits.items() if s == "pegaflow" and t == "dram" and m == n and ok(h)]
        if ok(d) and pf:
            best = min(pf, key=lambda h: h["median_ttft_s"])
            out.append(f"{fmt_tokens(n)}: ours DRAM {fmt_ms(d['median_ttft_s'])} ms vs PegaFlow's best DRAM ({best.get('backend')}) "
                       f"{fmt_ms(best['median_ttft_s'])} ms: {'ahead' if d['median_ttft_s'] < best['median_ttft_s'] else 'NOT ahead'}")
        s = find_hit(hits, "ours", "ssd", None, n)
        c = colds.get(n, {}).get("median_s")
        if ok(s) and c:
            verdict = "faster than cold" if s["median_ttft_s"] < c else f"slower than cold by {fmt_ms(s['median_ttft_s'] - c)} ms"
            rate = s.get("ssd_read_gbps")
            need = ssd_break_even_gbps(s, c)
            parts = [f"promotion read {rate:.2f} GB/s"] if rate else []
            parts.append("the rest of the hit alone takes longer than cold" if need is None else f"beating cold needs ≥ {need:.2f} GB/s")
            out.append(f"{fmt_tokens(n)}: ours SSD hit {fmt_ms(s['median_ttft_s'])} ms vs cold {fmt_ms(c)} ms: {verdict} ({'; '.join(parts)})")
    bad = [h for h in hits.values() if ok(h) and not (h.get("byte_exact") and h.get("logit_exact"))]
    n_ok = sum(1 for h in hits.values() if ok(h))
    out.append(f"byte- and logit-exact: {n_ok - len(bad)} of {n_ok} hit measurements" + ("" if not bad else " — NOT all exact"))
    return out


def ssd_break_even_gbps(hit: dict, cold_s: float) -> float | None:
    """The read rate (GB/s) at which an SSD hit would take as long as the cold forward: the
    prefix's bytes over the time the cold forward leaves once the hit's other phases (all but
    the query, which is the read) are paid; `None` when those alone take longer than cold."""
    reps = hit.get("reps") or []
    q = median([x.get("query_s") for x in reps])
    t = hit.get("median_ttft_s")
    kv = hit.get("kv_bytes")
    if q is None or t is None or not kv:
        return None
    left = cold_s - (t - q)
    return kv / left / 1e9 if left > 0 else None


# --------------------------------------------------------------------------------------------
# the multi-request run
# --------------------------------------------------------------------------------------------


def trace_summary(records: Sequence[dict]) -> str:
    """Markdown lines of the `trace` record (the last one)."""
    t = next((r for r in reversed(records) if r.get("kind") == "trace"), None)
    if t is None:
        return ""
    head = ["", "requests", "prompt tokens", "block hit rate", "TTFT mean", "TTFT p50", "TTFT p99"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines.append("| without the server (full prefill) | {} | {} | – | {} | {} | {} |".format(
        t.get("requests"), t.get("tokens"), fmt_ms(t.get("without_mean_s")), fmt_ms(t.get("without_p50_s")), fmt_ms(t.get("without_p99_s"))))
    lines.append("| with the server (DRAM + SSD) | {} | {} | {:.1%} | {} | {} | {} |".format(
        t.get("requests"), t.get("tokens"), t.get("hit_rate") or 0.0, fmt_ms(t.get("with_mean_s")), fmt_ms(t.get("with_p50_s")), fmt_ms(t.get("with_p99_s"))))
    lines.append("")
    lines.append(f"LRU simulation of the DRAM tier alone ({t.get('pool')}): block hit rate {t.get('sim_lru_hit_rate', 0):.1%}; "
                 f"an unbounded cache: {t.get('sim_infinite_hit_rate', 0):.1%}; the server: {t.get('hit_rate', 0):.1%} "
                 f"({t.get('loading_answers', 0)} queries answered Loading: blocks promoted from the SSD). "
                 f"Argmax agreement with the full prefill: {t.get('argmax_agree', 0)}/{t.get('requests', 0)}; "
                 f"loaded bytes exact: {t.get('byte_exact')}.")
    if t.get("note"):
        lines.append(str(t["note"]))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the chart
# --------------------------------------------------------------------------------------------

#: Series of the chart: (label, server, tier, backend or None, colour, dash).
CHART_SERIES = [
    ("cold prefill", None, "cold", None, "#444444", ""),
    ("ours: DRAM hit", "ours", "dram", None, "#1f77b4", ""),
    ("ours: SSD hit", "ours", "ssd", None, "#1f77b4", "6,4"),
    ("ours: peer hit", "ours", "peer", None, "#17becf", "2,3"),
    ("PegaFlow 0.25.1: DRAM hit (direct)", "pegaflow", "dram", "direct", "#d62728", ""),
    ("PegaFlow 0.25.1: DRAM hit (kernel)", "pegaflow", "dram", "kernel", "#ff7f0e", ""),
    ("PegaFlow 0.25.1: SSD hit", "pegaflow", "ssd", None, "#d62728", "6,4"),
]


def chart_series(records: Sequence[dict]) -> list[tuple[str, str, str, list[tuple[int, float]]]]:
    """(label, colour, dash, [(tokens, median TTFT s)]) per series that has points."""
    hits = hit_index(records)
    colds = cold_index(records)
    out = []
    for label, server, tier, backend, colour, dash in CHART_SERIES:
        if tier == "cold":
            pts = [(n, r["median_s"]) for n, r in sorted(colds.items()) if r.get("median_s")]
        else:
            pts = []
            for n in sorted({k[3] for k in hits}):
                r = find_hit(hits, server, tier, backend, n)
                if r and r.get("status") == "ok" and r.get("median_ttft_s"):
                    pts.append((n, r["median_ttft_s"]))
        if pts:
            out.append((label, colour, dash, pts))
    return out


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def svg_chart(records: Sequence[dict], title: str = "Time to first token against context length") -> str:
    """An SVG line chart of median TTFT (ms, log scale) against context length (tokens, log 2
    scale), one line per series of `CHART_SERIES` with points; a note when there is none."""
    series = chart_series(records)
    W, H = 860, 520
    left, right, top, bottom = 70, 290, 50, 60
    pw, ph = W - left - right, H - top - bottom
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{left}" y="25" font-size="15" font-weight="bold">{_esc(title)}</text>']
    if not series:
        parts.append(f'<text x="{left}" y="{top + 40}">no measurements</text></svg>')
        return "\n".join(parts)
    xs = sorted({n for _, _, _, pts in series for n, _ in pts})
    ys = [y * 1000 for _, _, _, pts in series for _, y in pts]
    x0, x1 = math.log2(xs[0]), math.log2(xs[-1])
    if x1 - x0 < 1e-9:
        x0, x1 = x0 - 1, x1 + 1
    y0 = math.floor(math.log10(min(ys)))
    y1 = math.ceil(math.log10(max(ys)))
    if y1 <= y0:
        y1 = y0 + 1

    def px(n: float) -> float:
        return left + (math.log2(n) - x0) / (x1 - x0) * pw

    def py(ms: float) -> float:
        return top + ph - (math.log10(ms) - y0) / (y1 - y0) * ph

    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
    for e in range(y0, y1 + 1):
        for m in (1, 2, 5):
            v = m * 10 ** e
            if v < 10 ** y0 or v > 10 ** y1:
                continue
            y = py(v)
            parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#e4e4e4"/>')
            label = f"{v:g}" if v >= 1 else f"{v:.3g}"
            parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    for n in xs:
        x = px(n)
        parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#e4e4e4"/>')
        parts.append(f'<text x="{x:.1f}" y="{top + ph + 18}" text-anchor="middle">{fmt_tokens(n)}</text>')
    parts.append(f'<text x="{left + pw / 2:.0f}" y="{H - 15}" text-anchor="middle">context length (tokens)</text>')
    parts.append(f'<text x="18" y="{top + ph / 2:.0f}" text-anchor="middle" transform="rotate(-90 18 {top + ph / 2:.0f})">TTFT (ms, log scale)</text>')
    for i, (label, colour, dash, pts) in enumerate(series):
        d = " ".join(f"{'M' if j == 0 else 'L'}{px(n):.1f},{py(y * 1000):.1f}" for j, (n, y) in enumerate(pts))
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="2"{dash_attr}/>')
        for n, y in pts:
            parts.append(f'<circle cx="{px(n):.1f}" cy="{py(y * 1000):.1f}" r="3" fill="{colour}"><title>{_esc(label)}: {fmt_tokens(n)} {fmt_ms(y)} ms</title></circle>')
        ly = top + 10 + i * 20
        parts.append(f'<line x1="{left + pw + 15}" y1="{ly}" x2="{left + pw + 45}" y2="{ly}" stroke="{colour}" stroke-width="2"{dash_attr}/>')
        parts.append(f'<text x="{left + pw + 52}" y="{ly + 4}">{_esc(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# the whole report
# --------------------------------------------------------------------------------------------


def env_lines(records: Sequence[dict]) -> list[str]:
    env = next((r for r in records if r.get("kind") == "env"), None)
    if not env:
        return []
    out = [f"{env.get('date', '?')} — {env.get('gpu', '?')} (driver {env.get('driver', '?')}), torch {env.get('torch', '?')}, "
           f"transformers {env.get('transformers', '?')}, model {env.get('model', '?')} (random weights, bf16, sdpa), "
           f"layout {env.get('layout', '?')}, {env.get('new_tokens', '?')} new tokens per hit"]
    if env.get("h2d_bytes_per_s"):
        out.append(f"bus (pinned, one {env.get('bus_probe_mib', '?')} MiB copy, median): host→device {env['h2d_bytes_per_s'] / 1e9:.1f} GB/s, "
                   f"device→host {env.get('d2h_bytes_per_s', 0) / 1e9:.1f} GB/s")
    if env.get("ssd_medium"):
        out.append(f"SSD tier directory: {env['ssd_medium']}")
    if env.get("command"):
        out.append(f"command: `{env['command']}`")
    return out


def markdown(records: Sequence[dict]) -> str:
    """The whole report as markdown."""
    parts = ["## Time to first token: cold against a cache hit", ""]
    parts += [f"- {l}" for l in env_lines(records)]
    parts += ["", "Median TTFT in ms (one prompt at a time; a hit = query until Ready, Load, rebuild the cache from the pages, forward of the new tokens).", "",
              ttft_table(records), ""]
    ft = floor_table(records)
    if ft:
        parts += ["### A DRAM hit against its physical floor (ms, medians)", "", ft, ""]
    parts += ["### Goals", ""] + [f"- {l}" for l in goal_lines(records)] + [""]
    ts = trace_summary(records)
    if ts:
        parts += ["### Multi-request run (Mooncake conversation trace, scaled)", "", ts, ""]
    stages = [r for r in records if r.get("kind") == "stage"]
    if stages:
        parts += ["### Stages", ""] + [f"- {s.get('stage')}: {s.get('status')}" + (f" — {s.get('why')}" if s.get("why") else "")
                                       + (f" ({s.get('elapsed_s', 0):.0f} s)" if s.get("elapsed_s") is not None else "") for s in stages] + [""]
    notes = [r for r in records if r.get("kind") == "note"]
    if notes:
        parts += ["### Notes", ""] + [f"- {n.get('text')}" for n in notes] + [""]
    return "\n".join(parts)


def write_all(out_dir: str | Path, records: Sequence[dict] | None = None) -> str:
    """Writes `report.md`, `ttft.svg` and `results.json` (every record, one list) into
    `out_dir` from its `results.jsonl`; returns the markdown."""
    out = Path(out_dir)
    recs = list(records) if records is not None else read_records(out / "results.jsonl")
    md = markdown(recs)
    (out / "report.md").write_text(md + "\n", encoding="utf-8")
    (out / "ttft.svg").write_text(svg_chart(recs) + "\n", encoding="utf-8")
    (out / "results.json").write_text(json.dumps(recs, indent=1) + "\n", encoding="utf-8")
    return md


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python3 -m pfe2e.report OUT_DIR  (reads OUT_DIR/results.jsonl; writes report.md, ttft.svg, results.json)", file=sys.stderr)
        return 2
    print(write_all(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
