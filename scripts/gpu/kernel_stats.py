#!/usr/bin/env python3
"""Summarises `ncu --page details` text (one or more kernels profiled with `--set full`) as one
table row per kernel launch: what limits a decode kernel at a glance (time, registers, grid and
waves, occupancy, issue rate, DRAM share, instructions).

Usage: kernel_stats.py DETAILS.txt"""
import re
import sys

FIELDS = [
    ("Duration", "time"),
    ("Registers Per Thread", "regs"),
    ("Grid Size", "grid"),
    ("Block Size", "block"),
    ("Waves Per SM", "waves"),
    ("Achieved Occupancy", "occupancy %"),
    ("Executed Ipc Active", "IPC"),
    ("Warp Cycles Per Issued Instruction", "cycles/instr"),
    ("Active Warps Per Scheduler", "warps/sched"),
    ("DRAM Throughput", "DRAM %"),
    ("Issued Instructions", "instructions"),
]
HEADER = re.compile(r"^\s{2}(\S+) \(([\d, ]+)\)x\(([\d, ]+)\), Context")
METRIC = re.compile(r"^\s{4}(\S.*?)\s{2,}(\S+)?\s+([\d.,]+)\s*$")


def parse(lines):
    kernels, current = [], None
    for line in lines:
        head = HEADER.match(line)
        if head:
            current = {"name": head.group(1)}
            kernels.append(current)
            continue
        if current is None:
            continue
        metric = METRIC.match(line)
        if not metric:
            continue
        name, unit, value = metric.group(1).strip(), metric.group(2) or "", metric.group(3)
        for field, _ in FIELDS:
            # The first value of a metric wins (a section may repeat a name).
            if name == field and field not in current:
                if field == "Duration":
                    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3}.get(unit, 1.0)
                    current[field] = f"{float(value.replace(',', '')) * scale:.2f} us"
                else:
                    current[field] = value
    return kernels


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1], errors="replace") as f:
        kernels = parse(f.read().splitlines())
    if not kernels:
        sys.exit(f"{sys.argv[1]}: no kernel sections (ncu --page details output expected)")
    print("| kernel | " + " | ".join(label for _, label in FIELDS) + " |")
    print("| --- |" + " ---: |" * len(FIELDS))
    for k in kernels:
        print(f"| {k['name']} | " + " | ".join(k.get(field, "-") for field, _ in FIELDS) + " |")


if __name__ == "__main__":
    main()
