"""Seconds each test file took in a `make test` run, for the test scheduler's order (tests/conftest.py runs the
longest first, so that neither pytest-xdist worker is left alone with a long file at the end).

    python -m pytest -n 2 tests --junitxml=run.xml && python scripts/file_seconds.py run.xml
        # -> tests/file_seconds.json

A test's seconds are its setup, call and teardown (pytest's junit `time`); a file's are the sum of its tests'.
Run it again after adding or changing a launch; a file missing from the table is ordered as the median one.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "file_seconds.json"


def file_seconds(junit_xml: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(junit_xml).iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((f"{part}.py" for part in module if part.startswith("test_")), None)
        if name:
            seconds[name] += float(case.get("time") or 0)
    return {name: round(value, 1) for name, value in sorted(seconds.items())}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("usage: python scripts/file_seconds.py JUNIT_XML", file=sys.stderr)
        return 2
    text = json.dumps(file_seconds(Path(argv[0])), indent=1) + "\n"
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(OUT)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
