"""tests/README.md, the index of the tests by feature: every test file is named in it, and every file it names exists;
tests/file_seconds.json (the scheduler's seconds per file, tests/conftest.py) names no file that is gone."""
import json
import re
from pathlib import Path

HERE = Path(__file__).parent
NAMED = set(re.findall(r"\btest_\w+\.py\b", (HERE / "README.md").read_text()))
FILES = {path.name for path in HERE.glob("test_*.py")}


def test_every_test_file_is_in_the_index():
    assert sorted(FILES - NAMED) == []


def test_every_file_the_index_names_exists():
    assert sorted(NAMED - FILES) == []


def test_the_recorded_seconds_name_no_file_that_is_gone():
    assert sorted(set(json.loads((HERE / "file_seconds.json").read_text())) - FILES) == []
