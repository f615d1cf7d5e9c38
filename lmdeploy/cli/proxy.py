"""``lmdeploy serve proxy``: one address in front of several api_servers (see docs/scale_out.md), and the
api_server flags that scale it out (``--dp``, ``--proxy-url``)."""
from __future__ import annotations

import argparse
import logging

from lmdeploy.serve.proxy.routing import ROUTING_STRATEGIES


def _add_routing_arg(parser: argparse.ArgumentParser, note: str = '') -> None:
    parser.add_argument('--routing-strategy', default='least_requests', choices=sorted(ROUTING_STRATEGIES),
                        help='least_requests: the node with the fewest requests in flight; prefix_affinity: '
                             f'requests of one session or with one long prompt prefix go to one node{note}')


def _add_health_interval_arg(parser: argparse.ArgumentParser, note: str = '') -> None:
    parser.add_argument('--health-interval', type=float, default=5.0,
                        help=f'seconds between health checks of each node{note}')


def add_proxy_parser(servers) -> None:
    """Registers ``lmdeploy serve proxy``."""
    from lmdeploy.cli.args import HelpFormatter, add_list_arg
    from lmdeploy.serve.openai.limits import RequestLimits
    parser = servers.add_parser('proxy', help='proxy in front of several api_servers (see docs/scale_out.md)',
                                formatter_class=HelpFormatter)
    parser.add_argument('--server-name', default='127.0.0.1', help='address to listen on')
    parser.add_argument('--server-port', type=int, default=8000)
    parser.add_argument('--nodes', nargs='*', default=(),
                        help='api_server URLs to start with (more join with POST /nodes/add or --proxy-url)')
    _add_routing_arg(parser)
    parser.add_argument('--affinity-prefix-chars', type=int, default=512,
                        help='prefix_affinity: how many leading characters of the prompt pick the node')
    add_list_arg(parser, '--api-keys', 'a Bearer key clients must send (default: none); keys go on to the nodes '
                 'as sent', metavar='KEY')
    add_list_arg(parser, '--admin-api-keys', 'a Bearer key that may add and remove nodes (with --api-keys and '
                 'without these, nodes come from --nodes only)', metavar='KEY')
    _add_health_interval_arg(parser)
    parser.add_argument('--request-timeout', type=float, default=600.0,
                        help='seconds to wait on a node: for its answer, its next streamed chunk, a free connection')
    parser.add_argument('--max-connections-per-node', type=int, default=1024,
                        help='connections open to one node at most (requests beyond wait for one)')
    parser.add_argument('--max-request-body-bytes', type=int, default=RequestLimits.max_request_body_bytes,
                        help='request body size in bytes (Content-Length or bytes read, chunked too); over: 413 '
                             '(default: %(default)s; 0: no limit)')
    parser.add_argument('--shutdown-timeout', type=float, default=30.0,
                        help='seconds requests in flight get to finish after SIGTERM')
    parser.add_argument('--log-level', default='WARNING', choices=['DEBUG', 'INFO', 'WARNING', 'ERROR'])
    parser.set_defaults(run=run_proxy_server)


def add_scale_out_args(parser: argparse.ArgumentParser) -> None:
    """``api_server``'s ``--dp``, ``--proxy-url`` and ``--proxy-api-key``."""
    from lmdeploy.cli.args import positive_int
    parser.add_argument('--dp', type=positive_int, default=1,
                        help='engine replicas, each a process on --server-port + 1.. behind a proxy on --server-port '
                             '(on the CPU each gets its share of the cores; on CUDA one device each)')
    _add_routing_arg(parser, ' (with --dp)')
    _add_health_interval_arg(parser, ' (with --dp: of each replica, which the proxy takes back after a restart once '
                             'it passes one)')
    parser.add_argument('--proxy-url', default=None,
                        help='a proxy (lmdeploy serve proxy) to register at on startup and leave on shutdown')
    parser.add_argument('--proxy-api-key', default=None, help='the Bearer key to register at --proxy-url with')


def run_proxy_server(args: argparse.Namespace) -> None:
    from lmdeploy.serve.proxy.app import create_proxy_app, run_proxy
    logging.basicConfig(level=args.log_level)
    logging.getLogger('lmdeploy').setLevel(args.log_level)
    logging.getLogger('httpx').setLevel(logging.WARNING)  # at INFO it logs every health check
    app = create_proxy_app(args.nodes, args.routing_strategy, args.api_keys, args.admin_api_keys,
                           args.health_interval, args.request_timeout, args.max_connections_per_node,
                           args.affinity_prefix_chars, args.max_request_body_bytes or None)
    run_proxy(app, args.server_name, args.server_port, args.log_level, args.shutdown_timeout)
