"""Prints a pip constraints file that pins every lower bound of setup.py exactly.

Used by `.ci/lowest`: a bound is "tested" only if the suite passed with it.
Reads setup.py's requirement lists as literals, so the bounds live in one place.
"""

import ast
import pathlib
import re
import sys

SETUP = pathlib.Path(__file__).resolve().parents[1] / "setup.py"


def requirement_lists(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            yield ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            yield from ast.literal_eval(node.value).values()


def main() -> int:
    tree = ast.parse(SETUP.read_text(encoding="utf-8"))
    pins = {}
    for requirements in requirement_lists(tree):
        for requirement in requirements:
            match = re.match(r"^([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?.*?>=\s*([0-9][^,;\s]*)",
                             requirement)
            if match is None:
                print(f"{requirement!r} has no lower bound", file=sys.stderr)
                return 1
            pins[match.group(1).lower()] = match.group(2)
    for name, version in sorted(pins.items()):
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
