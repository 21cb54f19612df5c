"""Check that every relative link in the repository's Markdown files resolves.

    python tools/check_doc_links.py            # prints each broken link; exit 1 if any
    python tools/check_doc_links.py FILE.md    # only these files

A link is ``[text](target)`` or ``![alt](target)``. Web addresses are skipped. A relative target
must name a file or folder that exists, relative to the file that holds the link; a ``#anchor``
on a Markdown target (or on its own) must match one of that file's headings, slugged as GitHub
does (lower case, punctuation dropped, spaces to hyphens, repeats numbered -1, -2, ...).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Dict, Iterable, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+(?:\([^()]*\))?)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
SKIP = ("http://", "https://", "mailto:", "ftp://")


def markdown_files() -> List[str]:
    """Tracked and untracked (not ignored) *.md files, relative to the repository root."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sorted(p for p in out.splitlines() if os.path.exists(os.path.join(ROOT, p)))


def prose_lines(text: str) -> Iterable[str]:
    """The lines outside fenced code blocks, with inline code spans removed."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield re.sub(r"`[^`]*`", "", line)


def slug(heading: str) -> str:
    text = re.sub(r"<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)   # GitHub keeps letters, digits, _, -, spaces
    return text.replace(" ", "-")


_anchors: Dict[str, Set[str]] = {}


def anchors(path: str) -> Set[str]:
    if path not in _anchors:
        seen: Dict[str, int] = {}
        found: Set[str] = set()
        with open(path, encoding="utf-8") as fh:
            for line in prose_lines(fh.read()):
                m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
                if not m:
                    continue
                base = slug(m.group(1))
                n = seen.get(base, 0)
                found.add(base if n == 0 else f"{base}-{n}")
                seen[base] = n + 1
        _anchors[path] = found
    return _anchors[path]


def broken_links(rel: str) -> List[str]:
    path = os.path.join(ROOT, rel)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    problems = []
    for line in prose_lines(text):
        for target in LINK.findall(line):
            if target.startswith(SKIP):
                continue
            file_part, _, anchor = target.partition("#")
            dest = path if not file_part else os.path.normpath(os.path.join(os.path.dirname(path), file_part))
            if not os.path.exists(dest):
                problems.append(f"{rel}: {target} (no such file)")
            elif anchor and dest.endswith(".md") and anchor.lower() not in anchors(dest):
                problems.append(f"{rel}: {target} (no heading #{anchor} in {os.path.relpath(dest, ROOT)})")
    return problems


def main(argv: List[str]) -> int:
    files = argv or markdown_files()
    problems = [p for rel in files for p in broken_links(rel)]
    for p in problems:
        print(p)
    print(f"{len(files)} Markdown files, {len(problems)} broken links", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
