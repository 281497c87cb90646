"""Sums up a battery run (``run.sh``'s results): programs launching more kernels than plain
``jax.jit``, estimated slower, over the memory budget or computing other values, and the
totals ``docs/benchmarks.md`` quotes.

    python benchmarks/battery/summarize.py RESULTS_DIR
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys

MIB = 2**20


def main(directory: str) -> int:
    rows = [json.load(open(path)) for path in sorted(glob.glob(os.path.join(directory, "*.json")))]
    flagged = 0
    for row in rows:
        plain, ours = row.get("plain_launches"), row.get("jaxpar_launches")
        plain_temp, temp = row.get("plain_temp") or 0, row.get("jaxpar_temp") or 0
        bad = []
        if row.get("violation"):
            bad.append("over the memory budget (jaxpar's own check)")
        if plain is not None and ours is not None and ours > plain:
            bad.append(f"launches {plain} -> {ours}")
        if (row.get("time_ratio") or 0) > 1.01:
            bad.append(f"estimated x{row['time_ratio']:.3f}")
        if temp > plain_temp + max(0.1 * plain_temp, MIB):
            bad.append(f"temporaries {plain_temp / MIB:.2f} -> {temp / MIB:.2f} MiB")
        for key in ("values_ok", "grads_ok"):
            if row.get(key) is False:
                bad.append(f"{key}: {row.get(key.replace('ok', 'msg'))}")
        if "inspect_error" in row or "build_error" in row:
            bad.append(f"error: {row.get('inspect_error') or row.get('build_error')}"[:200])
        if "preview_error" in row:  # a deviceless compile's limit (host callbacks), said so
            print(f"{row['name']}: not compiled deviceless: {row['preview_error'][:160]}")
        if bad:
            flagged += 1
            print(f"{row['name']}: " + "; ".join(bad))
    ratios = [row["time_ratio"] for row in rows if row.get("time_ratio")]
    fewer = sum(1 for row in rows if row.get("jaxpar_launches") is not None
                and row["jaxpar_launches"] < row["plain_launches"])
    inexact = sum(1 for row in rows if row.get("values_msg") not in (None, "exact"))
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
    print(f"{len(rows)} programs, {len(ratios)} compiled both ways; {flagged} flagged; "
          f"{fewer} launch fewer kernels; values not bit-exact on {inexact}; "
          f"estimated geomean x{geomean:.3f}")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
