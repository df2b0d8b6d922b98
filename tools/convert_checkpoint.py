#!/usr/bin/env python
"""Alias of ``megatron-md convert`` (megatron_md/convert/command.py), kept for scripts that call it."""

from __future__ import annotations

import sys

from megatron_md.convert.command import main

if __name__ == "__main__":
    sys.exit(main(prog="convert_checkpoint.py"))
