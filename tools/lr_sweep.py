#!/usr/bin/env python3
"""Same as `megatron-md lr-sweep` (see its --help): an LR-transfer sweep over widths, or --coord-check."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from megatron_md.sweep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
