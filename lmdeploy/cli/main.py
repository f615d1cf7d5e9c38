"""The ``lmdeploy`` command line. Parsing imports no torch: a command's heavy modules load when it runs."""
from __future__ import annotations

import argparse
import os
import sys

from lmdeploy import __version__
from lmdeploy.messages import ConfigError
from lmdeploy.model_source import ModelNotFoundError


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``lmdeploy`` command; a command without a subcommand prints its help."""
    from lmdeploy.cli.args import HelpFormatter
    from lmdeploy.cli.chat import add_chat_parser
    from lmdeploy.cli.lite import add_lite_parser
    from lmdeploy.cli.serve import add_serve_parser
    parser = argparse.ArgumentParser(prog='lmdeploy', description='Serve, chat with and quantize large language models.',
                                     formatter_class=HelpFormatter)
    parser.add_argument('--version', action='version', version=f'lmdeploy {__version__}')
    parser.set_defaults(run=None, help_of=parser)
    commands = parser.add_subparsers(dest='command', metavar='COMMAND')
    add_chat_parser(commands)
    add_serve_parser(commands)
    add_lite_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    try:
        args = build_parser().parse_args(argv)
        help_of = vars(args).pop('help_of')  # the args go to --dp replicas: no parser in them (not picklable)
        if args.run is None:
            help_of.print_help()
            return
        args.run(args)
    except KeyboardInterrupt:
        print('\nlmdeploy: interrupted', file=sys.stderr, flush=True)
        os._exit(130)  # the engine thread may still be building: do not wait for it
    except (ModelNotFoundError, ConfigError) as exc:  # the message says what to give instead: no traceback
        print(f'lmdeploy: error: {exc}', file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == '__main__':
    main()
