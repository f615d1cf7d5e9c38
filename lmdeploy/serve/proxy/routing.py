"""How the proxy picks a node for a request: ``least_requests`` (the default) or ``prefix_affinity``."""
from __future__ import annotations

import hashlib
import itertools
import json

from lmdeploy.messages import ConfigError
from lmdeploy.serve.proxy.nodes import Node

PROMPT_FIELDS = ('messages', 'prompt', 'input_ids', 'input')


class LeastRequests:
    """The node with the fewest requests in flight through this proxy; ties go round-robin."""

    def __init__(self):
        self._turn = itertools.count()

    def choose(self, nodes: list[Node], body: object) -> Node:
        """One of ``nodes`` (healthy, at least one) for a request whose parsed JSON body is ``body``."""
        start = next(self._turn) % len(nodes)
        return min(nodes[start:] + nodes[:start], key=lambda node: node.outstanding)


class PrefixAffinity(LeastRequests):
    """Requests with the same ``session_id``, or else whose prompts share their first ``prefix_chars``
    characters (of the prompt text, or of the JSON text of the messages or token ids), go to the same node,
    so that its prefix cache hits. Nodes are ranked by rendezvous hashing: a node that comes or goes moves
    only the keys it wins. When the chosen node runs more than ``max_imbalance`` requests more than the
    least busy one, or the request has no prompt, :class:`LeastRequests` decides."""

    def __init__(self, prefix_chars: int = 512, max_imbalance: int = 8):
        if prefix_chars < 1:
            raise ConfigError(f'affinity_prefix_chars must be at least 1, got {prefix_chars}')
        super().__init__()
        self.prefix_chars = prefix_chars
        self.max_imbalance = max_imbalance

    def choose(self, nodes: list[Node], body: object) -> Node:
        key = affinity_key(body, self.prefix_chars)
        if key is None:
            return super().choose(nodes, body)
        node = max(nodes, key=lambda candidate: _weight(key, candidate.url))
        if node.outstanding - min(candidate.outstanding for candidate in nodes) > self.max_imbalance:
            return super().choose(nodes, body)
        return node


def affinity_key(body: object, prefix_chars: int) -> str | None:
    """What ties a request to a node: its session, else the start of its prompt; None if it has neither."""
    if not isinstance(body, dict):
        return None
    session = body.get('session_id')
    if isinstance(session, int) and not isinstance(session, bool):
        return f'session {session}'
    for name in PROMPT_FIELDS:
        value = body.get(name)
        if value:
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(',', ':'))
            return f'{name} {text[:prefix_chars]}'
    return None


def _weight(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f'{url}\0{key}'.encode(), digest_size=8).digest(), 'big')


ROUTING_STRATEGIES = {'least_requests': LeastRequests, 'prefix_affinity': PrefixAffinity}


def make_strategy(name: str, prefix_chars: int = 512) -> LeastRequests:
    """The strategy called ``name`` (a key of :data:`ROUTING_STRATEGIES`)."""
    if name not in ROUTING_STRATEGIES:
        raise ConfigError(f'unknown routing strategy {name!r}; choose one of {sorted(ROUTING_STRATEGIES)}')
    return PrefixAffinity(prefix_chars) if name == 'prefix_affinity' else LeastRequests()
