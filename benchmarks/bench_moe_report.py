"""bench_moe.py's comparison with the issue's reference figures and its tables."""
from __future__ import annotations

from bench_moe_kernels import ROUTINGS

REFERENCE = {  # the issue's figures: name -> (claim, value, what the run compares with it)
    "hot experts": ("+8% throughput", 0.08,
                    "skewed routing: step time off / hot experts - 1"),
    "capacity bmm": ("+15% expert efficiency", 0.15,
                     "one process, balanced: grouped_mm ms / bmm ms - 1"),
    "capacity bmm, step": ("+15% expert efficiency", 0.15,
                           "balanced routing: step time off / capacity bmm - 1"),
    "a2a overlap": ("+8-10% MoE throughput", 0.09,
                    "balanced routing: step time overlap only / a2a overlap - 1"),
    "a2a overlap hidden": ("75% of the theoretical overlap", 0.75,
                           ("balanced: share of the overlap-only row's exposed all-to-all "
                            "time that a2a overlap hides")),
}

def compare(rows: list[dict], kernels: dict) -> list[dict]:
    """REFERENCE next to what this run measured (per rate; None where a row failed)."""
    def step(rate, routing, name):
        row = next((r for r in rows if (r["rate"], r["routing"], r["row"]) ==
                    (rate, routing, name)), None)
        return row if row is not None and "error" not in row else None

    out = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        off, hot = step(rate, "skewed", "off"), step(rate, "skewed", "hot experts")
        balanced, capacity = step(rate, "balanced", "off"), step(rate, "balanced", "capacity bmm")
        base, a2a = step(rate, "balanced", "overlap only"), step(rate, "balanced", "a2a overlap")
        measured = {
            "hot experts": off["step_s"] / hot["step_s"] - 1 if off and hot else None,
            "capacity bmm": kernels["balanced"]["grouped_over_bmm"] - 1 if kernels else None,
            "capacity bmm, step": (balanced["step_s"] / capacity["step_s"] - 1
                                   if balanced and capacity else None),
            "a2a overlap": base["step_s"] / a2a["step_s"] - 1 if base and a2a else None,
            "a2a overlap hidden": (1 - a2a["a2a_exposed_ms"] / base["a2a_exposed_ms"]
                                   if base and a2a and base["a2a_exposed_ms"] else None),
        }
        for name, (claim, value, how) in REFERENCE.items():
            out.append({"rate": rate, "what": name, "reference": claim,
                        "reference_value": value, "measured": measured[name], "how": how})
    return out


def print_tables(result: dict) -> None:
    for rate, link in result["links"].items():
        print(f"\nlink {rate}: {link}")
    print(f"\n{'rate':<6} {'routing':<8} {'row':<13} {'step s':>7} {'vs off':>6} "
          f"{'a2a MiB':>7} {'off-rank':>11} {'comm ms':>8} {'exposed':>8} {'hidden':>6} "
          f"{'a2a exp':>8} {'peak MiB':>8} {'dropped':>7}  hot")
    print(f"{'':<6} {'':<8} {'':<13} {'median':>7} {'':>6} {'in/rank':>7} {'mean/max':>11} "
          f"{'':>8} {'':>8} {'':>6} {'ms':>8} {'max':>8}")
    rows = result["rows"]
    off = {(r["rate"], r["routing"]): r["step_s"] for r in rows
           if r["row"] == "off" and "error" not in r}
    for r in rows:
        head = f"{r['rate']:<6} {r['routing']:<8} {r['row']:<13}"
        if "error" in r:
            print(f"{head} n/a ({r['error'][:95]})")
            continue
        base = off.get((r["rate"], r["routing"]))
        ratio = f"{base / r['step_s']:>6.2f}" if base else f"{'-':>6}"
        dropped = "-" if r["dropped"] is None else f"{r['dropped']:.1%}"
        hot = "-" if r["hot"] is None else ",".join(
            map(str, sorted({e for experts in r["hot"].values() for e in experts}))) or "none"
        off_rank = (f"{r['a2a_off_rank_bytes'] / 2**20:.2f}/"
                    f"{r['a2a_off_rank_max_bytes'] / 2**20:.2f}")
        print(f"{head} {r['step_s']:>7.3f} {ratio} {r['a2a_bytes'] / 2**20:>7.2f} "
              f"{off_rank:>11} {r['comm_ms']:>8.1f} {r['exposed_ms']:>8.1f} {r['hidden']:>6.0%} "
              f"{r['a2a_exposed_ms']:>8.1f} {r['peak_mib']:>8.1f} {dropped:>7}  {hot}")
    kernels = result["expert_kernels"]
    if kernels:
        print(f"\nexperts of one MoE layer, forward + backward, one process "
              f"(torch threads: {kernels['threads']}): E={kernels['E']} D={kernels['D']} "
              f"F={kernels['F']} N={kernels['N']} rows, bmm padded to C={kernels['C']}")
        print(f"{'routing':<9} {'grouped_mm ms':>13} {'bmm ms':>9} {'loop ms':>9} "
              f"{'gmm/bmm':>8} {'loop/bmm':>8} {'bmm drops':>9}")
        for routing in ROUTINGS:
            k = kernels[routing]
            print(f"{routing:<9} {k['ms']['grouped_mm']:>13.2f} {k['ms']['bmm']:>9.2f} "
                  f"{k['ms']['loop']:>9.2f} {k['grouped_over_bmm']:>8.2f} "
                  f"{k['loop_over_bmm']:>8.2f} {k['bmm_dropped']:>9.1%}")
    print(f"\n{'rate':<6} {'what':<19} {'reference (issue)':<31} {'measured':>9}  how measured")
    for ref in result["reference"]:
        measured = "n/a" if ref["measured"] is None else f"{ref['measured']:+.1%}"
        if ref["what"] == "a2a overlap hidden" and ref["measured"] is not None:
            measured = f"{ref['measured']:.1%}"
        print(f"{ref['rate']:<6} {ref['what']:<19} {ref['reference']:<31} {measured:>9}  "
              f"{ref['how']}")
