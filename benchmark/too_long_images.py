"""How long a server takes to refuse a prompt with images that is too long for ``session_len``: the tests' tiny
random Qwen2-VL at ``session_len`` 256, a chat request of 16 PNG images of 2048x2048 (a gradient, as data URLs)
too long by its text (2,000 words) and, separately, by its images alone (313 tokens). Each round starts a server
in a fresh process from ``--base TREE`` (e.g. main's checkout) and from this tree, alternately, and sends each
request ``--requests`` times; the table gives the median wall seconds of a refusal per side, the median CPU
seconds of that process over it (all its threads: the server's preprocessing thread and the client), and the
ratio of the walls.

    python benchmark/too_long_images.py --base /work/main --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SESSION_LEN = 256
CASES = {'too long by its text': 'word ' * 2000, 'too long by its images': 'describe'}


def child(model_path: str, requests: int) -> dict[str, list[list[float]]]:
    """In a fresh process: a server on the model, each case's refusal timed ``requests`` times."""
    import base64
    import io

    import httpx
    from PIL import Image

    sys.path.insert(0, str(HERE.parent / 'tests'))
    from server_helpers import serve, tiny_engine  # the tests' own server thread

    buffer = io.BytesIO()
    Image.linear_gradient('L').resize((2048, 2048)).convert('RGB').save(buffer, format='PNG')
    url = 'data:image/png;base64,' + base64.b64encode(buffer.getvalue()).decode()
    images = [{'type': 'image_url', 'image_url': {'url': url}}] * 16
    server = serve(tiny_engine(model_path, session_len=SESSION_LEN), model_name='m')
    running = next(server)
    out: dict[str, list[list[float]]] = {}
    for name, text in CASES.items():
        body = {'model': 'm', 'max_tokens': 2,
                'messages': [{'role': 'user', 'content': images + [{'type': 'text', 'text': text}]}]}
        for _ in range(requests):
            wall, cpu = time.perf_counter(), time.process_time()
            r = httpx.post(f'{running.url}/v1/chat/completions', json=body, timeout=600)
            out.setdefault(name, []).append([time.perf_counter() - wall, time.process_time() - cpu])
            assert r.status_code == 400 and r.json()['error']['code'] == 'context_length_exceeded', r.text
    next(server, None)
    return out


def run_side(tree: str, model_path: str, requests: int) -> dict[str, list[list[float]]]:
    env = {**os.environ, 'PYTHONPATH': tree}
    proc = subprocess.run([sys.executable, __file__, '--child', model_path, '--requests', str(requests)],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--base', required=False, help='another checkout to run alternately with this one')
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--requests', type=int, default=2, help='refusals of each case per server')
    parser.add_argument('--child', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.requests)))
        return
    sys.path.insert(0, str(HERE.parent / 'tests'))
    from vl_models import save_tiny_vl_model
    model_path = save_tiny_vl_model('qwen2_vl', tempfile.mkdtemp(prefix='too_long_images_'))
    trees = {'this': str(HERE.parent)} | ({'base': str(Path(args.base).resolve())} if args.base else {})
    runs: dict[str, dict[str, list[list[float]]]] = {side: {} for side in trees}
    print(f'load average at the start: {os.getloadavg()}')
    for round_ in range(args.rounds):
        for side in (reversed(trees) if round_ % 2 else trees):
            for name, times in run_side(trees[side], model_path, args.requests).items():
                runs[side].setdefault(name, []).extend(times)
    print(f'load average at the end: {os.getloadavg()}')
    print(f'{"case":<24}' + ''.join(f'{side + " wall":>12}{side + " cpu":>12}' for side in trees)
          + ('   wall ratio base/this' if 'base' in trees else ''))
    for name in CASES:
        medians = {side: [statistics.median(t[i] for t in runs[side][name]) for i in (0, 1)] for side in trees}
        line = f'{name:<24}' + ''.join(f'{medians[side][0]:>11.2f}s{medians[side][1]:>11.2f}s' for side in trees)
        if 'base' in trees:
            line += f'{medians["base"][0] / medians["this"][0]:>12.1f}x'
        print(line)


if __name__ == '__main__':
    main()
