"""docs/planning.md block ``plan``: ``megatron-md plan --json`` of the MD paper recipes on the target they
state (one node of 8 x H100-80GB), stored and rendered.

    python tools/plan_tables.py --generate                # run the plans, write benchmarks/results/plan_8xh100.json
    python tools/render_readme_tables.py --block plan     # splice the table into docs/planning.md (render_plan)

Rendering is standard library only (render_readme_tables.py imports no torch); ``--generate`` runs the CLI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULT = Path("benchmarks") / "results" / "plan_8xh100.json"

# name -> the plan's arguments: the paper recipes as they stand, on the target their `target:` section states
# (8 x H100-80GB, Transformer Engine's flash attention), and dense-1.29b without Transformer Engine: with torch's
# SDPA (the local spec's default) and with megatron-core's unfused attention, where only full recomputation fits.
_DENSE = ["--config", "examples/md_paper/dense-1.29b_muon_md.yaml"]
_LOCAL = [*_DENSE, "--transformer-impl", "local", "--attention-backend", "local"]
PLANS = {
    "dense-1.29b": _DENSE,
    "dense-1.29b, full recompute": [*_DENSE, "--recompute-granularity", "full"],
    "dense-1.29b, no TE": [*_DENSE, "--transformer-impl", "local"],
    "dense-1.29b, no TE, local attention": _LOCAL,
    "dense-1.29b, no TE, local attention, full recompute": [*_LOCAL, "--recompute-granularity", "full"],
    "moe-6.7b": ["--config", "examples/md_paper/moe-6.7b_muon_md.yaml"],
}
COMMON: list[str] = []  # the device and world size come from each recipe's target section


def generate(repo: Path) -> dict:
    out = {"command": " ".join(["megatron-md plan", *COMMON, "--json"]), "plans": {}}
    for name, args in PLANS.items():
        proc = subprocess.run([sys.executable, "-m", "megatron_md.cli", "plan", *args, *COMMON, "--json"],
                              cwd=repo, capture_output=True, text=True, check=True)
        out["plans"][name] = {"args": args, "plan": json.loads(proc.stdout)}
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f}"


def plan_markdown(result: dict) -> str:
    rows = result["plans"]
    names = list(rows)
    head = "| per device (GiB) | " + " | ".join(f"`{n}`" for n in names) + " |"
    lines = [head, "|---|" + "---:|" * len(names)]

    def row(label: str, get) -> None:
        lines.append(f"| {label} | " + " | ".join(get(rows[n]["plan"]) for n in names) + " |")

    def lay(p: dict) -> str:
        la = p["layout"]
        ep = f" EP{la['ep']}" if la["ep"] > 1 else ""
        return (f"TP{la['tp']} PP{la['pp']} DP{la['dp']}{ep}, micro {la['micro_batch']} x {la['seq_length']}, "
                f"global {la['global_batch']}")

    dev = lambda k: (lambda p: _gib(p["per_device"][k]))  # noqa: E731
    row("layout", lay)
    row("attention kernel", lambda p: p["attention"]["kernel"])
    row("parameters (bf16)", dev("params"))
    row("gradients (fp32 buffers)", dev("grads"))
    row("fp32 master weights", dev("master_weights"))
    for kind in ("adam_moments", "muon_momentum", "md_gains", "manifold_duals", "soap_factors"):
        if any(rows[n]["plan"]["per_device"]["optimizer_state_by_kind"].get(kind) for n in names):
            row(f"optimizer: {kind.replace('_', ' ')}",
                lambda p, k=kind: _gib(p["per_device"]["optimizer_state_by_kind"].get(k, 0)))
    row("activations (configured recompute)",
        lambda p: f"{_gib(p['per_device']['activations'][p['per_device']['recompute']])} "
                  f"({p['per_device']['recompute']})")
    row("**total**", lambda p: f"**{_gib(p['per_device']['total'][p['per_device']['recompute']])}**")
    dev0 = rows[names[0]]["plan"]

    def spare(p: dict) -> str:
        mode = p["per_device"]["recompute"]
        if p["spare"][mode] < 0:
            return f"{_gib(-p['spare'][mode])} over"
        return f"{_gib(p['spare'][mode])} ({p['spare_fraction'][mode]:.1%})"

    row(f"spare of {dev0['device']['name']}'s {_gib(dev0['device_memory'])} GiB", spare)
    row(f"fits, {dev0['headroom']:.0%} spare", lambda p: "yes" if p["fits"][p["per_device"]["recompute"]] else "**no**")
    row("model TFLOP per step", lambda p: f"{p['flops_per_step']['model'] / 1e12:,.0f}")
    row("Newton–Schulz TFLOP per step", lambda p: f"{p['flops_per_step']['optimizer_newton_schulz'] / 1e12:,.1f}")
    row("sent per device per step (GiB)", lambda p: _gib(p["communication_per_device"]["total"]))
    cmds = "; ".join(f"`{n}`: `{' '.join(rows[n]['args'])}`" for n in names)
    target = f"{dev0['layout']['world']} x {dev0['device']['name']}"
    return "\n".join(lines + ["", f"From `{result['command']}` on each recipe's stated target ({target}) with {cmds} "
                              f"(`{RESULT.as_posix()}`, written by `python tools/plan_tables.py --generate`)."])


def render_plan(repo: Path) -> str:
    path = repo / RESULT
    if not path.exists():
        return "_No plan stored yet: run `python tools/plan_tables.py --generate`._"
    return plan_markdown(json.loads(path.read_text()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generate", action="store_true", help=f"run the plans and write {RESULT}")
    args = ap.parse_args(argv)
    if args.generate:
        (REPO / RESULT).write_text(json.dumps(generate(REPO), indent=1) + "\n")
        print(f"wrote {RESULT}")
    print(render_plan(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
