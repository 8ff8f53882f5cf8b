"""NOTE references resolve: every note cited is written down somewhere, and one cited with the file
it is in is written down in that file, so moving code cannot strand the reasons for it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a note written down: a line that starts with it, not followed by where it is (which makes it a citation)
WRITTEN = re.compile(r"^\s*(?:#\s*|\"\"\")?NOTE: \[([^\]]+)\](?:\s*$| (?!in [\w/]+\.py)[A-Za-z(`'\"])")
CITED = re.compile(r"NOTE: \[([^\]]+)\](?: in ([\w/]+\.py))?")
WRAPPED = re.compile(r"NOTE: \[([^\]]+)\] in ([\w/]+\.py)")


def _sources():
    for folder in ("lazytrain", "tests", "bench"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_cited_note_is_written_where_it_is_said_to_be():
    written: dict[str, set[str]] = {}
    cited = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = WRITTEN.match(line)
            if m:
                written.setdefault(m.group(1), set()).add(rel)
                continue
            cited += [(rel, number, c.group(1), c.group(2)) for c in CITED.finditer(line)]
        # a citation whose file is on the next line: read the text with the comment marks gone
        flat = " ".join(re.sub(r"^\s*#?\s*", "", line) for line in path.read_text(encoding="utf-8").splitlines())
        cited += [(rel, "wrapped", c.group(1), c.group(2)) for c in WRAPPED.finditer(flat)]
    assert len(written) > 50  # the pattern still finds the notes
    problems = []
    for rel, number, title, where in cited:
        if title not in written:
            problems.append(f"{rel}:{number}: NOTE [{title}] is cited but written nowhere")
        elif where and not any(w == where or w.endswith("/" + where) for w in written[title]):
            problems.append(f"{rel}:{number}: NOTE [{title}] is said to be in {where}; it is in {sorted(written[title])}")
    assert not problems, "\n".join(problems)
