"""Snapshot Megatron-LM's `pretrain_gpt.py` command line into megatron_md/training/megatron_lm_flags.json.

The snapshot is what `megatron-md train` compares a command line against: a Megatron-LM flag megatron_md does
not implement is refused by name (not with argparse's "unrecognized arguments"), and tests check that every
flag both share keeps Megatron-LM's default (training/megatron_compat.py lists the deliberate differences).

    python tools/megatron_lm_flags.py /path/to/Megatron-LM [--commit SHA]

It imports the checkout's own `megatron.training.arguments` (and its megatron.core, not the installed one) in
a child interpreter and records, per destination, the option strings, the default and whether it takes a value.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "megatron_md" / "training" / "megatron_lm_flags.json"

_DUMP = r"""
import argparse, json, sys, warnings
warnings.simplefilter("ignore")
sys.argv = ["pretrain_gpt.py"]
from megatron.training.arguments import add_megatron_arguments
p = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
out = {}
for a in p._actions:
    longs = [o for o in a.option_strings if o.startswith("--")]
    if not longs or a.dest == "help":
        continue
    d = a.default
    try:
        json.dumps(d)
    except TypeError:
        d = repr(d)
    entry = out.setdefault(a.dest, {"flags": [], "default": d, "value": a.nargs != 0})
    entry["flags"] += [f for f in longs if f not in entry["flags"]]
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", help="A Megatron-LM source tree (its megatron/ package is imported).")
    ap.add_argument("--commit", help="The checkout's commit (default: git rev-parse HEAD there).")
    ap.add_argument("-o", "--output", default=str(OUT))
    a = ap.parse_args(argv)
    root = Path(a.checkout).resolve()
    if not (root / "megatron" / "training" / "arguments.py").is_file():
        ap.error(f"{root}: no megatron/training/arguments.py (not a Megatron-LM checkout)")
    commit = a.commit or subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    if not commit:
        ap.error(f"{root} is not a git checkout: pass --commit")
    proc = subprocess.run([sys.executable, "-c", _DUMP], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    flags = json.loads(proc.stdout.strip().splitlines()[-1])
    doc = {"source": "NVIDIA/Megatron-LM megatron/training/arguments.py (add_megatron_arguments)",
           "commit": commit, "flags": dict(sorted(flags.items()))}
    text = "{\n" + ",\n".join(
        [f'"source": {json.dumps(doc["source"])}', f'"commit": "{commit}"', '"flags": {\n' + ",\n".join(
            f"{json.dumps(k)}: {json.dumps(v)}" for k, v in doc["flags"].items()) + "\n}"]) + "\n}\n"
    Path(a.output).write_text(text)
    print(f"{a.output}: {len(flags)} destinations from Megatron-LM {commit[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
