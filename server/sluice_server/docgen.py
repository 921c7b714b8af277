"""`python -m sluice_server.docgen --write` (or `--check`; `make docs`): the generated parts of
the server's docs, so no table is written twice.

- the flag table (server/README.md; other docs link to it) from the Settings fields'
  descriptions, and the router's from RouterSettings';
- the module map (server/README.md), one line per module from its docstring's first sentence.

Each generated part sits between `<!-- generated:NAME -->` and `<!-- end:NAME -->`.
`--check` exits 1 naming the stale files (a test runs it).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from .settings import RouterSettings, flag_table

PACKAGE = Path(__file__).resolve().parent
REPO = PACKAGE.parents[1]


def first_sentence(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return match.group(1) if match else paragraph


def module_map() -> str:
    rows = ["| module | what |", "|---|---|"]
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        rows.append(f"| `{rel}` | {first_sentence(path)} |")
    return "\n".join(rows) + "\n"


def sections() -> dict[Path, dict[str, str]]:
    return {
        REPO / "server" / "README.md": {
            "flags": flag_table(),
            "router-flags": flag_table(RouterSettings),
            "modules": module_map(),
        },
    }


def render(text: str, parts: dict[str, str]) -> str:
    for name, body in parts.items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n).*?(<!-- end:{name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no <!-- generated:{name} --> ... <!-- end:{name} --> markers")

        def fill(m: re.Match[str], body: str = body) -> str:
            return m.group(1) + body + m.group(2)

        text = pattern.sub(fill, text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the generated parts")
    mode.add_argument("--check", action="store_true", help="exit 1 when one is stale")
    args = p.parse_args(argv)
    stale = []
    for path, parts in sections().items():
        old = path.read_text()
        new = render(old, parts)
        if new != old:
            stale.append(str(path.relative_to(REPO)))
            if args.write:
                path.write_text(new)
    if stale and args.check:
        print(f"stale generated docs: {', '.join(stale)} (run `make docs`)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
