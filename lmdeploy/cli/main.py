"""The ``lmdeploy`` command line."""
from __future__ import annotations

import argparse

from lmdeploy.cli.chat import add_chat_parser
from lmdeploy.cli.lite import add_lite_parser
from lmdeploy.cli.serve import add_serve_parser


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog='lmdeploy', description='Serve, chat with and quantize large language models.')
    commands = parser.add_subparsers(dest='command', required=True)
    add_chat_parser(commands)
    add_serve_parser(commands)
    add_lite_parser(commands)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == '__main__':
    main()
