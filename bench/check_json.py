#!/usr/bin/python3
"""Runs a benchmark with --json and checks that its output follows the one
convention of every Memory DVR benchmark (docs/performance.md, "Reading the
figures"), then passes it through:

    bench/check_json.py -- build/dvr-bench --size 64M --repeat 1 --json

Every line of stdout is a JSON object with name, value, unit, peer, peer_value
and ratio; value and peer_value are numbers of the same unit; and ratio says
how many times better ours is than the peer (above 1: ours is better):
peer_value / value for costs (units s, B), value / peer_value for rates (units
op/s, GB/s, B/s). A figure without a peer has peer_value and ratio null; a
ratio that would divide by 0 is null next to its peer_value.
Exits with the benchmark's status when the output conforms (77, skipped, too),
1 when a line does not, naming the line and what is wrong.
"""

import json
import math
import subprocess
import sys

COSTS = {"s", "B"}
RATES = {"op/s", "GB/s", "B/s"}
REQUIRED = ("name", "value", "unit", "peer", "peer_value", "ratio")


def problems(line):
    """What is wrong with one output line ([] when nothing)."""
    try:
        fig = json.loads(line)
    except json.JSONDecodeError as e:
        return [f"not JSON ({e})"]
    if not isinstance(fig, dict):
        return ["not a JSON object"]
    missing = [k for k in REQUIRED if k not in fig]
    if missing:
        return [f"missing {', '.join(missing)}"]
    unit, value, peer_value, ratio = fig["unit"], fig["value"], fig["peer_value"], fig["ratio"]
    if unit not in COSTS | RATES:
        return [f"unit {unit!r} is neither a cost ({', '.join(sorted(COSTS))}) nor a rate ({', '.join(sorted(RATES))})"]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return [f"value {value!r} is not a number"]
    if peer_value is None or ratio is None:
        if peer_value is None and ratio is None:
            return []
        undefined = unit in COSTS and value == 0 or unit in RATES and peer_value == 0
        if ratio is None and isinstance(peer_value, (int, float)) and undefined:
            return []  # the division has no finite result: null, as JSON has no infinity
        return ["peer_value and ratio must both be null or both numbers (ratio alone null only where it divides by 0)"]
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (peer_value, ratio)):
        return ["peer_value or ratio is not a number"]
    if value == 0 or peer_value == 0:
        return []  # nothing to divide by: any ratio is a convention of its own
    expect = peer_value / value if unit in COSTS else value / peer_value
    # (printed with 6 significant digits: equal to about 1e-5)
    if not math.isclose(ratio, expect, rel_tol=1e-4, abs_tol=1e-12):
        kind = "peer_value / value (a cost)" if unit in COSTS else "value / peer_value (a rate)"
        return [f"ratio {ratio} is not {kind} = {expect}"]
    return []


def main(argv):
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd = argv[argv.index("--") + 1:]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    bad = 0
    figures = 0
    for n, line in enumerate(proc.stdout.splitlines(), 1):
        sys.stdout.write(line + "\n")
        if not line.strip():
            continue
        figures += 1
        for why in problems(line):
            bad += 1
            print(f"check_json: line {n} of {cmd[0]}: {why}: {line[:200]}", file=sys.stderr)
    if proc.returncode != 0:
        return proc.returncode
    if figures == 0:
        print(f"check_json: {cmd[0]} printed no figures", file=sys.stderr)
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
