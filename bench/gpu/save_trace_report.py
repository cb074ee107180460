"""Lines up save_trace.py's client timestamps with the server's debug log and prints where one
Save's time goes, medians over the Saves after the first five:

    python3 save_trace_report.py SERVER_LINES CLIENT_JSONL

- to_recv: from the client's call to the server's "save received" (the client building and
  encoding the request, HTTP/2, the server's decode);
- handler: "save received" to "save answered" (the engine: validation, planning, allocation,
  the copy, the hand-offs around it);
- transport: the copy batch's own time (`total_us`), and how long the handler spent before it
  started and after it ended;
- with the engine's debug lines in the log ("save started", "save copy starting"), also
  to_engine ("save received" to "save started"), plan ("save started" to "save copy starting":
  validation, planning, allocation) and to_worker ("save copy starting" to the copy batch's
  start: the hand-off to the copy worker, its queue wait included);
- to_client: "save answered" to the client's return;
- between: the client's time between two calls.
"""
import datetime, json, re, statistics as st, sys

def clean(l):
    return re.sub(r"\x1b\[[0-9;]*m", "", l)

def ts(l):
    t = l.split()[0].rstrip("Z")
    return datetime.datetime.fromisoformat(t).replace(tzinfo=datetime.timezone.utc).timestamp() * 1e9

lines = [clean(l) for l in open(sys.argv[1])]
rows = [json.loads(l) for l in open(sys.argv[2])]
ev = []
for l in lines:
    if "save received" in l: ev.append(("recv", ts(l), 0))
    elif "save answered" in l: ev.append(("ans", ts(l), 0))
    elif "save started" in l: ev.append(("start", ts(l), 0))
    elif "save copy starting" in l: ev.append(("copying", ts(l), 0))
    elif "copy batch" in l:
        m = re.search(r"total_us=(\d+)", l)
        ev.append(("copy", ts(l), int(m.group(1)) * 1e3 if m else 0))
out = []
for r in rows[5:]:
    s, e = r["call_start"], r["call_end"]
    inside = [x for x in ev if s <= x[1] <= e]
    recv = next((x[1] for x in inside if x[0] == "recv"), None)
    ans = next((x[1] for x in inside if x[0] == "ans"), None)
    copy = next((x for x in inside if x[0] == "copy"), None)
    if recv is None or ans is None or copy is None:
        continue
    row = {
        "to_recv": recv - s, "handler": ans - recv, "transport": copy[2],
        "before_transport": copy[1] - copy[2] - recv, "after_transport": ans - copy[1],
        "to_client": e - ans, "call": e - s,
    }
    start = next((x[1] for x in inside if x[0] == "start"), None)
    copying = next((x[1] for x in inside if x[0] == "copying"), None)
    if start is not None and copying is not None:
        row.update(to_engine=start - recv, plan=copying - start,
                   to_worker=copy[1] - copy[2] - copying)
    out.append(row)
gaps = [rows[i + 1]["call_start"] - rows[i]["call_end"] for i in range(5, len(rows) - 1)]
for k in (out[0] if out else {}):
    v = [o[k] / 1e3 for o in out if k in o]
    print(f"{k:17s} median {st.median(v):8.0f} us  (min {min(v):.0f}, max {max(v):.0f})")
if gaps:
    print(f"{'between':17s} median {st.median(gaps) / 1e3:8.0f} us")
print(f"Saves matched: {len(out)} of {len(rows) - 5}")
