"""``lmdeploy serve api_server [MODEL]``: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse

from lmdeploy.cli.args import HelpFormatter, add_engine_args, add_list_arg, engine_config, setup_logging
from lmdeploy.cli.proxy import add_proxy_parser, add_scale_out_args


def add_serve_parser(commands) -> None:
    """Registers ``lmdeploy serve api_server``."""
    serve = commands.add_parser('serve', help='serve a model over HTTP', formatter_class=HelpFormatter)
    serve.set_defaults(help_of=serve)
    servers = serve.add_subparsers(dest='server', metavar='SERVER')
    parser = servers.add_parser('api_server', help='OpenAI-compatible server and chat page (see docs/api_server.md)',
                                formatter_class=HelpFormatter)
    add_engine_args(parser)
    parser.add_argument('--server-name', default='127.0.0.1', help='address to listen on')
    parser.add_argument('--server-port', type=int, default=23333)
    parser.add_argument('--model-name', default=None,
                        help="the model id clients send (default: the model's name: the .gguf file's or the folder's)")
    add_list_arg(parser, '--api-keys', 'an accepted Bearer key (default: no auth)', metavar='KEY')
    add_list_arg(parser, '--admin-api-keys', 'a Bearer key that may also do admin actions (abort_request with '
                 'abort_all); default: none, abort_all is refused', metavar='KEY')
    add_list_arg(parser, '--allow-origins', 'a CORS origin (default: CORS off)', metavar='ORIGIN')
    parser.add_argument('--allow-credentials', action='store_true')
    add_list_arg(parser, '--allow-methods', "a CORS method (default: '*')", metavar='METHOD')
    add_list_arg(parser, '--allow-headers', "a CORS header (default: '*')", metavar='HEADER')
    parser.add_argument('--generation-config', default='auto', choices=['auto', 'none'],
                        help="sampling defaults for what a request leaves out: 'auto' takes them from the model's "
                             "generation_config.json, 'none' uses the OpenAI API's (temperature 1, top_p 1)")
    parser.add_argument('--no-web-ui', dest='web_ui', action='store_false',
                        help='do not serve the chat page at /')
    parser.add_argument('--max-concurrent-requests', type=int, default=256,
                        help='generations served at once (a request takes n x prompts); more wait in the queue')
    parser.add_argument('--max-queue-size', type=int, default=1024,
                        help='generations that may wait; beyond that the server answers 429')
    _add_limit_args(parser)
    _add_parser_args(parser)
    parser.add_argument('--shutdown-timeout', type=float, default=30.0,
                        help='seconds requests in flight get to finish after SIGTERM before they are aborted')
    add_list_arg(parser, '--allowed-media-domains', "a host image_url may fetch http(s) images from ('*': any; "
                 'default: none)', metavar='HOST')
    parser.add_argument('--allowed-local-media-path', default=None,
                        help='directory whose files image_url may name (default: no local files)')
    parser.add_argument('--allow-private-media-hosts', action='store_true',
                        help='let image_url fetch from hosts that resolve to loopback, private, link-local or '
                             'other non-public addresses (default: refused, whatever --allowed-media-domains says)')
    add_scale_out_args(parser)
    # At INFO the server says what it serves and where, logs one line per request and its shutdown.
    parser.set_defaults(run=run_api_server, log_level='INFO')
    add_proxy_parser(servers)


LIMIT_HELP = {
    'max_request_body_bytes': 'request body size in bytes (Content-Length or bytes read, chunked too); over: 413',
    'max_messages': 'chat messages per request; over: 400',
    'max_prompt_chars': 'characters of prompt text per request (messages, tools, template variables, prompts); over: 400',
    'max_stop_sequences': 'stop strings per request; over: 400',
    'max_stop_length': 'characters per stop string; over: 400',
    'max_stop_token_ids': 'stop_token_ids per request; over: 400',
    'max_fanout': 'generations one request fans out to (n x prompts); over: 400',
    'max_grammar_compile_seconds': 'seconds a response format (JSON schema, regex, grammar) may take to compile; '
                                   'over: 400',
    'max_grammar_size': 'bytes of a response format (JSON schema as compact JSON, regex, grammar, choices); over: 400',
    'max_grammar_repetition': 'character classes the regexes of a response format spell out, each counted once '
                              "more per optional item before it (a JSON schema pattern's {m,n} bounds multiplied "
                              'out, nested ones multiplied, 20 per string format, all added); over: 400',
    'max_grammar_optionals': 'optional items (x?, x{0,1}, empty alternatives) of one regex or grammar of a response '
                             'format; over: 400',
}


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    from lmdeploy.serve.openai.limits import RequestLimits
    defaults = RequestLimits()
    for name, text in LIMIT_HELP.items():
        parser.add_argument('--' + name.replace('_', '-'), type=int, default=getattr(defaults, name),
                            help=f'{text} (default: %(default)s; 0: no limit)')
    parser.add_argument('--preprocess-workers', type=int, default=2,
                        help='threads that tokenize and preprocess images of admitted requests')


def _add_parser_args(parser: argparse.ArgumentParser) -> None:
    from lmdeploy.serve.openai.reasoning_parsers import REASONING_PARSERS
    from lmdeploy.serve.openai.tool_parsers import TOOL_PARSERS
    parser.add_argument('--tool-call-parser', default=None, choices=sorted(TOOL_PARSERS),
                        help="reads tool calls out of chat replies (needed for tool_choice 'auto'; default: none)")
    parser.add_argument('--reasoning-parser', default=None, choices=sorted(REASONING_PARSERS),
                        help='splits chat replies into reasoning_content and content (default: none)')


def _limits(args: argparse.Namespace):
    from lmdeploy.serve.openai.limits import RequestLimits
    return RequestLimits(**{name: getattr(args, name) or None for name in LIMIT_HELP})


def run_api_server(args: argparse.Namespace) -> None:
    from lmdeploy.model_source import check_model_path
    check_model_path(args.model_path)
    setup_logging(args.log_level)
    config = engine_config(args)  # a bad flag is refused before torch loads
    if args.dp > 1:  # the parent only proxies: torch loads in the replicas alone
        from lmdeploy.serve.proxy.dp import run_data_parallel
        run_data_parallel(args, run_api_server)
        return
    from lmdeploy.serve.async_engine import AsyncEngine
    from lmdeploy.serve.openai.api_server import create_app, run_server
    from lmdeploy.vl.media import MediaPolicy
    media = MediaPolicy(allowed_domains=tuple(args.allowed_media_domains or ()),
                        allowed_local_path=args.allowed_local_media_path,
                        allow_private_hosts=args.allow_private_media_hosts)
    engine = AsyncEngine(args.model_path, config, show_progress=False, media_policy=media)
    try:
        app = create_app(engine, args.model_name, args.api_keys, args.allow_origins, args.allow_credentials,
                         args.allow_methods, args.allow_headers, args.max_concurrent_requests, args.max_queue_size,
                         limits=_limits(args), preprocess_workers=args.preprocess_workers,
                         admin_api_keys=args.admin_api_keys, tool_call_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser, generation_config=args.generation_config,
                         web_ui=args.web_ui)
        joins = {'proxy_url': args.proxy_url, 'proxy_api_key': args.proxy_api_key} if args.proxy_url else {}
        run_server(app, args.server_name, args.server_port, args.log_level, args.shutdown_timeout, **joins)
    finally:
        engine.close()
