"""Convert an HF checkpoint to a Megatron dist checkpoint at any TP/PP layout.

    python tools/convert_hf_to_megatron.py --hf-dir H --megatron-dir M --tp 2 --pp 2 [--vpp 2]

Same as `megatron-dapo convert hf-to-megatron`; launches the TP*PP ranks itself.
"""

import argparse
import sys

from megatron_dapo.commands.convert import add_hf_to_megatron_args, run_hf_to_megatron

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_hf_to_megatron_args(parser)
    sys.exit(run_hf_to_megatron(parser.parse_args()))
