"""The edit benchmark (or another, ``--script``), this tree beside an earlier commit, alternating
rounds (A B A B) so that the machine's drift falls on both: what "within 5% of main" is measured
with.

    python benchmarks/edit_ab.py [--rounds 2] [--script step_parts.py] REF [-- script options]

Each round runs ``edit_benchmark.py`` (default options ``--skip-hf --files 3 --max-tokens 600``)
as a subprocess, in float32 unless FORETELL_DTYPE says otherwise, first from this tree, then from
a git worktree of REF (imported as ``load_benchmark.py --baseline-ref`` does), and prints each
run's summary table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from load_benchmark import assemble_baseline, remove_baseline  # noqa: E402


def command(site: str | None, name: str, options: list[str]) -> list[str]:
    if site is None:
        return [sys.executable, str(HERE / name), *options]
    script = Path(site).parent / "tree" / "benchmarks" / name
    script = str(script if script.exists() else HERE / name)  # a new script runs against the old code
    launcher = ("import sys, runpy; sys.meta_path = [f for f in sys.meta_path if 'editable' not in "
                f"type(f).__module__.lower()]; sys.path.insert(0, {site!r}); sys.argv = [{script!r}] + "
                f"sys.argv[1:]; runpy.run_path({script!r}, run_name='__main__')")
    return [sys.executable, "-c", launcher, *options]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="the commit to compare with, e.g. main")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--script", default="edit_benchmark.py", help="a script of benchmarks/ "
                        "(default: edit_benchmark.py)")
    parser.add_argument("options", nargs="*", help="edit_benchmark.py's options, after -- (default: "
                        "--skip-hf --files 3 --max-tokens 600)")
    args = parser.parse_args()
    if not args.options and args.script == "edit_benchmark.py":
        args.options = ["--skip-hf", "--files", "3", "--max-tokens", "600"]
    site = assemble_baseline(args.ref)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("FORETELL_DTYPE", "float32")
    failed = False
    try:
        for round_ in range(1, args.rounds + 1):
            for name, tree in (("this tree", None), (args.ref, site)):
                done = subprocess.run(command(tree, args.script, args.options), capture_output=True, text=True, env=env)
                print(f"===== round {round_}: {name} (exit {done.returncode})\n{done.stdout}", flush=True)
                failed |= done.returncode != 0
    finally:
        remove_baseline(site)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
