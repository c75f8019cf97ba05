"""Run every benchmark under bench/ (``bench_*.py``) one after another.

Usage: ``make bench`` (or ``.venv/bin/python bench/run_all.py [name ...]``).
Each script prints its own table; copy the figures into bench/RESULTS.md
together with the command that produced them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    here = Path(__file__).resolve().parent
    scripts = sorted(here.glob("bench_*.py"))
    if argv:
        scripts = [s for s in scripts if any(a in s.stem for a in argv)]
    failed = []
    for script in scripts:
        print(f"== {script.name}", flush=True)
        if subprocess.call([sys.executable, str(script)]) != 0:
            failed.append(script.name)
    if failed:
        print("failed:", ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
