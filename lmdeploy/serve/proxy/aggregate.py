"""The proxy's answers made from all healthy nodes: ``/v1/models`` (the union of the nodes' models) and
``/metrics`` (each node's metrics labelled ``node="URL"``, and the proxy's own per-node gauges)."""
from __future__ import annotations

import asyncio

import httpx
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from lmdeploy.serve.proxy.forward import proxy_error
from lmdeploy.serve.proxy.nodes import Node, NodeRegistry

NO_NODE = 'no healthy node: the proxy has no node that passes its health check'


async def _get_all(registry: NodeRegistry, path: str, headers: dict[str, str]) -> list[tuple[Node, httpx.Response]]:
    """``GET path`` on every healthy node at once (with the client's ``headers``); nodes that fail are left out."""
    nodes = registry.healthy()

    async def get(node: Node) -> httpx.Response | None:
        try:
            return await registry.probe.get(f'{node.url}{path}', headers=headers)
        except httpx.HTTPError:
            return None
    answers = await asyncio.gather(*(get(node) for node in nodes))
    return [(node, answer) for node, answer in zip(nodes, answers) if answer is not None]


def _passthrough(answer: httpx.Response) -> Response:
    return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get('content-type'))


async def list_models(registry: NodeRegistry, headers: dict[str, str]) -> Response:
    """The models of all healthy nodes, each id once; when no node answers 200, the first answer as it is."""
    answers = await _get_all(registry, '/v1/models', headers)
    ok = [answer for _, answer in answers if answer.status_code == 200]
    if not ok:
        return _passthrough(answers[0][1]) if answers else proxy_error(503, NO_NODE, 'no_healthy_node')
    cards: dict[str, dict] = {}
    for answer in ok:
        for card in answer.json().get('data', ()):
            cards.setdefault(card['id'], card)
    return JSONResponse({'object': 'list', 'data': list(cards.values())})


class _Families:
    """A collector that yields fixed metric families."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _proxy_families(registry: NodeRegistry) -> list[Metric]:
    healthy = GaugeMetricFamily('lmdeploy_proxy:node_healthy', 'Whether the node passes its health check.',
                                labels=['node'])
    in_flight = GaugeMetricFamily('lmdeploy_proxy:node_requests_in_flight', 'Requests in flight on the node '
                                  'through this proxy.', labels=['node'])
    for node in registry.nodes.values():
        healthy.add_metric([node.url], float(node.healthy))
        in_flight.add_metric([node.url], float(node.outstanding))
    return [healthy, in_flight]


async def metrics(registry: NodeRegistry, headers: dict[str, str]) -> Response:
    """Prometheus text: every healthy node's samples with a ``node`` label, then the proxy's gauges. When
    nodes answer but none with 200 (a wrong API key), the first answer as it is."""
    answers = await _get_all(registry, '/metrics', headers)
    ok = [(node, answer) for node, answer in answers if answer.status_code == 200]
    if answers and not ok:
        return _passthrough(answers[0][1])
    families: dict[str, Metric] = {}
    for node, answer in ok:
        for family in text_string_to_metric_families(answer.text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
            merged.samples.extend(sample._replace(labels={**sample.labels, 'node': node.url})
                                  for sample in family.samples)
    collected = CollectorRegistry(auto_describe=False)
    collected.register(_Families([*families.values(), *_proxy_families(registry)]))
    return Response(generate_latest(collected), media_type=CONTENT_TYPE_LATEST)
