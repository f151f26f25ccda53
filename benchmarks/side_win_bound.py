"""What a side child that wins could save DSI at most, in the event simulator (docs/results.md section 35).

Patterns of i.i.d. acceptances (``--acceptance``) and rescues (a rejection rescued by a side child with
probability ``--rescue``), the same patterns for every configuration, timed by :func:`dsi.sim.events.simulate`
with event-driven windows on ``--servers`` target servers:

- ``chain``: no tree;
- ``auto``: the rescues as leaf side children (the side child and the target's token after it, then a restart);
- ``branches``: with the drafter's likeliest token after each side child (``dsi_branches``);
- ``no restart``: every rescued position counted as an accepted draft: a side win that costs nothing, as if
  the side child's continuation had been drafted and verified all along (an upper bound no tree reaches: the
  token after a side child is the target's fresh draw, which a drafted continuation only guesses).

    python benchmarks/side_win_bound.py

Prints one line per (acceptance, rescue): each configuration's speed over the chain's.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> int:
    from dsi.sim.events import simulate

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--acceptance", nargs="+", type=float, default=[0.62, 0.62, 0.54])
    parser.add_argument("--rescue", nargs="+", type=float, default=[0.32, 0.45, 0.40],
                        help="the share of rejections a side child rescues, one per --acceptance")
    parser.add_argument("--positions", type=int, default=200)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--target-s", type=float, default=0.020, help="a target forward (GPU-like: any size)")
    parser.add_argument("--drafter-s", type=float, default=0.0027, help="a drafter step (section 32's emulated one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if len(args.rescue) != len(args.acceptance):
        parser.error(f"--rescue needs one value per --acceptance ({len(args.acceptance)}), got {len(args.rescue)}")
    rng = np.random.default_rng(args.seed)
    timing = dict(target_tpot=args.target_s, drafter_tpot=args.drafter_s, num_servers=args.servers,
                  lookahead="auto")
    print(f"DSI SP = {args.servers}, event-driven windows, target {args.target_s * 1e3:g} ms, drafter "
          f"{args.drafter_s * 1e3:g} ms, {args.runs} runs x {args.positions} positions; speed over the chain's:")
    for acceptance, rescue in zip(args.acceptance, args.rescue, strict=True):
        matches, rescues = [], []
        for _ in range(args.runs):
            accepted = rng.random(args.positions) < acceptance
            matches.append(accepted)
            rescues.append(~accepted & (rng.random(args.positions) < rescue))
        chain = simulate("dsi", matches=matches, **timing).mean
        speeds = {
            "auto": chain / simulate("dsi", matches=matches, rescues=rescues, **timing).mean,
            "branches": chain / simulate("dsi", matches=matches, rescues=rescues, dsi_branches=True, **timing).mean,
            "no restart": chain / simulate("dsi", matches=[m | r for m, r in zip(matches, rescues, strict=True)],
                                           **timing).mean,
        }
        print(f"acceptance {acceptance:.2f}, rescued {rescue:.2f}: "
              + ", ".join(f"{name} {speed:.3f}" for name, speed in speeds.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
