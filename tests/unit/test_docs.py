"""The docs cannot drift from the code: every internal link resolves, every command line
of a ``bash`` block parses (``speclab ...`` through the CLI's own parser; ``python -m
jobs.<job> --config X key=value ...`` and ``speclab run|submit|serve`` by validating the
config with its overrides), every config the docs name exists, the configuration page
equals what the config models generate, the README stays short, and the site builds
without warnings (``mkdocs build --strict``, as ``make docs``)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                     if p.name != "index.md")]  # index: the README
#: words in a command that stand for what the reader fills in: such a line is parsed
#: but its config is not validated with those overrides
PLACEHOLDERS = ("path/to", "RUN_DIR", "DIR", "<", "...", "$", "~", "URI", "KEY")


def _anchor(heading: str) -> str:
    """MkDocs' (Python-Markdown toc) slug of a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", text).strip("-")


def _headings(page: Path) -> set[str]:
    out, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            out.add(_anchor(line.lstrip("#")))
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_internal_link_resolves():
    bad = []
    for page in PAGES:
        for link in _links(page):
            if re.match(r"[a-z]+://|mailto:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                bad.append(f"{page.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _headings(target):
                bad.append(f"{page.name}: {link} (no such heading)")
    assert not bad, bad
    assert "../shared" not in "".join(p.read_text() for p in PAGES)  # dead in a clone


def _commands(page: Path) -> list[tuple[int, str]]:
    """``(line, command)`` of each shell command in the page's bash blocks (continued
    lines joined, comments dropped)."""
    out, block, start, cont = [], None, 0, ""
    for i, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            block = None if block is not None else line[3:].strip()
            continue
        if block not in ("bash", "sh"):
            continue
        code = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not cont:
            start = i
        if code.endswith("\\"):
            cont += code[:-1] + " "
            continue
        cmd = (cont + code).strip()
        cont = ""
        if cmd:
            out.append((start, cmd))
    return out


def _speclab_argv(cmd: str) -> list[str] | None:
    """The argv after ``speclab`` of a one-command line, None for anything else."""
    if any(op in cmd for op in ("|", "&&", ";", "$(", ">")) or "speclab" not in cmd and \
            "jobs." not in cmd:
        return None
    # usage notation: "[--flag]" is parsed with the flag given, "[key=value ...]" dropped
    cmd = re.sub(r"(?<=\s)\[([^\[\]]*)\]",
                 lambda m: "" if "..." in m.group(1) else m.group(1), cmd)
    words = shlex.split(cmd)  # a speclab line with unbalanced quotes is a doc bug
    while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
        words = words[1:]
    if words and words[0] in (".venv/bin/speclab", "speclab"):
        return words[1:]
    if words[:3] in ([".venv/bin/python", "-m", "speclab.cli"], ["python", "-m", "speclab.cli"]):
        return words[3:]
    if len(words) >= 3 and words[0].endswith("python") and words[1] == "-m" and \
            words[2].startswith("jobs.") and "." not in words[2][5:]:
        return ["run", words[2][5:], *words[3:]]
    return None


def _doc_commands() -> list[tuple[str, list[str]]]:
    out = []
    for page in PAGES:
        for line, cmd in _commands(page):
            argv = _speclab_argv(cmd)
            if argv is not None:
                out.append((f"{page.name}:{line}", argv))
    return out


def test_every_speclab_command_of_the_docs_parses_and_its_config_validates():
    from speclab.cli import parse_args
    from speclab.config import ServeJob
    from speclab.config.jobs import JOB_CONFIGS

    commands = _doc_commands()
    assert len(commands) > 40, len(commands)  # the blocks were found
    validated = 0
    for where, argv in commands:
        try:
            args = parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: speclab {' '.join(argv)} does not parse")
        config = getattr(args, "config", None)
        if not config or any(p in config for p in PLACEHOLDERS):
            continue
        assert (ROOT / config).exists(), f"{where}: no config {config}"
        job = "serve" if args.command == "serve" else getattr(args, "job", None)
        cls = ServeJob if job == "serve" else JOB_CONFIGS.get(job)
        if cls is None:
            continue
        given = [os.path.expanduser(os.path.expandvars(o))
                 for o in getattr(args, "overrides", []) or []]
        overrides = [o for o in given if not any(p in o for p in PLACEHOLDERS)]
        if len(overrides) < len(given):  # a value the reader fills in: the file alone
            overrides = []
        try:
            cls.from_yaml(ROOT / config, overrides)
        except ValueError as exc:
            pytest.fail(f"{where}: {config} {' '.join(overrides)}: {exc}")
        validated += 1
    assert validated > 20, validated


def test_every_experiment_config_the_docs_name_exists():
    named = {m for page in PAGES
             for m in re.findall(r"experiments/[\w/.-]+\.yaml", page.read_text())}
    assert named and not [n for n in named if not (ROOT / n).exists()]


def test_the_generated_pages_equal_their_sources():
    """docs/configuration.md from the config models, docs/index.md from the README."""
    from speclab.docs_pages import pages

    for name, text in pages().items():
        assert (ROOT / "docs" / name).read_text() == text, \
            f"docs/{name} is stale: run make docs (python -m speclab.docs_pages)"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_bytes()) <= 40_000


def test_the_site_builds_without_warnings(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "site" / "serve" / "index.html").exists()
