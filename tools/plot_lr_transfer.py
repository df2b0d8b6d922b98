#!/usr/bin/env python3
"""Plot an LR-transfer sweep: one panel per optimizer, final loss vs LR, one curve per width.

    python tools/plot_lr_transfer.py OUT/results.csv --out PLOT.png   # also copies the CSV to PLOT.csv
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from megatron_md.sweep.plot import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
