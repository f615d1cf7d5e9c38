"""The ``lmdeploy`` command line. Parsing imports no torch: a command's heavy modules load when it runs."""
from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
from typing import NoReturn

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


def entry() -> NoReturn:
    """The ``lmdeploy`` command: :func:`main`, then Python's own exit (its other threads joined, its exit
    handlers run) less the teardown of every loaded module, which took 0.5-1.5 s with torch loaded: the wait
    after ``exit`` in a chat, or after a server stopped."""
    try:
        main()
        status = 0
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            raise  # a message for Python to print
        status = exc.code or 0
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    from lmdeploy.pytorch.child_process import exit_now  # here: parsing loads nothing of lmdeploy.pytorch
    exit_now(status)


if __name__ == '__main__':
    entry()
