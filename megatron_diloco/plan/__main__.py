"""``python -m megatron_diloco.plan``: :func:`megatron_diloco.plan.cli.main`."""

import sys

from megatron_diloco.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
