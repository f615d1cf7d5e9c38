"""``lmdeploy lite``: offline quantization. ``lmdeploy lite smooth_quant MODEL OUT`` writes a W8A8 checkpoint
(see :mod:`lmdeploy.lite.smooth_quant`) that the engine serves without a flag."""
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


def run_smooth_quant(args: argparse.Namespace) -> None:
    from lmdeploy.lite.smooth_quant import smooth_quant
    smooth_quant(args.model, args.out, alpha=args.alpha, calib_tokens=args.calib_tokens, seq_len=args.calib_seqlen)
    print(f'wrote the W8A8 model to {args.out}')
