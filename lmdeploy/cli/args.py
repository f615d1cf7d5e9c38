"""Command-line arguments shared by ``lmdeploy chat`` and ``lmdeploy serve api_server``."""
from __future__ import annotations

import argparse
import copy
import logging

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default, unless its help already says it or there is none to show."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and _has_default(action):  # argparse prints no help line without a help text
            action = copy.copy(action)
            action.help = '(default: %(default)s)'
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ''
        if 'default' not in text and _has_default(action):
            text += ' (default: %(default)s)'
        return text


def _has_default(action: argparse.Action) -> bool:
    """Whether the option takes a value and has a default worth showing (flags without a value have none)."""
    return (bool(action.option_strings) and action.nargs != 0 and action.default is not None
            and action.default is not argparse.SUPPRESS and action.default not in ((), []))


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f'must be at least 1, got {value}')
    return value


def add_list_arg(parser: argparse.ArgumentParser, flag: str, help: str, **kwargs) -> None:
    """A flag that takes one value and may be repeated (``--api-keys k1 --api-keys k2``): a flag taking
    several values would swallow the MODEL argument after it."""
    parser.add_argument(flag, action='append', default=None, help=f'{help}; repeat the flag for more', **kwargs)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """MODEL and the :class:`PytorchEngineConfig` flags."""
    parser.add_argument('model_path', nargs='?', default=None,
                        help='local Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct, fetched once)')
    parser.add_argument('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'])
    parser.add_argument('--session-len', type=int, default=None, help='context length (default: the model\'s)')
    parser.add_argument('--max-batch-size', type=int, default=64)
    parser.add_argument('--cache-max-entry-count', type=float, default=0.5,
                        help='fraction of free GPU memory, or of available RAM (at most 4 GiB) on the CPU, '
                             'the KV cache may take')
    parser.add_argument('--num-gpu-blocks', type=int, default=0,
                        help='number of KV-cache blocks (0: size the cache from --cache-max-entry-count)')
    parser.add_argument('--block-size', type=int, default=64)
    parser.add_argument('--enable-prefix-caching', dest='enable_prefix_caching', action='store_true', default=True,
                        help='reuse the KV cache of prompt prefixes seen before (default: on)')
    parser.add_argument('--disable-prefix-caching', dest='enable_prefix_caching', action='store_false')
    parser.add_argument('--tp', type=positive_int, default=1,
                        help='tensor parallelism: split the model over this many ranks (processes or Ray actors)')
    parser.add_argument('--distributed-executor-backend', default='mp', choices=['mp', 'ray'],
                        help="how the ranks besides this process run with --tp > 1: 'mp' (processes on this "
                             "machine) or 'ray' (Ray actors; joins $RAY_ADDRESS or starts a local cluster)")
    parser.add_argument('--ray-placement-strategy', default='PACK', choices=['PACK', 'SPREAD'],
                        help="with 'ray': PACK fills this machine first, SPREAD puts the ranks on as many machines "
                             'as it can')
    parser.add_argument('--device', default='cpu', help="'cpu' or 'cuda' (or 'cuda:N')")
    parser.add_argument('--num-threads', type=int, default=None,
                        help="torch's CPU threads (default or 0: torch's choice; with --tp, one per core of a "
                             "rank's share)")
    parser.add_argument('--eager-mode', action='store_true', help='on CUDA, run decode steps without CUDA graphs')
    parser.add_argument('--load-format', default='auto', choices=['auto', 'dummy'],
                        help="'dummy': random weights at the model's shape (for speed tests; no weight files read)")
    parser.add_argument('--quant-policy', type=int, default=0, choices=[0, 4, 8],
                        help='KV-cache quantization: 0 off, 8 int8, 4 int4 (per-token, per-head scales and zeros)')
    parser.add_argument('--grammar-cache-mb', type=int, default=512,
                        help='MiB of compiled grammars (response formats, forced tool calls) kept for reuse, the least '
                             'recently used dropped first (as vLLM\'s VLLM_XGRAMMAR_CACHE_MB); 0: none kept')
    parser.add_argument('--log-level', default='WARNING', choices=['DEBUG', 'INFO', 'WARNING', 'ERROR'])


def setup_logging(level: str) -> None:
    """lmdeploy's log lines at ``level`` on stderr; other libraries' at WARNING."""
    logging.basicConfig(format='%(levelname)s:  %(message)s')
    logging.getLogger('lmdeploy').setLevel(level)


def engine_config(args: argparse.Namespace) -> PytorchEngineConfig:
    """The engine config the flags of :func:`add_engine_args` ask for."""
    return PytorchEngineConfig(dtype=args.dtype, session_len=args.session_len, max_batch_size=args.max_batch_size,
                               cache_max_entry_count=args.cache_max_entry_count, num_gpu_blocks=args.num_gpu_blocks,
                               block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
                               tp=args.tp, distributed_executor_backend=args.distributed_executor_backend,
                               ray_placement_strategy=args.ray_placement_strategy,
                               device=args.device, num_threads=args.num_threads, eager_mode=args.eager_mode,
                               load_format=args.load_format, quant_policy=args.quant_policy,
                               grammar_cache_mb=args.grammar_cache_mb)


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    """The sampling flags (the same knobs as the server's request fields)."""
    parser.add_argument('--max-new-tokens', type=int, default=512)
    parser.add_argument('--temperature', type=float, default=0.0, help='0 means greedy decoding')
    parser.add_argument('--top-p', type=float, default=1.0)
    parser.add_argument('--top-k', type=int, default=0)
    parser.add_argument('--min-p', type=float, default=0.0)
    parser.add_argument('--repetition-penalty', type=float, default=1.0)
    parser.add_argument('--presence-penalty', type=float, default=0.0)
    parser.add_argument('--frequency-penalty', type=float, default=0.0)
    add_list_arg(parser, '--stop', 'a stop word', metavar='WORD')
    parser.add_argument('--ignore-eos', action='store_true')
    parser.add_argument('--min-new-tokens', type=int, default=0)
    parser.add_argument('--seed', type=int, default=None)


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """The generation config the flags of :func:`add_generation_args` ask for."""
    return GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, stop_words=args.stop or None,
                            ignore_eos=args.ignore_eos, min_new_tokens=args.min_new_tokens, random_seed=args.seed)
