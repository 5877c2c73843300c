"""The documentation cannot rot: every runnable code block in README.md and docs/*.md is run.

The rules (docs/testing.md says the same, for writers of the docs):

- A fenced block whose info string is ``python`` or ``sh`` is RUN, unless the line directly above
  its opening fence is an HTML comment ``<!-- not run: REASON -->``. REASON is required (a block
  that needs Docker, a GPU, a second machine, a Kubernetes cluster, a remote store, or runs for
  minutes; and where true, which test covers it); it shows in the test's output.
- ``text``, ``yaml``, ``toml``, ``json`` and plain (no info string) blocks are never run: they are
  output, synopses or configuration. Any other info string (``bash``, ``console``...) is an error,
  so that nothing is silently left out.
- The blocks of one file run in order, in one temporary working directory per file (a later block
  may use what an earlier one wrote), with the repository's ``.venv/bin`` first on ``PATH``,
  ``REPO_ROOT`` set to the repository (``cd "$REPO_ROOT"`` where a block needs it) and no
  ``FEEDLINE_*`` variable inherited (feedline refuses unknown ones). ``sh`` blocks run with
  ``bash -e -o pipefail``; ``python`` blocks run as a top-level script file (no main guard needed:
  feedline's workers start from such a script). Each block must exit 0 within BLOCK_TIMEOUT
  seconds and leave no process behind (its process group is checked, then killed).
- Each file is one test (``docs/loader.md``), so a failure names the file, the block's line, the
  block and its output.

Also checked: the README stays a front page (under 250 lines), every relative link in README.md
and docs/*.md points to a file that exists (and to a heading there, by GitHub's anchor rule), and
every ``not run`` comment gives a reason and sits above a block that would otherwise run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "sh"}
NEVER_RUN = {"", "text", "yaml", "toml", "json"}
BLOCK_TIMEOUT = 120
README_MAX_LINES = 250

FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`]*)$")
NOT_RUN = re.compile(r"^<!--\s*not run(?P<colon>:)?(?P<reason>.*?)-->$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the `not run` reason ("" when the comment has none), None when there is no comment

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the `not run` comment above each, if any."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = len(m["indent"]), m["info"].strip().split(" ")[0]
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{start + 1}: a code block is never closed")
        above = lines[start - 1].strip() if start > 0 else ""
        note = NOT_RUN.match(above)
        skip = None if note is None else (note["reason"].strip() if note["colon"] else "")
        out.append(Block(path, start + 1, lang, "\n".join(body) + "\n", skip))
        i += 1
    return out


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


# -- running the blocks ------------------------------------------------------------------------


def block_env() -> dict[str, str]:
    venv_bin = ROOT / ".venv" / "bin"
    bin_dir = str(venv_bin) if venv_bin.is_dir() else os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEEDLINE_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", REPO_ROOT=str(ROOT), PYTHONUNBUFFERED="1")
    return env


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def run_block(block: Block, n: int, workdir: Path, env: dict[str, str]) -> tuple[int | str, str, float]:
    """Run one block in ``workdir``; its exit code (or why it did not finish), its output, its seconds."""
    if block.lang == "python":
        script = workdir / f"docblock_{n}.py"
        cmd = [os.path.join(env["PATH"].split(os.pathsep)[0], "python"), str(script)]
    else:
        script = workdir / f"docblock_{n}.sh"
        cmd = ["bash", "-e", "-o", "pipefail", str(script)]
    script.write_text(block.code)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = f"timed out after {BLOCK_TIMEOUT} s"
    seconds = time.monotonic() - t0
    deadline = time.monotonic() + 10  # feedline's workers die with their parent, a moment later
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
        if code == 0:
            code = "left processes running (killed now)"
    return code, out, seconds


RUNNABLE_FILES = [p for p in DOC_FILES if any(b.lang in RUN and b.skip is None for b in blocks(p))]


@pytest.mark.parametrize("path", RUNNABLE_FILES, ids=ids(RUNNABLE_FILES))
def test_code_blocks_run(path: Path, tmp_path: Path):
    env = block_env()
    timings = []
    for n, block in enumerate(blocks(path), 1):
        if block.lang not in RUN or block.skip is not None:
            continue
        code, out, seconds = run_block(block, n, tmp_path, env)
        timings.append(f"{block.where()} {seconds:.1f} s")
        if code != 0:
            pytest.fail(f"{block.where()}: the {block.lang} block failed ({code}):\n"
                        f"{block.code}\n--- output (last 6000 characters) ---\n{out[-6000:]}", pytrace=False)
    print("\n".join(timings))


# -- the rules the docs are written to ---------------------------------------------------------


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < README_MAX_LINES, (f"README.md has {len(lines)} lines; keep it under {README_MAX_LINES} and "
                                           f"move the detail into docs/")


def test_every_block_runs_or_says_why_not():
    problems = []
    for path in DOC_FILES:
        for block in blocks(path):
            if block.lang not in RUN | NEVER_RUN:
                problems.append(f"{block.where()}: info string {block.lang!r}: use python or sh (run), or one of "
                                f"{sorted(NEVER_RUN - {''})} (never run)")
            elif block.skip == "":
                problems.append(f"{block.where()}: `<!-- not run: REASON -->` needs its reason")
            elif block.skip is not None and block.lang in NEVER_RUN:
                problems.append(f"{block.where()}: a `not run` comment above a {block.lang or 'plain'} block, "
                                f"which never runs")
    assert not problems, "\n".join(problems)


NOT_RUN_BLOCKS = [b for p in DOC_FILES for b in blocks(p) if b.skip]


@pytest.mark.parametrize("block", NOT_RUN_BLOCKS, ids=[f"{b.where()} not run: {b.skip}" for b in NOT_RUN_BLOCKS])
def test_not_run(block: Block):
    """Every block the tests leave out, with its reason: each shows as a skip (pytest -ra lists them)."""
    pytest.skip(f"{block.where()} not run: {block.skip}")


# -- links -------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(?P<text>.+?)\s*#*\s*$")


def prose(path: Path) -> list[tuple[int, str]]:
    """The lines outside fenced blocks, with inline code spans blanked out."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line) or (fenced and line.strip() == "```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, re.sub(r"`[^`]*`", lambda m: "`" + "x" * (len(m[0]) - 2) + "`", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lowercased, punctuation but - and _ removed, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[`*]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line) or (fenced and line.strip() == "```"):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m["text"])
            k = seen.get(base, 0)
            seen[base] = k + 1
            out.add(base if k == 0 else f"{base}-{k}")
    return out


def test_relative_links_resolve():
    problems = []
    for path in DOC_FILES:
        for n, line in prose(path):
            for m in LINK.finditer(line):
                target = m["target"]
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (path.parent / file_part).resolve() if file_part else path
                where = f"{path.relative_to(ROOT)}:{n}: [{m['text']}]({target})"
                if not dest.exists():
                    problems.append(f"{where}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    problems.append(f"{where}: {dest.relative_to(ROOT)} has no heading with the anchor #{anchor}")
    assert not problems, "\n".join(problems)


if __name__ == "__main__":  # a writer's aid: python tests/test_docs.py [FILE...] runs and times those blocks
    import tempfile

    verbose = "-v" in sys.argv
    for arg in [a for a in sys.argv[1:] if a != "-v"] or [str(p) for p in RUNNABLE_FILES]:
        path = Path(arg).resolve()
        with tempfile.TemporaryDirectory() as tmp:
            for n, block in enumerate(blocks(path), 1):
                if block.lang in RUN and block.skip is None:
                    code, out, seconds = run_block(block, n, Path(tmp), block_env())
                    print(f"{block.where()}: {code} in {seconds:.1f} s")
                    if code != 0 or verbose:
                        print(out[-3000:])
    for block in NOT_RUN_BLOCKS:
        print(f"not run: {block.where()}: {block.skip}")
