"""Every figure from a run reaches the docs through benchmarks/render_docs.py: the docs equal what it renders from
the committed results; every relative link in the docs points to a file; the README fits a screen."""
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("render_docs", ROOT / "benchmarks" / "render_docs.py")
render_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_docs)
README_LINES = 200  # issue 35: what it is, the two commands, a five-minute tour, links to the rest


@pytest.mark.parametrize("doc", render_docs.docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_equals_what_the_generator_renders_from_the_results(doc):
    text = doc.read_text()
    assert render_docs.render(text, doc) == text, f"run `python benchmarks/render_docs.py` ({doc.name} drifted)"


def test_every_results_file_is_placed_in_the_docs():
    marked = {m.group("spec").split("#")[0] for doc in render_docs.docs()
              for m in render_docs.MARKED.finditer(doc.read_text())}
    assert sorted(p.stem for p in render_docs.RESULTS.glob("*.md")) == sorted(marked)


def test_render_replaces_each_marked_place_and_nothing_else(tmp_path):
    results, doc = tmp_path / "benchmarks" / "results", tmp_path / "docs" / "x.md"
    results.mkdir(parents=True)
    doc.parent.mkdir()
    (results / "speed.md").write_text("# Speed\n\n## Intro\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n\n![p](p.png)\n")
    (results / "time.md").write_text("runs...\n<!-- part:summary -->\n3 min 2 s\n<!-- /part:summary -->\n")
    text = ("Took <!-- results:time#summary -->9 s<!-- /results:time#summary --> here, 9 s there.\n"
            "<!-- results:speed#table -->\nold\n<!-- /results:speed#table -->\n"
            "<!-- results:speed --><!-- /results:speed -->\n")
    rendered = render_docs.render(text, doc, results)
    assert rendered == ("Took <!-- results:time#summary -->3 min 2 s<!-- /results:time#summary --> here, 9 s there.\n"
                        "<!-- results:speed#table -->\n| a | b |\n| --- | --- |\n| 1 | 2 |\n"
                        "<!-- /results:speed#table -->\n<!-- results:speed -->\n### Intro\n\n| a | b |\n| --- | --- |\n"
                        "| 1 | 2 |\n\n![p](../benchmarks/results/p.png)\n<!-- /results:speed -->\n")
    assert render_docs.render(rendered, doc, results) == rendered
    for broken, says in (("<!-- results:nothing --><!-- /results:nothing -->", "no results file"),
                         ("<!-- results:time#nopart --><!-- /results:time#nopart -->", "no part"),
                         ("<!-- results:time#summary -->", "without its")):
        with pytest.raises(render_docs.RenderError, match=says):
            render_docs.render(broken, doc, results)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_in_the_docs_points_to_a_file():
    broken = []
    for doc in render_docs.docs():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:|#", target):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def test_readme_fits_a_screen():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_LINES


def test_a_result_whose_measured_code_changed_since_is_listed_stale(tmp_path):
    """`stamped` records the commit a benchmark ran at; `stale` lists the file once a path its script declares in
    `MEASURES` changes after that commit (working tree included), and the rendered text never shows the stamp."""
    git = lambda *args: render_docs.git(*args, root=tmp_path)  # noqa: E731
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "benchmarks" / "bench.py").write_text('MEASURES = ("pkg/measured.py",)\n')
    for name in ("measured.py", "other.py"):
        (tmp_path / "pkg" / name).write_text("x = 1\n")
    assert git("init", "-q") is not None and git("add", ".") is not None
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code")
    results = tmp_path / "benchmarks" / "results" / "bench.md"
    results.write_text(render_docs.stamped("# Bench\n\n| a |\n| --- |\n| 1 |\n", "bench.py", ("pkg/measured.py",),
                                           root=tmp_path))
    head = git("rev-parse", "HEAD").strip()
    assert results.read_text().startswith(f"<!-- measured at: {head} by benchmarks/bench.py -->\n# Bench\n")
    assert render_docs.result("bench", results.parent) == "| a |\n| --- |\n| 1 |"
    (tmp_path / "pkg" / "other.py").write_text("x = 2\n")  # not what it measures
    assert render_docs.stale(tmp_path) == []
    (tmp_path / "pkg" / "measured.py").write_text("x = 2\n")
    assert render_docs.stale(tmp_path) == [
        f"benchmarks/results/bench.md: measured at {head[:10]}; changed since: pkg/measured.py"]
    (tmp_path / "benchmarks" / "results" / "unstamped.md").write_text("# Old\n")
    assert render_docs.stale(tmp_path)[-1] == "benchmarks/results/unstamped.md: records no commit it was measured at"


def test_rows_measured_at_their_own_commits_are_judged_one_by_one(tmp_path):
    """A results table with a `commit` column (suite_time.md's runs, time_prediction.md's sets): `stale` counts the
    rows measured before a measured path changed, at their own commits, and the rows it cannot tell."""
    git = lambda *args: render_docs.git(*args, root=tmp_path)  # noqa: E731
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "benchmarks" / "bench.py").write_text('MEASURES = ("pkg/measured.py",)\n')
    shas = []
    for value in (1, 2):
        (tmp_path / "pkg" / "measured.py").write_text(f"x = {value}\n")
        git("add", ".") if shas else (git("init", "-q"), git("add", "."))
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", f"code {value}")
        shas.append(git("rev-parse", "--short=12", "HEAD").strip())
    rows = "".join(f"| {name} | {sha} |\n" for name, sha in (("old", shas[0]), ("new", shas[1]), ("unknown", "-")))
    (tmp_path / "benchmarks" / "results" / "bench.md").write_text(render_docs.stamped(
        f"# Bench\n\n| run | commit |\n| --- | --- |\n{rows}", "bench.py", ("pkg/measured.py",), root=tmp_path))
    assert render_docs.row_commits((tmp_path / "benchmarks" / "results" / "bench.md").read_text()) == [*shas, "-"]
    assert render_docs.stale(tmp_path) == [
        f"benchmarks/results/bench.md: 1 of 3 rows measured before their measured paths changed (at {shas[0][:10]}; "
        "changed since: pkg/measured.py)",
        "benchmarks/results/bench.md: 1 of 3 rows cannot tell (commit -: not recorded or not in this checkout)"]
