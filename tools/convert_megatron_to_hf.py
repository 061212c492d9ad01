"""Convert a Megatron dist checkpoint (converter output or a training checkpoint, any TP/PP
layout) to an HF safetensors directory, on CPU.

    python tools/convert_megatron_to_hf.py --megatron-dir M --hf-dir H [--hf-config-dir C]

Same as `megatron-dapo convert megatron-to-hf`.
"""

import argparse
import sys

from megatron_dapo.commands.convert import add_megatron_to_hf_args, run_megatron_to_hf

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_megatron_to_hf_args(parser)
    sys.exit(run_megatron_to_hf(parser.parse_args()))
