#!/usr/bin/env python3
"""Side-by-side table of `scripts/load.py --sweep` (ember serve) and `llama-batched-bench` outputs:
total tokens (prompt + generated) per second of wall time by sequence count, and the ratio."""
import sys
# load.py's sweep table: clients, reqs, ok, wall s, prompt, gen, total t/s, ...
ember = {}
try:
    for line in open(sys.argv[1]):
        cols = line.split()
        if len(cols) > 6 and cols[0].isdigit():
            ember[int(cols[0])] = (float(cols[6]), float(cols[3]))
except OSError:
    pass
# llama-batched-bench: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
llama = {}
try:
    for line in open(sys.argv[2]):
        cols = [c.strip() for c in line.split("|")]
        if len(cols) > 10 and cols[1].isdigit():
            llama[int(cols[3])] = (float(cols[10]), float(cols[9]))
except OSError:
    pass
print()
print("| sequences | llama.cpp total t/s (wall s) | ember serve total t/s (wall s) | ember / llama.cpp |")
print("| ---: | ---: | ---: | ---: |")
for n in sorted(set(ember) | set(llama)):
    e, l = ember.get(n), llama.get(n)
    ratio = f"{e[0] / l[0]:.2f}" if e and l else "-"
    fmt = lambda v: f"{v[0]:.0f} ({v[1]:.2f})" if v else "-"
    print(f"| {n} | {fmt(l)} | {fmt(e)} | {ratio} |")
