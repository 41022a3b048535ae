#!/usr/bin/env python3
"""Which hold of the pool's state lock each of vm's slow requests met, in one window of a
bench/admin-stall.sh (or delete-scale.sh) run kept with KEEP=1.

    CONDENSE_SLOW_HOLD_MS=0.3 KEEP=1 bench/admin-stall.sh 2000000 /work/as
    bench/stall-blame.py /work/as delete [THRESHOLD_MS]

A request is slow if its latency is over THRESHOLD_MS (default 0.42, about twice vm's idle read
p99 on the test machine). Its flight is fio's completion time minus its latency; it is counted
against the first hold in the serve's log (`the pool's state was held X ms by FILE:LINE`, ended
at the line's time) that overlaps it, with 1 ms of slack for the two clocks' resolution, else as
"none". Only holds the serve logged count: set CONDENSE_SLOW_HOLD_MS low enough. Prints counts
by direction and hold site; asserts nothing.
"""
import datetime
import glob
import re
import sys
from collections import Counter

if len(sys.argv) < 3:
    sys.exit(__doc__)
work, name = sys.argv[1], sys.argv[2]
thr = float(sys.argv[3]) if len(sys.argv) > 3 else 0.42
lat = []
for path in glob.glob(f"{work}/*_clat.*.log"):
    for line in open(path):
        f = [x.strip() for x in line.split(",")]
        if len(f) >= 3 and f[2] in ("0", "1"):
            lat.append((int(f[0]), int(f[1]) / 1e6, int(f[2])))
windows = {}
for line in open(f"{work}/windows"):
    p = line.split()
    windows[p[0]] = (int(p[1]), int(p[2]))
if name not in windows:
    sys.exit(f"no window {name!r} in {work}/windows (there are: {', '.join(windows)})")
a, b = windows[name]
b = max(b, a + 1000)  # as the table: at least the first second
holds = []
held = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z.*held ([0-9.]+) ms by (\S+)")
for line in open(f"{work}/serve.log", errors="replace"):
    m = held.search(line)
    if m:
        t = datetime.datetime.fromisoformat(m.group(1)).replace(tzinfo=datetime.timezone.utc)
        end = t.timestamp() * 1000
        holds.append((end - float(m.group(2)), end, m.group(3)))
near = [h for h in holds if a - 100 <= h[1] <= b + 100]
print(f"{name}: {len(near)} holds logged, by site: {Counter(h[2] for h in near).most_common(8)}")
n = sum(1 for t, _, _ in lat if a <= t <= b)
slow = [(t, ms, d) for t, ms, d in lat if a <= t <= b and ms > thr]
print(f"{n} requests, {len(slow)} over {thr} ms ({100 * len(slow) / max(n, 1):.2f} %)")
by = Counter()
for t, ms, d in slow:
    met = [h for h in near if h[0] < t + 1 and h[1] > t - ms - 1]
    by[("read" if d == 0 else "write", met[0][2] if met else "none")] += 1
for (direction, site), count in by.most_common():
    print(f"  {direction:5s} {site:45s} {count}")
