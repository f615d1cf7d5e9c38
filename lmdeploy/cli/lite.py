"""``lmdeploy lite``: offline quantization. ``lmdeploy lite smooth_quant MODEL OUT`` writes a W8A8 checkpoint
(see :mod:`lmdeploy.lite.smooth_quant`), ``lmdeploy lite auto_awq MODEL OUT`` a 4-bit AWQ one
(:mod:`lmdeploy.lite.auto_awq`); the engine serves both without a flag."""
from __future__ import annotations

import argparse

from lmdeploy.cli.args import HelpFormatter
from lmdeploy.lite import CALIBRATION_TOKENS


def add_lite_parser(commands) -> None:
    """Registers ``lmdeploy lite`` and its subcommands."""
    lite = commands.add_parser('lite', help='quantize a model offline', formatter_class=HelpFormatter)
    lite.set_defaults(help_of=lite)
    tools = lite.add_subparsers(dest='lite_command', metavar='COMMAND')
    parser = tools.add_parser('smooth_quant', help='SmoothQuant W8A8: int8 weights, int8 activations per token',
                              formatter_class=HelpFormatter)
    parser.add_argument('model', help='a Hugging Face folder or a .gguf file')
    parser.add_argument('out', help='the folder to write the quantized model to')
    parser.add_argument('--alpha', type=float, default=0.5,
                        help='migration strength: how much of the activations\' range moves into the weights')
    parser.add_argument('--calib-tokens', type=int, default=CALIBRATION_TOKENS,
                        help='how many tokens of the shipped calibration text to calibrate on')
    parser.add_argument('--calib-seqlen', type=int, default=512, help='tokens per calibration forward')
    parser.set_defaults(run=run_smooth_quant)
    parser = tools.add_parser('auto_awq', help='AWQ: 4-bit weights in groups, activation-aware scales (W4A16)',
                              formatter_class=HelpFormatter)
    parser.add_argument('model', help='a Hugging Face folder or a .gguf file')
    parser.add_argument('out', help='the folder to write the quantized model to')
    parser.add_argument('--w-bits', type=int, default=4, choices=[4], help='bits per weight')
    parser.add_argument('--w-group-size', type=int, default=128, help='inputs per group (one scale and zero each)')
    parser.add_argument('--calib-samples', type=int, default=8, help='calibration slices of the shipped text')
    parser.add_argument('--calib-seqlen', type=int, default=512, help='tokens per calibration slice')
    parser.add_argument('--search-scale', action=argparse.BooleanOptionalAction, default=True,
                        help='search the activation-aware scales')
    parser.add_argument('--apply-clip', action=argparse.BooleanOptionalAction, default=True,
                        help='search each weight group\'s clipping range (with --no-search-scale: plain round '
                             'to nearest)')
    parser.set_defaults(run=run_auto_awq)


def run_smooth_quant(args: argparse.Namespace) -> None:
    from lmdeploy.lite.smooth_quant import smooth_quant
    smooth_quant(args.model, args.out, alpha=args.alpha, calib_tokens=args.calib_tokens, seq_len=args.calib_seqlen)
    print(f'wrote the W8A8 model to {args.out}')


def run_auto_awq(args: argparse.Namespace) -> None:
    from lmdeploy.lite.auto_awq import auto_awq
    auto_awq(args.model, args.out, w_bits=args.w_bits, w_group_size=args.w_group_size,
             calib_samples=args.calib_samples, calib_seqlen=args.calib_seqlen, search_scale=args.search_scale,
             apply_clip=args.apply_clip)
    print(f'wrote the AWQ model to {args.out}')
