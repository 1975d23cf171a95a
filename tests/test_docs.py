"""Every command and program that README.md and docs/ show runs as shown, and prints what they show.

Each fenced block of these pages in one of three forms is a test:

* ``bash``: shell commands, run by bash in a directory that the page's blocks share (so a block may
  use the files an earlier one wrote), with the repository's ``examples/`` and ``benchmarks/`` in it;
* ``console``: ``$ command`` lines, each followed by what it prints, where ``...`` stands for lines
  left out. The command runs, and the lines shown must appear in its output, in order: exactly, or,
  in a block marked ``output varies``, with numbers, durations and progress bars taken as alike;
* ``python``: a program, run with ``python`` in that directory.

An HTML comment on the line before a block marks it, ``<!-- doc-test: MARK[, MARK] -->``: ``needs
gpu`` and ``needs root`` run it only where a CUDA GPU or root is at hand; ``needs cluster`` (several
machines) and ``needs install`` (it changes the environment; ``.ci/run`` runs the README's set-up
commands) never run it here; ``output varies``; ``continues`` runs a python block after the one
before it on the page, as one program.

BENCHMARKS.md and its pages under docs/benchmarks/ are not among the pages: their commands are benchmarks of minutes to hours, run by hand,
and their figures are what they printed. Commands run small, so that the pages can show real jobs: ``shardwire train`` gets ``SMALL["train"]``
appended and ``shardwire bench`` ``SMALL["bench"]`` (the last value of an option wins), except
where they only print (``--print-launch``, ``--print-config``, ``--help``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("bash", "console", "python")
MARKS = {"needs gpu", "needs root", "needs cluster", "needs install", "output varies", "continues"}
SMALL = {"train": ["--steps", "2", "--log-every", "1", "--eval-batches", "1"], "bench": ["-w", "1", "-n", "2"]}
_ONLY_PRINTS = ("--print-launch", "--print-config", "--help")
_HEAVY = re.compile(r"shardwire (train|bench|testbed)|torchrun|import (torch|shardwire)|examples/")


@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    marks: frozenset[str]

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_blocks(page: pathlib.Path) -> list[Block]:
    """The page's blocks in the tested languages, in order, with their marks."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.fullmatch(r"```(\w*)", lines[i])
        if opening is None:
            i += 1
            continue
        end = lines.index("```", i + 1)
        previous = next((line for line in reversed(lines[:i]) if line.strip()), "")
        mark = re.fullmatch(r"<!-- doc-test: (.*) -->", previous.strip())
        marks = frozenset(m.strip() for m in mark[1].split(",")) if mark else frozenset()
        assert marks <= MARKS, f"{page.name}:{i + 1}: unknown doc-test marks {sorted(marks - MARKS)}"
        if opening[1] in LANGUAGES:
            blocks.append(Block(page, i + 1, opening[1], "\n".join(lines[i + 1:end]) + "\n", marks))
        i = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in read_blocks(page)]


def _params() -> list:
    """Each block as a test: a slow one where it, or a block before it on its page (whose files it may
    use), starts processes or trains."""
    params, heavy_pages = [], set()
    for block in BLOCKS:
        if _HEAVY.search(block.text):
            heavy_pages.add(block.page)
        marks = [pytest.mark.slow] if block.page in heavy_pages else []
        params.append(pytest.param(block, id=block.name, marks=marks))
    return params


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """A working directory per page, shared by its blocks, holding the repository's examples."""
    made = {}

    def workdir(page: pathlib.Path) -> pathlib.Path:
        if page not in made:
            made[page] = tmp_path_factory.mktemp(page.stem)
            for name in ("examples", "benchmarks"):
                (made[page] / name).symlink_to(ROOT / name)
        return made[page]

    return workdir


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", _params())
def test_documented_block_runs_as_shown(block: Block, workdirs):
    _skip_unless_runnable(block.marks)
    cwd = workdirs(block.page)
    if block.language == "python":
        program = _program(block)
        done = _run([sys.executable, "-c", program], cwd)
        assert done.returncode == 0, f"{block.name} failed:\n{done.stdout}"
    elif block.language == "bash":
        done = _run(["bash", "-euo", "pipefail", "-c", small(block.text)], cwd)
        assert done.returncode == 0, f"{block.name} failed:\n{done.stdout}"
    else:
        for command, shown in console_commands(block.text):
            done = _run(["bash", "-euo", "pipefail", "-c", small(command)], cwd)
            assert done.returncode == 0, f"{block.name}: `{command}` failed:\n{done.stdout}"
            missing = first_missing(shown, done.stdout.splitlines(), alike="output varies" in block.marks)
            assert missing is None, (f"{block.name}: `{command}` did not print {missing!r}; it printed:\n"
                                     f"{done.stdout}")


@pytest.mark.slow
def test_the_documented_checkpoint_loop_runs_again_to_resume(tmp_path):
    """The loop a user runs again after a stop: the second run resumes from the series and ends well."""
    block = next(b for b in BLOCKS if b.page.name == "checkpoints.md" and "load_latest_checkpoint" in b.text)
    for run in ("first", "second"):
        done = _run([sys.executable, "-c", _program(block)], tmp_path)
        assert done.returncode == 0, f"the {run} run of {block.name} failed:\n{done.stdout}"


def test_every_page_is_tested_and_marks_are_known():
    """The pages hold blocks this test runs (a renamed language would silently drop them)."""
    readme = [block for block in BLOCKS if block.page.name == "README.md"]
    assert {block.language for block in readme} == set(LANGUAGES)
    untested = [f"{page.name}:{number}" for page in PAGES
                for number, line in enumerate(page.read_text().splitlines(), 1)
                if re.fullmatch(r"```(sh|shell|py|python3|text)", line)]
    assert not untested, f"blocks in a language this test does not run (use bash, console or python): {untested}"


def small(commands: str) -> str:
    """``commands`` with ``SMALL``'s options after each ``shardwire train`` or ``bench`` that runs a job."""
    out = []
    for line in _logical_lines(commands):
        code, comment = re.match(r"(.*?)(\s+#.*)?$", line).groups()
        for command, extra in SMALL.items():
            if re.search(rf"\bshardwire {command}\b", code) and not any(flag in code for flag in _ONLY_PRINTS):
                head, tail = re.match(r"(.*?)(\s+(?:>|\||&&|2>).*)?$", code).groups()
                code = f"{head} {' '.join(extra)}{tail or ''}"
        out.append(code + (comment or ""))
    return "\n".join(out) + "\n"


def console_commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, the lines shown after it) for each ``$ command`` of a console block."""
    pairs: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    for line in lines:
        if line.startswith("$ "):
            pairs.append((line[2:], []))
        elif pairs and pairs[-1][0].endswith("\\"):
            pairs[-1] = (pairs[-1][0][:-1] + line.strip(), pairs[-1][1])  # a continued command
        else:
            assert pairs, f"a console block starts with output, not a $ command: {line!r}"
            pairs[-1][1].append(line)
    return pairs


def first_missing(shown: list[str], printed: list[str], *, alike: bool) -> str | None:
    """The first line of ``shown`` (``...`` skips any lines) not found, in order, in ``printed``."""
    same = _alike if alike else str.rstrip
    printed = [same(line) for line in printed]
    at = 0
    for line in shown:
        if line.strip() == "...":
            continue
        try:
            at = printed.index(same(line), at) + 1
        except ValueError:
            return line
    return None


def _alike(line: str) -> str:
    """``line`` with what differs from run to run made alike: progress bars, durations, sizes, link
    rates (which ``testbed up --like`` sets from this machine's speed), numbers."""
    line = re.sub(r"\[[#.]+\]", "[bar]", line)
    line = re.sub(r"\b(\d+h)?(\d+m)?\d+(\.\d+)?(ms|s)\b", "<time>", line)
    line = re.sub(r"\b\d+(\.\d+)? ?[KMGT]?i?B\b", "<size>", line)
    line = re.sub(r"\b\d+(\.\d+)?[kmg]?bit\b", "<rate>", line)
    line = re.sub(r"[-+]?\d[\d,]*(\.\d+)?([eE][-+]?\d+)?", "<n>", line)
    return " ".join(line.split())


def _logical_lines(text: str) -> list[str]:
    """Lines, with backslash-continued ones joined."""
    joined, pending = [], ""
    for line in text.splitlines():
        if line.endswith("\\"):
            pending += line[:-1]
        else:
            joined.append(pending + line)
            pending = ""
    return joined


def _program(block: Block) -> str:
    """The block's program: with ``continues``, the page's python blocks before it come first."""
    if "continues" not in block.marks:
        return block.text
    earlier = [b for b in BLOCKS if b.page == block.page and b.language == "python" and b.line < block.line]
    return _program(earlier[-1]) + block.text


def _skip_unless_runnable(marks: frozenset[str]) -> None:
    if "needs cluster" in marks:
        pytest.skip("needs several machines")
    if "needs install" in marks:
        pytest.skip("installs packages: .ci/run runs the README's set-up commands in a new virtual environment")
    if "needs gpu" in marks and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if "needs root" in marks and (os.geteuid() != 0 or shutil.which("ip") is None):
        pytest.skip("needs root and iproute2")


def _run(argv: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "COLUMNS": "120"}
    return subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=840)
