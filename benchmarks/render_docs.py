"""Place the committed benchmark results into the docs: the one way a figure from a run reaches README.md,
docs/*.md and benchmarks/README.md.

A doc marks where a result goes, and this script rewrites what is between the two markers:

    <!-- results:NAME -->...<!-- /results:NAME -->          benchmarks/results/NAME.md, without its `# ` title line
                                                            (its `##` headings one level down)
    <!-- results:NAME#table -->...<!-- /results:NAME#table -->  the first Markdown table of that file
    <!-- results:NAME#PART -->...<!-- /results:NAME#PART -->    the text between `<!-- part:PART -->` and
                                                                `<!-- /part:PART -->` in that file

A marker in backticks is text, not a marker. A result of one line goes inline (the markers may sit in a sentence), a longer one as a block on lines of its
own. Relative links in a results file (an image beside it) are rewritten relative to the doc. Run it after a
benchmark script wrote its results file; tests/test_docs_results.py fails when a doc differs from what this
renders.

    python benchmarks/render_docs.py            # rewrite the docs in place (atomically)
    python benchmarks/render_docs.py --check    # exit 1 naming each doc that differs; also list stale results

Staleness: a results file a benchmark measured starts with `<!-- measured at: SHA by benchmarks/SCRIPT -->`
(`stamped`, called by the script that writes it), and that script declares the code it measures (`MEASURES`, paths
under the repository root). A file whose rows were measured at different commits keeps each row's in a `commit`
column of its table (benchmarks/suite_time.py, the sets of benchmarks/time_prediction.py): those rows are judged one
by one, the stamp then only saying when the file was written. `--check` lists each results file whose measured
paths changed since the commit it (or a row of it) was measured at (working tree included), or that records no
commit; it does not change the exit status (rerunning a benchmark takes minutes to hours). Results computed rather
than measured (COMPUTED) record nothing: tests/test_benchmarks.py holds each equal to what its script writes now.
"""
from __future__ import annotations

import argparse
import ast
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKED = re.compile(r"(?<!`)<!-- results:(?P<spec>[\w.-]+(?:#[\w-]+)?) -->(?P<body>.*?)<!-- /results:(?P=spec) -->",
                    re.S)
LINK = re.compile(r"(\]\()(?!https?:|#|/)([^)\s]+)(\))")
MEASURED = re.compile(r"\A<!-- measured at: (?P<sha>[0-9a-f]{40})(?P<dirty> with uncommitted changes)? "
                      r"by (?P<script>benchmarks/[\w.]+) -->\n")
COMPUTED = ("fit_examples", "planner_figures", "published_ratios")  # held equal to their scripts by tests


class RenderError(Exception):
    """A marker names a results file or part that does not exist."""


def docs(root: Path = ROOT) -> list[Path]:
    """The documents the generator fills: README.md, docs/*.md and benchmarks/README.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "benchmarks" / "README.md"]


def result(spec: str, results: Path = RESULTS) -> str:
    """The text `spec` (NAME, NAME#table or NAME#PART) names, stripped of surrounding blank lines."""
    name, _, part = spec.partition("#")
    path = results / f"{name}.md"
    if not path.is_file():
        raise RenderError(f"no results file {path.relative_to(results.parents[1])}")
    text = MEASURED.sub("", path.read_text())
    if part == "table":
        lines = text.splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
        if start is None:
            raise RenderError(f"{path.name} has no table")
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
        return "\n".join(lines[start:end])
    if part:
        found = re.search(rf"<!-- part:{re.escape(part)} -->(.*?)<!-- /part:{re.escape(part)} -->", text, re.S)
        if not found:
            raise RenderError(f"{path.name} has no part {part!r}")
        return found.group(1).strip("\n")
    text = re.sub(r"\A# [^\n]*\n", "", text)
    return re.sub(r"^(##+) ", r"#\1 ", text, flags=re.M).strip("\n")  # its sections nest under the doc's


def rebase_links(text: str, results: Path, doc: Path) -> str:
    """Links relative to the results folder, made relative to the doc's folder."""
    def rebase(match):
        target = os.path.relpath(results / match.group(2), doc.parent)
        return match.group(1) + Path(target).as_posix() + match.group(3)
    return LINK.sub(rebase, text)


def render(text: str, doc: Path, results: Path = RESULTS) -> str:
    """`text` (the doc at path `doc`) with every marked place holding what its results file says now."""
    def fill(match):
        spec = match.group("spec")
        body = rebase_links(result(spec, results), results, doc)
        body = body.strip() if "\n" not in body.strip() else f"\n{body}\n"
        return f"<!-- results:{spec} -->{body}<!-- /results:{spec} -->"
    rendered, count = MARKED.subn(fill, text)
    if count != len(re.findall(r"(?<!`)<!-- results:", text)):
        raise RenderError("a `<!-- results:NAME -->` marker without its `<!-- /results:NAME -->`")
    return rendered


def git(*args: str, root: Path = ROOT) -> str | None:
    """git's output in `root`, or None where git or the commit is not there (an unpacked sdist, a shallow clone)."""
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def stamped(text: str, script: str, measures: tuple, root: Path = ROOT) -> str:
    """`text` (a results file) with its first line saying the commit it was measured at and by which `script`;
    "with uncommitted changes" where `measures` differed from that commit (then `stale` counts from the commit that
    adds the results file). Outside a git checkout, `text` as it is."""
    sha = (git("rev-parse", "HEAD", root=root) or "").strip()
    if not sha:
        return text
    dirty = " with uncommitted changes" if git("status", "--porcelain", "--", *measures, root=root) else ""
    return f"<!-- measured at: {sha}{dirty} by benchmarks/{Path(script).name} -->\n" + MEASURED.sub("", text)


def machine() -> str:
    """This machine in words, for a results row: the CPU's model name (/proc/cpuinfo), its CPU count, the system."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} CPU(s), {platform.system()} {platform.release()}"


def row_commits(text: str) -> list[str]:
    """The `commit` column of a results file's tables, one entry per row ("-": the row records none)."""
    out, column, row = [], None, 0
    for line in text.splitlines():
        if not line.startswith("|"):
            column, row = None, 0
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        row += 1
        if row == 1:
            column = cells.index("commit") if "commit" in cells else None
        elif row > 2 and column is not None and len(cells) > column:
            out.append((cells[column].split() or ["-"])[0])  # "SHA (with uncommitted changes)": the SHA
    return out


def changed_since(sha: str, measures: tuple, root: Path) -> list[str] | None:
    """The measured paths changed since commit `sha` (working tree included); None: the commit is not here."""
    changed = git("diff", "--name-only", sha, "--", *measures, root=root) if re.fullmatch(r"[0-9a-f]{7,40}", sha) \
        else None
    return None if changed is None else changed.split()


def listed(files: list[str]) -> str:
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def stale_rows(name, commits: list[str], measures: tuple, root: Path) -> list[str]:
    """One line when rows of a results file were measured before its measured paths changed, or cannot be told."""
    changed = {sha: changed_since(sha, measures, root) for sha in dict.fromkeys(commits)}
    old = [sha for sha, files in changed.items() if files]
    unknown = [sha for sha, files in changed.items() if files is None]
    rows = sum(commits.count(sha) for sha in old)
    out = []
    if old:
        files = sorted({f for sha in old for f in changed[sha]})
        out.append(f"{name}: {rows} of {len(commits)} rows measured before their measured paths changed (at "
                   f"{', '.join(sha[:10] for sha in old)}; changed since: {listed(files)})")
    if unknown:
        out.append(f"{name}: {sum(commits.count(sha) for sha in unknown)} of {len(commits)} rows cannot tell (commit "
                   f"{', '.join(sha[:10] for sha in unknown)}: not recorded or not in this checkout)")
    return out


def declared(script: Path) -> tuple | None:
    """The `MEASURES` tuple a benchmark script declares (read, not imported), or None."""
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MEASURES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return None


def stale(root: Path = ROOT) -> list[str]:
    """One line per results file that may no longer describe the code: its measured paths changed since."""
    found = []
    for path in sorted((root / "benchmarks" / "results").glob("*.md")):
        text = path.read_text()
        name, stamp = path.relative_to(root), MEASURED.match(text)
        if path.stem in COMPUTED:
            continue
        if not stamp:
            found.append(f"{name}: records no commit it was measured at")
            continue
        measures = declared(root / stamp["script"]) if (root / stamp["script"]).is_file() else None
        if not measures:
            found.append(f"{name}: {stamp['script']} declares no MEASURES")
            continue
        if row_commits(text):  # each row its own commit
            found += stale_rows(name, row_commits(text), measures, root)
            continue
        since = (git("log", "-1", "--format=%H", "--", str(name), root=root) or "").strip() if stamp["dirty"] \
            else stamp["sha"]
        changed = changed_since(since, measures, root) if since else None
        if changed is None:
            found.append(f"{name}: cannot tell (commit {stamp['sha'][:10]} not in this checkout)")
        elif changed:
            found.append(f"{name}: measured at {stamp['sha'][:10]}; changed since: {listed(changed)}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a doc differs")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "plugin"))
    from shardscope.safe_io import atomic_write_text

    differ = []
    for doc in docs():
        text = doc.read_text()
        try:
            rendered = render(text, doc)
        except RenderError as error:
            print(f"{doc.relative_to(ROOT)}: {error}", file=sys.stderr)
            return 2
        if rendered != text:
            differ.append(doc)
            if not args.check:
                atomic_write_text(doc, rendered, "doc")
    for doc in differ:
        print(f"{doc.relative_to(ROOT)}: {'differs from its results' if args.check else 'rewritten'}")
    if args.check:
        for line in stale():
            print(f"stale results: {line}")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
