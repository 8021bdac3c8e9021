"""Kill-point sweep of a whole `rlhf run` on the tiny config.

    python3 scripts/kill_point_sweep.py [--points 20] [--seed 0] [--workdir DIR] [--keep]

1. runs `rlhf run` once uninterrupted in a fresh project (its own runs/, MLflow sqlite store and
   PREFECT_HOME) and records its timeline: each output line with its offset, the `stage k/7: name` lines;
2. chooses `--points` kill points over that timeline, seeded: one at each stage announcement (between
   stages), some inside evaluation and inside registration, the rest uniform (tests/fixtures/kill_sweep.py);
3. for each point: a fresh project, `rlhf run` SIGKILLed (its whole process group) that long after its
   anchor line, then the same command again to the end;
4. compares each rerun with the uninterrupted run: every model file's sha256 (SFT, reward model, judge
   reward model, PPO policy), the evaluation's verdicts and metrics, and the registry (one version per
   name, aliases, tags, the policy's recorded identity) (tests/fixtures/kill_sweep_compare.py).

Prints one line per point (offset in the uninterrupted run, anchor + delay, the stage announced last
before the kill, outcome) and "M of N match"; exits 1 if any point differs. The projects are removed
at the end unless `--keep` (their logs: killed.log, rerun.log); a sweep rerun on a kept `--workdir`
reuses its uninterrupted run. The points run in `run_order`: one of each kind in turn, so that a sweep
cut short has covered registration, evaluation and the stage boundaries.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPOSITORY), str(REPOSITORY / "tests")]  # this checkout's code, and the sweep's library

from fixtures.kill_sweep import Project, choose_points, run_order, write_data  # noqa: E402
from fixtures.kill_sweep_runs import SweepResult, reference_run, sweep_point  # noqa: E402


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=20, help="how many kill points (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the points' choice (default 0)")
    parser.add_argument("--workdir", type=Path, help="where the projects go (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the projects and their logs")
    return parser.parse_args()


def main() -> int:
    args = arguments()
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="kill-sweep-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        data = write_data(workdir)
        reference, timeline = reference_run(Project(workdir / "reference", data))
        print(f"uninterrupted run: {timeline.wall_s:.0f} s; stages at", flush=True)
        print("  " + ", ".join(f"{stage} {offset:.0f} s" for offset, stage in timeline.stage_starts()), flush=True)
        points = choose_points(timeline, args.points, args.seed)
        print(f"{'point':>5}  {'offset':>7}  {'kind':<8}  {'anchor + delay':<24}  {'stage at kill':<14}  outcome")
        results: list[SweepResult] = []
        for point in run_order(points, args.seed):
            project = Project(workdir / f"point-{point.index:02d}", data)
            shutil.rmtree(project.root, ignore_errors=True)  # a point an earlier, cut-short sweep began
            try:
                result = sweep_point(project.create(), point, reference)
            except Exception as error:  # noqa: BLE001 - one point's failure is its outcome; the sweep goes on
                print(f"{point.index:>5}  {point.offset_s:>6.1f}s  {point.kind:<8}  ERROR: {error!r}", flush=True)
                continue
            results.append(result)
            print(result.row(), flush=True)
        matched = sum(result.matches for result in results)
        print(f"{matched} of {len(points)} match (seed {args.seed}, {workdir})")
        return 0 if matched == len(points) else 1
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
