"""The README indexes every documentation page and every command of the CLI."""

import argparse
import re
from pathlib import Path

from tokenmill.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def command_names(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield " ".join((*prefix, name))
                yield from command_names(sub, (*prefix, name))


def test_readme_documentation_index_lists_every_docs_page():
    index = README.split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    pages = sorted(path.name for path in (ROOT / "docs").glob("*.md"))
    assert pages
    missing = [page for page in pages if f"](docs/{page}):" not in index]
    assert not missing, f"README.md's documentation index does not list {missing}"


def test_readme_names_every_command():
    names = list(command_names(build_parser()))
    assert {"run", "bench throughput", "api key create"} <= set(names)
    missing = [name for name in names if not re.search(rf"`tokenmill {re.escape(name)}(?![\w-])", README)]
    assert not missing, f"README.md does not name {['tokenmill ' + name for name in missing]}"
