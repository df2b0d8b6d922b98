"""Rewrite the generated blocks of README.md and docs/*.md from the stored results.

Each generated block sits between two marker lines, in whichever of README.md and docs/*.md holds it
(each block in exactly one of them; the tool finds it there and rewrites that page)::

    <!-- BEGIN optimizer_step -->
    ...generated, do not edit by hand...
    <!-- END optimizer_step -->

``optimizer_step`` and ``optimizer_state``: every ``benchmarks/results/*.json`` written by
``benchmarks/optimizer_step.py`` / ``benchmarks/optimizer_state.py`` (sorted by file name), one table each
(tables in ``tools/benchmark_tables.py``, as is ``gpu_bench``'s).
``ns_engine``: ``benchmarks/results/ns_engine_cpu.json`` from ``benchmarks/ns_engine.py`` (tables in
``tools/ns_engine_tables.py``). ``step_counts``: ``benchmarks/results/step_counts_cpu.json`` from
``benchmarks/step_counts.py`` beside its baseline ``step_counts_cpu_baseline.json`` (tables in
``tools/step_counts_tables.py``). ``gpu_bench``: ``benchmarks/results/gpu_bench_h200.json`` from
``benchmarks/gpu_bench.py`` (``tools/gpu_bench.sh``), or a line saying it has not been run. ``plan``:
``benchmarks/results/plan_8xh100.json`` from ``tools/plan_tables.py --generate`` (``megatron-md plan --json``).
``max_logit_cost``: ``benchmarks/results/max_logit_cost_cpu.json`` from ``benchmarks/max_logit_cost.py``.
``test_profile``: the suite's per-test times before and after it was made faster
(``benchmarks/results/test_profile_{before,after}.json`` from ``tools/test_profile.py``); ``launch_cost``:
``benchmarks/results/launch_cost_cpu.json`` from ``benchmarks/launch_cost.py`` (tables in ``tools/test_profile.py``).
``loader``: ``benchmarks/results/loader_cpu.json`` from ``benchmarks/loader.py`` (the input pipeline).
``megatron_compat``: docs/usage.md's Megatron-LM flag tables (``megatron_md/training/megatron_compat.py``).
``records_*``: the judged ``records/<date>-<kind>/`` of each kind, summarised and judged by
``megatron_md.sweep.records`` (``qk-clip``: ``megatron_md.sweep.qk_clip_records``) from their CSVs and cells'
metrics.jsonl. Links in a block are written from the repository root and made relative to the page it lands in
(``../records/...`` in docs/).
No torch import (standard library, and PyYAML for the ``megatron_compat`` block's config fields).

Each ``records/<date>-<kind>/README.md`` with a ``record_summary`` block gets that record's table, and
its ``record_claims`` block the claims it is judged on (the judged records only).

    python tools/render_readme_tables.py            # rewrite the pages (and the records' READMEs) in place
    python tools/render_readme_tables.py --check    # exit 1 if any of them is out of date, 2 if a block is
                                                    # missing, duplicated or unknown
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_tables import (  # noqa: E402,F401  (re-exported)
    GPU_BENCH_RESULT, gpu_bench_markdown, optimizer_state_markdown, optimizer_step_markdown, render_gpu_bench,
    render_loader, render_max_logit_cost, render_optimizer_state, render_optimizer_step,
)
from ns_engine_tables import ns_engine_markdown, render_ns_engine  # noqa: E402,F401  (re-exported)
from plan_tables import render_plan  # noqa: E402
from step_counts_tables import render_step_counts, step_counts_markdown  # noqa: E402,F401  (re-exported)
from test_profile import render_launch_cost, render_test_profile  # noqa: E402

def render_megatron_compat(repo: Path) -> str:
    """docs/usage.md's Megatron-LM tables, from megatron_md/training/megatron_compat.py and the flag snapshot."""
    sys.path.insert(0, str(repo))
    from megatron_md.training import config as C
    from megatron_md.training import megatron_compat as mc

    return mc.markdown(len(mc.shared_defaults(C.FIELDS, C.flag)[0]) - len(mc.DIFFERS))


BEGIN = "<!-- BEGIN {name} -->"
END = "<!-- END {name} -->"


# ----------------------------------------------------------------------------- records (CPU experiments)

GEOMETRY = {  # preset -> (attention, MLP), the presets' table in docs/optimizers.md
    "unconstrained": ("Muon + WD", "Muon + WD"), "all-stiefel": ("Stiefel", "Stiefel"),
    "all-dgram": ("DGram", "DGram"), "hetero": ("Stiefel", "DGram"), "hetero-inv": ("DGram", "Stiefel"),
    "hetero-md": ("Stiefel", "MD sphere + gains"),
}
ABLATION_FLAGS = {"rowcol": "(defaults: --md-gains rowcol --md-gain-param softplus, no warmup)",
                  "row": "--md-gains row", "col": "--md-gains col", "none": "--md-gains none (Muon + sphere)",
                  "direct": "--md-gain-param direct", "warmup-10pct": "--warmups 10%",
                  "paper-lrs": "--lr 1e-3 --embedding-lr 3e-3 (the paper's fixed LRs)",
                  "flat": "--md-gains flat (one scalar per matrix)", "offset": "--md-gain-param offset",
                  "wd-0.1": "--weight-decays 0.1", "lion": "--optimizer lion_md (Lion base update)",
                  "adam": "--optimizer adam_md (Adam base update)",
                  "adam-hs-u": "--optimizer adam_md --md-normalize-update (the authors' --hs-u)"}


def _records():
    sys.path.insert(0, str(REPO))
    from megatron_md.sweep import records

    return records


def _loss(b) -> str:
    import math

    if not math.isfinite(b.mean):
        return "diverged"
    return f"{b.mean:.4f} ± {b.std:.4f}" if math.isfinite(b.std) else f"{b.mean:.4f}"


def _no_record(kind: str) -> str:
    return f"_No `records/*-{kind}` yet._"


def render_lr_transfer(repo: Path, rec: Path | None = None) -> str:
    R = _records()
    rec = rec or R.latest(repo, "lr-transfer")
    if rec is None:
        return _no_record("lr-transfer")
    best = R.lr_transfer(rec)
    widths = sorted({w for per in best.values() for w in per})
    rel = rec.relative_to(repo)
    any_b = next(iter(next(iter(best.values())).values()))
    lines = [f"Best LR per width (swept LR `1e-3·2^(k/2)`; final {any_b.kind} loss, mean ± std over seeds at that LR; "
             f"† = optimum on the grid's edge). From `{rel}/results.csv`; plot `{rel}/lr_transfer.png`.", "",
             "| optimizer | warmup, wd | " + " | ".join(f"width {w}" for w in widths) + " |",
             "|---|---|" + "---|" * len(widths)]
    for opt in ("adamw", "muon", "muon_md", *sorted(set(best) - {"adamw", "muon", "muon_md"})):
        if opt not in best:
            continue
        per = best[opt]
        first = next(iter(per.values()))
        cells = [_best_cell(per.get(w)) for w in widths]
        lines.append(f"| `{opt}` | {first.warmup}, {first.weight_decay:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _best_cell(b) -> str:
    if b is None:
        return "–"
    if b.lr is None:
        return "all diverged"
    return f"k={b.k:g} ({b.lr:.3g}){'' if b.inside else ' †'}: {_loss(b)} (n={b.n})"


def render_moe_lr_transfer(repo: Path, rec: Path | None = None) -> str:
    """The MoE record: its width table as the dense one's, the expert-count axis, the diagnostics reruns."""
    R = _records()
    from megatron_md.sweep import moe_records as M

    rec = rec or R.latest(repo, "moe-lr-transfer")
    if rec is None:
        running = sorted(p for p in (Path(repo) / "records").glob("*-moe-lr-transfer") if R.in_progress(p))
        return (f"_`{running[-1].relative_to(repo).as_posix()}` is in progress: [its README]"
                f"({running[-1].relative_to(repo).as_posix()}/README.md) has the cells so far._"
                if running else _no_record("moe-lr-transfer"))
    parts = [render_lr_transfer(repo, rec)]
    probe = rec / "checks" / "probe" / "results.csv"
    if probe.exists():  # the regime check, with more seeds than the record at its widths' optima
        from megatron_md.sweep.curvature import curvature, curvature_markdown
        from megatron_md.sweep.results import read_csv

        rows = read_csv(probe)
        parts.append(f"The probe: rise of the final eval loss one factor 2 in LR either side of each curve's optimum, "
                     f"in standard errors over up to {len({r['seed'] for r in rows})} seeds (unpaired; paired: of "
                     f"the per-seed differences). From `{probe.relative_to(repo).as_posix()}`.\n\n"
                     + curvature_markdown(curvature(rows)))
    axis = M.expert_axis(rec)
    if axis:
        counts = sorted({n for per in axis.values() for n in per})
        rel = rec.relative_to(repo).as_posix()
        load = M.expert_load(rec)
        lines = [f"Best LR per number of experts (top-2, one width; the same ladder and loss), and at that LR the "
                 f"expert load (busiest/idlest expert over the mean, averaged over the logged steps and seeds). From "
                 f"`{rel}/experts/*/results.csv`; plot `{rel}/experts.png`.", "",
                 "| optimizer | " + " | ".join(f"{n} experts" for n in counts) + " |", "|---|" + "---|" * len(counts)]

        def cell(opt: str, n: int) -> str:
            hi_lo = load.get(opt, {}).get(n)
            return _best_cell(axis[opt].get(n)) + (f"; load {hi_lo[0]:.2f}/{hi_lo[1]:.2f}" if hi_lo else "")
        for opt in sorted(axis):
            lines.append(f"| `{opt}` | " + " | ".join(cell(opt, n) for n in counts) + " |")
        parts.append("\n".join(lines))
    diag = M.diagnostics(rec, R.latest(repo, "lr-transfer"))
    if diag:
        lines = ["Diagnostics reruns at each width's best LR (seed 1): mean relative update per step "
                 "‖ΔW‖_F/‖W‖_F of each group's matrices after the warmup, mean expert load (busiest and idlest "
                 "expert over the mean), and the rerun's final eval loss: (=) when equal to its cell's to every digit, else "
                 "the cell's minus the rerun's.",
                 "", "| model | optimizer | width | k | attention | dense MLP | experts | router | expert load "
                 "max/min | final eval loss |", "|---|---|---|---|---|---|---|---|---|---|"]
        for d in diag:
            upd = [f"{d.rel_update[g]:.2e}" if g in d.rel_update else "–" for g in M.GROUPS]
            load = f"{d.load_max:.2f}/{d.load_min:.2f}" if d.load_max is not None else "–"
            same = {True: " (=)", None: ""}.get(d.reproduces, f" (cell {d.cell_eval_loss - d.final_eval_loss:+.1e})")
            loss = f"{d.final_eval_loss:.4f}{same}" if d.final_eval_loss is not None else "–"
            lines.append(f"| {d.family} | `{d.optimizer}` | {d.width} | {d.k:g} | " + " | ".join(upd)
                         + f" | {load} | {loss} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def render_md_ablations(repo: Path, rec: Path | None = None) -> str:
    R = _records()
    rec = rec or R.latest(repo, "md-ablations")
    if rec is None:
        return _no_record("md-ablations")
    v = R.ablations(rec)
    rel = rec.relative_to(repo)
    base = v.get("rowcol")
    width = next(iter(v.values())).width
    lines = [f"MuonMD variants at width {width} (best matrix LR of each; mean ± std over seeds). From "
             f"`{rel}/variants/*/results.csv`; plot `{rel}/ablations.png`.", "",
             "| variant | flags | best matrix LR | final loss | minus row+col |", "|---|---|---|---|---:|"]
    for name in sorted(v, key=lambda n: (n != "rowcol", n)):
        b = v[name]
        delta = f"{b.mean - base.mean:+.4f}" if base is not None and name != "rowcol" else ""
        lr = "all diverged" if b.lr is None else f"{b.lr:.3g} (k={b.k:g}){'' if b.inside else ' †'}"
        lines.append(f"| {name} | `{ABLATION_FLAGS.get(name, '')}` | {lr} | {_loss(b)} | {delta} |")
    return "\n".join(lines)


def render_manifold(repo: Path, rec: Path | None = None) -> str:
    import math

    R = _records()
    rec = rec or R.latest(repo, "manifold-geometry")
    if rec is None:
        return _no_record("manifold-geometry")
    rel = rec.relative_to(repo)
    out = []
    for set_name in R.manifold_sets(rec):
        runs = R.manifold_runs(rec, set_name)
        best = R.manifold_best(runs)
        steps = max(r.steps for r in runs)
        lr = runs[0].lr
        out += [f"**{set_name}**: matrix LR {lr:g}, {steps} steps, {len(set(r.seed for r in runs))} seed(s) "
                f"(`{rel}/{set_name}/`). σ_max and max logit: first logged → last (peak), the largest over layers "
                "(and over the two matrices of a block), averaged over seeds.", "",
                "| preset | attention | MLP | final eval loss | attention σ_max | MLP σ_max | max attention logit "
                "| diverged or spiked |", "|---|---|---|---|---|---|---|---|"]

        def trio(rs, kind):
            vals = [(r.first.get(kind), r.last.get(kind), r.peak.get(kind)) for r in rs]
            if any(x is None for t in vals for x in t):
                return "–"
            m = [sum(t[i] for t in vals) / len(vals) for i in range(3)]
            return f"{m[0]:.2f} → {m[1]:.2f} ({m[2]:.2f})"

        for preset in R.PRESETS:
            rs = [r for r in runs if r.preset == preset]
            if not rs:
                continue
            att, mlp = GEOMETRY.get(preset, ("?", "?"))
            bad = sum(1 for r in rs if r.status != "ok" or r.spiked)
            loss = _loss(best[preset]) if math.isfinite(best[preset].mean) else "diverged"
            out.append(f"| {preset} | {att} | {mlp} | {loss} | {trio(rs, 'attn_sigma_max')} | "
                       f"{trio(rs, 'mlp_sigma_max')} | {trio(rs, 'max_logit')} | {bad}/{len(rs)} |")
        out.append("")
    return "\n".join(out) if out else _no_record("manifold-geometry")


def render_regime_probe(repo: Path, rec: Path | None = None) -> str:
    """How far each probed curve rises one grid step either side of its optimum (megatron_md/sweep/curvature.py)."""
    R = _records()
    rec = rec or R.latest(repo, "regime-probe")
    if rec is None:
        return _no_record("regime-probe")
    from megatron_md.sweep.curvature import curvature, curvature_markdown
    from megatron_md.sweep.results import read_csv

    rows = read_csv(rec / "results.csv")
    seeds = len({r["seed"] for r in rows})
    return (f"Rise of the final eval loss one grid step (a factor 2 in LR) below and above each curve's optimum, "
            f"in standard errors of the difference over seeds (unpaired; paired: of the per-seed differences); "
            f"up to {seeds} seeds. From `{rec.relative_to(repo).as_posix()}/results.csv`.\n\n"
            + curvature_markdown(curvature(rows)))


def render_qk_clip(repo: Path, rec: Path | None = None) -> str:
    R = _records()
    rec = rec or R.latest(repo, "qk-clip")
    if rec is None:
        return _no_record("qk-clip")
    from megatron_md.sweep import qk_clip_records

    return qk_clip_records.render(repo, rec)


def render_claims(repo: Path, only: Path | None = None) -> str:
    """Every claim of the judged records (records.judged), or (``only``) the claims that one record judges."""
    R = _records()
    from megatron_md.sweep import moe_records, qk_clip_records

    claims = []
    transfer = R.latest(repo, "lr-transfer")  # the ablations compare against its Muon
    judges = {"lr-transfer": R.lr_transfer_claims, "manifold-geometry": R.manifold_claims,
              "md-ablations": lambda rec, rel: R.ablation_claims(rec, rel, transfer),
              "qk-clip": lambda rec, rel: qk_clip_records.claims(rec, rel, repo), "moe-lr-transfer": moe_records.claims}
    for kind in CLAIM_KINDS:
        for rec in R.judged(repo, kind):
            if only is None or Path(only).resolve() == rec.resolve():
                claims += judges[kind](rec, str(rec.relative_to(repo)))
    if not claims:
        return "_No records yet._"
    lines = ["| claim | at this scale | evidence (loss gaps: mean difference ± 2 standard errors) | reproduce |",
             "|---|---|---|---|"]
    for c in claims:
        lines.append(f"| {c.claim} | **{c.verdict}** | {c.evidence} | `bash {c.record}/reproduce.sh` |")
    return "\n".join(lines)


def with_figures(render_table: Callable[..., str], kind: str, pattern: str, alt: str,
                 more: tuple[tuple[str, str], ...] = ()) -> Callable[[Path], str]:
    """``render_table`` followed by the record's figures matching ``pattern``, linked from the repository root
    (``render`` makes the links relative to the page; a record's own README links its figures itself), then
    those of each ``(pattern, alt)`` in ``more``, for each judged record of the kind, newest first."""
    def one(repo: Path, rec: Path | None) -> str:
        figures = sorted(rec.glob(pattern)) if rec is not None else []

        def link(f: Path) -> str:
            label = f" ({f.stem.partition('_')[2] or f.stem})" if len(figures) > 1 else ""  # spectra_lr0.1 -> lr0.1
            return f"![{alt}{label}]({f.relative_to(repo).as_posix()})"
        extra = [f"![{a}]({f.relative_to(repo).as_posix()})" for p, a in more for f in
                 (sorted(rec.glob(p)) if rec is not None else [])]  # (pattern, alt) pairs after the main figures
        return "\n\n".join([render_table(repo, rec), *map(link, figures), *extra])

    def block(repo: Path) -> str:
        recs = _records().judged(repo, kind)
        return "\n\n".join(one(repo, rec) for rec in recs) if recs else one(repo, None)
    return block


BLOCKS: dict[str, Callable[[Path], str]] = {
    "optimizer_step": render_optimizer_step,
    "optimizer_state": render_optimizer_state,
    "ns_engine": render_ns_engine,
    "step_counts": render_step_counts,
    "gpu_bench": render_gpu_bench,
    "max_logit_cost": render_max_logit_cost,
    "plan": render_plan,
    "test_profile": render_test_profile,
    "launch_cost": render_launch_cost,
    "megatron_compat": render_megatron_compat,
    "loader": render_loader,
    "records_claims": render_claims,
    "records_regime_probe": render_regime_probe,
    "records_lr_transfer": with_figures(render_lr_transfer, "lr-transfer", "lr_transfer.png",
                                        "final loss vs LR per width, optimum marked"),
    "records_moe_lr_transfer": with_figures(render_moe_lr_transfer, "moe-lr-transfer", "lr_transfer.png",
                                            "final loss vs LR per width on the MoE model, optimum marked",
                                            (("experts.png", "final loss vs LR per number of experts at width 128"),)),
    "records_md_ablations": with_figures(render_md_ablations, "md-ablations", "ablations.png",
                                         "final loss vs matrix LR per MuonMD variant"),
    "records_manifold": with_figures(render_manifold, "manifold-geometry", "spectra_*.png",
                                     "attention and MLP σ_max, max attention logit"),
    "records_qk_clip": with_figures(render_qk_clip, "qk-clip", "max_logit*.png",
                                    "max attention logit with and without QK-clip"),
}


# ----------------------------------------------------------------------------- splicing

MARKER = re.compile(r"^<!-- (BEGIN|END) ([A-Za-z0-9_]+) -->$", re.MULTILINE)  # a marker is a line of its own
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")  # [text](target) and ![alt](target)


class MarkersMissing(ValueError):
    pass


def doc_files(repo: Path) -> list[Path]:
    """The pages that may hold generated blocks: README.md and docs/*.md."""
    return [f for f in [Path(repo) / "README.md", *sorted((Path(repo) / "docs").glob("*.md"))] if f.is_file()]


def locate(files, names=None, known=None) -> dict[str, Path]:
    """Which of ``files`` holds each block of ``names`` (default: every known block). Each must appear exactly
    once across the files, as a BEGIN line followed by its END line; a marker of an unknown name is an error
    too (a typo would otherwise leave a block unrendered). Raises MarkersMissing listing every problem."""
    known = set(BLOCKS if known is None else known)
    names = list(names or known)
    seen: dict[str, list[tuple[Path, str, int]]] = {}
    for f in files:
        for m in MARKER.finditer(Path(f).read_text()):
            seen.setdefault(m[2], []).append((Path(f), m[1], m.start()))
    problems = [f"{f}: unknown block '{n}' (known: {', '.join(sorted(known))})"
                for n, hits in seen.items() if n not in known for f in sorted({h[0] for h in hits})]
    where = {}
    for name in names:
        hits = seen.get(name, [])
        begins = [h for h in hits if h[1] == "BEGIN"]
        ends = [h for h in hits if h[1] == "END"]
        begin, end = BEGIN.format(name=name), END.format(name=name)
        if not hits:
            problems.append(f"no '{begin}' ... '{end}' in {', '.join(map(str, files)) or 'no files'}: "
                            f"add the pair, each on a line of its own, where the {name} block belongs")
        elif len(begins) != 1 or len(ends) != 1 or begins[0][0] != ends[0][0] or begins[0][2] > ends[0][2]:
            places = "; ".join(f"{h[1]} in {h[0]}" for h in hits)
            problems.append(f"block '{name}' must appear exactly once, '{begin}' before '{end}' in the same "
                            f"file, across {len(files)} file(s); found: {places}")
        else:
            where[name] = begins[0][0]
    if problems:
        raise MarkersMissing("\n".join(problems))
    return where


def relink(body: str, repo: Path, page: Path) -> str:
    """``body``'s relative Markdown links, written from the repository root, made relative to ``page``'s folder
    (a block in docs/ links ../records/...). URLs, anchors and absolute paths are left alone."""
    base = Path(page).resolve().parent
    root = Path(repo).resolve()

    def fix(m: re.Match) -> str:
        target = m[2]
        if "://" in target or target.startswith(("#", "/", "mailto:")):
            return m[0]
        path, hash_, anchor = target.partition("#")
        rel = Path(os.path.relpath(root / path, base)).as_posix()
        return f"{m[1]}{rel}{hash_}{anchor}{m[3]}"
    return LINK.sub(fix, body)


def splice(text: str, name: str, body: str) -> str:
    """``text`` with the lines between the ``name`` markers replaced by ``body``."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    pattern = re.compile("^" + re.escape(begin) + r"$.*?^" + re.escape(end) + "$", re.DOTALL | re.MULTILINE)
    if len(pattern.findall(text)) != 1:
        raise MarkersMissing(
            f"expected exactly one pair of markers '{begin}' ... '{end}', each on a line of its own "
            f"(found {len(pattern.findall(text))}); add them where the {name} block belongs"
        )
    return pattern.sub(lambda _: f"{begin}\n{body.strip()}\n{end}", text, count=1)


def render(text: str, repo: Path, names=None, page: Path | None = None) -> str:
    """``text`` (the page ``page``, default ``repo``/README.md) with the blocks ``names`` (default: all)
    rendered; their links are made relative to the page."""
    page = Path(repo) / "README.md" if page is None else page
    for name in names or BLOCKS:
        text = splice(text, name, relink(BLOCKS[name](repo), repo, page))
    return text


RECORD_KINDS = {"lr-transfer": render_lr_transfer, "md-ablations": render_md_ablations,
                "manifold-geometry": render_manifold, "regime-probe": render_regime_probe,
                "qk-clip": render_qk_clip, "moe-lr-transfer": render_moe_lr_transfer}
CLAIM_KINDS = ("lr-transfer", "moe-lr-transfer", "md-ablations", "manifold-geometry", "qk-clip")  # a probe judges none


def record_kind(name: str):
    """The kind of a record directory, from the end of its name; the longest wins (None if it is none of them)."""
    return max((k for k in RECORD_KINDS if name.endswith("-" + k)), key=len, default=None)


def render_record(readme_text: str, repo: Path, rec: Path) -> str:
    """A record's own README: its ``record_summary`` (the table of that record) and ``record_claims``."""
    kind = record_kind(rec.name)
    if kind is None:
        raise MarkersMissing(f"{rec.name} does not end with one of -{', -'.join(RECORD_KINDS)}")
    page = rec / "README.md"
    readme_text = splice(readme_text, "record_summary", relink(RECORD_KINDS[kind](repo, rec), repo, page))
    if kind in CLAIM_KINDS and any(r.resolve() == rec.resolve() for r in _records().judged(repo, kind)):
        readme_text = splice(readme_text, "record_claims", relink(render_claims(repo, only=rec), repo, page))
    return readme_text


def record_readmes(repo: Path) -> list[Path]:
    """records/*/README.md that carry a record_summary block (and hold results)."""
    out = []
    for readme in sorted(Path(repo).glob("records/*/README.md")):
        kind = record_kind(readme.parent.name)
        if kind and BEGIN.format(name="record_summary") in readme.read_text() and \
                any(readme.parent.glob(_records().RESULTS_GLOB[kind])):
            out.append(readme)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Rewrite the generated blocks of README.md and docs/*.md "
                                             "(and of the records' READMEs) from benchmarks/results/ and records/.")
    ap.add_argument("--file", "--readme", dest="files", action="append", metavar="PAGE",
                    help="a Markdown page to search for blocks (repeatable; default: README.md and docs/*.md "
                         "of --repo). Every block asked for must be in exactly one of them")
    ap.add_argument("--repo", default=str(REPO), help="where benchmarks/results/ and records/ are read")
    ap.add_argument("--check", action="store_true", help="exit 1 if a page is out of date; write nothing")
    ap.add_argument("--block", action="append", choices=sorted(BLOCKS), help="only this block (repeatable)")
    args = ap.parse_args(argv)
    repo = Path(args.repo)
    pages = [Path(f) for f in args.files] if args.files else doc_files(repo)
    try:
        where = locate(pages, args.block)
    except MarkersMissing as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    jobs = []
    for page in dict.fromkeys(where.values()):  # each page once, in the order of the blocks
        names = [n for n, p in where.items() if p == page]
        jobs.append((page, lambda text, page=page, names=names: render(text, repo, names, page)))
    if not args.block:  # the records' own READMEs too
        jobs += [(r, lambda text, rec=r.parent: render_record(text, repo, rec)) for r in record_readmes(repo)]
    updates = []  # rendered in full before anything is written
    for page, fn in jobs:
        old = page.read_text()
        try:
            updates.append((page, old, fn(old)))
        except MarkersMissing as e:
            print(f"error: {page}: {e}", file=sys.stderr)
            return 2
    stale = 0
    for page, old, new in updates:
        if args.check:
            if new != old:
                diff = difflib.unified_diff(old.splitlines(), new.splitlines(), str(page), "generated", lineterm="")
                print("\n".join(diff))
                print(f"{page} is out of date: run python tools/render_readme_tables.py", file=sys.stderr)
                stale += 1
            else:
                print(f"{page} is up to date")
        elif new != old:
            page.write_text(new)
            print(f"rewrote {page}")
        else:
            print(f"{page} already up to date")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
