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
    python benchmarks/render_docs.py --check    # exit 1 naming each doc that differs
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKED = re.compile(r"(?<!`)<!-- results:(?P<spec>[\w.-]+(?:#[\w-]+)?) -->(?P<body>.*?)<!-- /results:(?P=spec) -->",
                    re.S)
LINK = re.compile(r"(\]\()(?!https?:|#|/)([^)\s]+)(\))")


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
    text = path.read_text()
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
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
