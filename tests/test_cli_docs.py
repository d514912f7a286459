"""docs/cli.md documents every command-line option."""

import pathlib

from server.cli import build_parser

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def test_every_option_is_in_docs_cli_md():
    text = DOC.read_text()
    options = [
        opt
        for action in build_parser()._actions
        for opt in action.option_strings
        if opt.startswith("--")
    ]
    missing = [opt for opt in options if opt not in text]
    assert not missing, f"document these in docs/cli.md: {missing}"


def test_every_option_of_a_listening_worker_is_in_docs_cli_md():
    from server.workers.listen import build_parser as worker_parser

    text = DOC.read_text().split("## A listening worker", 1)[1]
    options = [
        opt for action in worker_parser()._actions for opt in action.option_strings
        if opt.startswith("--")
    ]
    missing = [opt for opt in options if opt not in text]
    assert not missing, f"document these in docs/cli.md (a listening worker): {missing}"
