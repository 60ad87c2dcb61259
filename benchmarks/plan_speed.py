"""Solve times of the planner (``pipetrain.plan.plan``), printed as tables.

Run: ``python benchmarks/plan_speed.py [--quick]``. Uses the published profiles the tests
carry (``tests/data/profiles``, MIT, see its NOTICE) and synthetic chains (seeded). Times are wall
seconds of one ``plan()`` call each (best of ``--repeat``), cost model ``pipedream``.
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from pipetrain.plan import PlanOptions, parse_topology, plan
from pipetrain.profile.io import load_profile
from pipetrain.profile.types import NodeProfile, Profile

PROFILES = Path(__file__).resolve().parents[1] / "tests" / "data" / "profiles"


def synthetic_chain(n: int, seed: int = 0) -> Profile:
    """A chain of ``n`` layers with random compute (0.5-3 ms forward, 2x backward),
    activations (1-16 MB) and parameters (0-16 MB)."""
    rnd = random.Random(seed)
    nodes = [NodeProfile("x", "Input", 0.0, 0.0, 4_000_000, 0, [], "input")]
    prev = "x"
    for i in range(n):
        f = rnd.uniform(0.5e-3, 3e-3)
        nodes.append(NodeProfile(f"l{i}", "Layer", f, 2 * f, rnd.choice([1_000_000, 4_000_000, 16_000_000]),
                                 rnd.choice([0, 100_000, 4_000_000, 16_000_000]), [prev]))
        prev = f"l{i}"
    return Profile(f"chain{n}", 128, nodes)


def timed(profile: Profile, workers: str, bandwidth: str, repeat: int, cost_model: str = "pipedream"):
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = plan(profile, parse_topology(workers, bandwidth), PlanOptions(cost_model=cost_model))
        best = min(best, time.perf_counter() - t0)
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smaller growth table")
    args = ap.parse_args()

    print("== published profiles (PipeDream text), pipedream cost model ==")
    print(f"{'model':<12} {'topology':<24} {'states':>6} {'config':<26} {'seconds':>8}")
    cases = [("resnet50", "16", "1.25e9"), ("resnet50", "4,4", "300e9,1.25e9"), ("vgg16", "16", "1.25e9"),
             ("vgg16", "4,4", "300e9,1.25e9"), ("gnmt", "16", "1.25e9"), ("gnmt", "4,4", "300e9,1.25e9")]
    for name, w, b in cases:
        prof = load_profile(PROFILES / f"{name}.txt")
        secs, p = timed(prof, w, b, args.repeat)
        cfg = p.config if len(p.config) <= 26 else p.config[:23] + "..."
        print(f"{name:<12} {w + ' @ ' + b:<24} {p.extra['states']['count']:>6} {cfg:<26} {secs:>8.3f}")

    print("\n== 1,000-layer chain on 1,024 workers in 8-worker servers (8 x 128) ==")
    chain = synthetic_chain(1000)
    secs, p = timed(chain, "8,128", "300e9,1.25e9", max(1, args.repeat - 2))
    print(f"seconds {secs:.3f}  states {p.extra['states']['count']} ({p.extra['states']['mode']})  "
          f"stages {p.num_stages}  workers {p.num_workers}  speedup over DP {p.speedup_over_data_parallel:.2f}x")

    layers = [100, 250, 500, 1000] if not args.quick else [100, 250]
    workers = [8, 64, 256, 1024] if not args.quick else [8, 64]
    for title, topo in (("flat, 1.25e9 B/s", lambda w: (str(w), "1.25e9")),
                        ("8-worker servers, 300e9 / 1.25e9 B/s", lambda w: (f"8,{w // 8}", "300e9,1.25e9"))):
        print(f"\n== growth: seconds per plan() on synthetic chains, {title} ==")
        print(f"{'layers':>7} " + " ".join(f"{w:>8}" for w in workers))
        for n in layers:
            prof = synthetic_chain(n, seed=n)
            row = []
            for w in workers:
                ww, bb = topo(w)
                secs, _ = timed(prof, ww, bb, 1)
                row.append(f"{secs:>8.3f}")
            print(f"{n:>7} " + " ".join(row))


if __name__ == "__main__":
    main()
