"""The docs: every relative Markdown link resolves, the lab index covers every study, and the README
keeps the commands that .ci/run and new users rely on."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_doc_links  # noqa: E402



def _read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
        return fh.read()


def test_every_relative_markdown_link_resolves():
    problems = [p for rel in check_doc_links.markdown_files() for p in check_doc_links.broken_links(rel)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_link_checker_reports_a_missing_file_and_a_missing_heading(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](nowhere.md) [bad anchor](#no-such-heading)\n"
                    "```\n[in code](ignored.md)\n```\n", encoding="utf-8")
    monkeypatch.setattr(check_doc_links, "ROOT", str(tmp_path))
    problems = check_doc_links.broken_links("page.md")
    assert len(problems) == 2, problems
    assert "nowhere.md (no such file)" in problems[0] and "#no-such-heading" in problems[1]


def test_lab_index_names_every_study_folder():
    index = _read("docs/lab/README.md")
    study = os.path.join(ROOT, "docs", "lab", "study")
    folders = sorted(d for d in os.listdir(study) if os.path.isdir(os.path.join(study, d)))
    assert folders, "docs/lab/study/ holds no study folders"
    missing = [d for d in folders if f"(study/{d}/" not in index]
    assert not missing, f"docs/lab/README.md has no line for: {missing}"


def test_readme_keeps_the_ci_test_command_and_the_demo_command():
    ci = _read(".ci/run").splitlines()
    test_cmd = ci[ci.index("# the README's test command") + 1].strip()
    readme = _read("README.md")
    assert test_cmd in readme
    assert "pip install torch==2.13.0 && pip install -e . && python examples/train_charlm.py" in readme
    assert len(readme.splitlines()) <= 300
