"""Install paths (docs/install.md) checked without a GPU or a container.

1. Into an environment that already has torch and Transformer Engine (an NGC PyTorch container): pip resolves
   ``pip install --no-build-isolation ".[gpu]"`` (``--dry-run --report``) and plans to install neither torch nor
   any Transformer Engine distribution (``transformer_engine``, ``transformer-engine-torch``, ``-cu12``, ...).
   The environments: this interpreter's as it is (``"."`` only: it has no TE, which the extra would add);
   and, to model a container, the same with fake ``*.dist-info`` directories put first on ``PYTHONPATH``
   that shadow the real ones (``pip list`` shows them):
   NGC's torch ``2.9.0a0+50eac811a6.nv25.09`` (a pre-release with a local version) with NGC's source-built
   ``transformer_engine 2.8.0+40c69e75`` (one distribution, no ``[pytorch]`` extra), with and without NGC's
   pip constraint file (``PIP_CONSTRAINT``) pinning both; and this torch with TE as PyPI's wheels install it (the
   ``transformer_engine`` metapackage, ``transformer_engine_torch``, ``transformer_engine_cu12``). A control
   asks for a TE newer than the fake one and must see pip plan to replace it: the fakes are what pip inspects,
   the package index answered, and the check can fail. pip runs without this machine's pip configuration.
   These tests need the package index (PyPI; CI has it) and fail, rather than pass, without it: offline, pip
   would keep the installed versions for want of others.
2. The wheel (``pip wheel --no-deps`` of a copy of the source) carries every tracked file of the package: the
   code, the shipped recipes (megatron_md/examples), the corpus (megatron_md/corpus) and the READMEs. Installed
   with ``pip install --no-deps --target T`` (its dependencies come from this interpreter's environment), from
   a directory outside the source tree with ``PYTHONPATH=T``: ``megatron_md`` imports from T, ``megatron-md
   recipes`` lists every recipe, and ``megatron-md demo --config examples/tiny_moe_cpu_demo.yaml
   --train-iters 2 --device cpu`` trains (2 gloo ranks, which run T's code) and writes metrics.jsonl.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

NGC_TORCH = "2.9.0a0+50eac811a6.nv25.09"  # how an NGC PyTorch container's torch versions itself
NGC_TE = "2.8.0+40c69e75"                  # TE built from source: the git hash as a local version
KEEP_PIP_ENV = {"PIP_INDEX_URL", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_TRUSTED_HOST", "PIP_PROXY",
                "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES"}  # how to reach an index; every other PIP_* is dropped


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def is_torch_or_te(name: str) -> bool:
    n = normalize(name)
    return n == "torch" or n.startswith("transformer-engine")


def pip_env(site: Path | None = None, constraint: Path | None = None) -> dict:
    """The environment for pip: no pip configuration of this machine, ``site`` first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in KEEP_PIP_ENV}
    env.pop("PYTHONPATH", None)
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    if site is not None:
        env["PYTHONPATH"] = str(site)
    if constraint is not None:
        env["PIP_CONSTRAINT"] = str(constraint)
    return env


def build_isolation() -> list[str]:
    """Build the project with this environment's setuptools when it has one (fast, offline); else isolated."""
    return ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []


def pip(args: list[str], env: dict, cwd: Path, what: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{what}: pip {' '.join(args)} exited {proc.returncode} (it needs the package index, PyPI, to "
            f"resolve)\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def copy_source(dst: Path) -> Path:
    """What a build reads: the top-level files (pyproject.toml, README.md, ...) and the package."""
    dst.mkdir(parents=True)
    for p in REPO.iterdir():
        if p.is_file() and not p.is_symlink():
            shutil.copy2(p, dst / p.name)
    shutil.copytree(REPO / "megatron_md", dst / "megatron_md",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return dst


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return copy_source(tmp_path_factory.mktemp("install") / "src")


# ----------------------------------------------------------------------------- 1. an environment with torch


@pytest.fixture(scope="module")
def index_reachable() -> str:
    """The package index pip would use, reachable; else fail (offline, pip keeps what is installed)."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        with urllib.request.urlopen(f"{index}/transformer-engine/", timeout=30) as r:
            r.read(1)
    except OSError as e:
        pytest.fail(f"the package index {index} is unreachable ({e}): these tests resolve installs against it "
                    "(PyPI; CI has it), and without it they would prove nothing", pytrace=False)
    return index


def fake_dist(site: Path, name: str, version: str, requires=(), extras: dict | None = None) -> None:
    """A minimal installed distribution: what pip reads of one (METADATA, INSTALLER, RECORD)."""
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    for extra, reqs in (extras or {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {r}; extra == "{extra}"' for r in reqs]
    (d / "METADATA").write_text("\n".join(lines) + "\n")
    (d / "INSTALLER").write_text("pip\n")
    (d / "RECORD").write_text("")


def ngc_site(site: Path) -> Path:
    """An NGC PyTorch container's torch and TE (and the packages TE requires, which the container has)."""
    fake_dist(site, "torch", NGC_TORCH, ["filelock", "typing-extensions>=4.10.0", "sympy>=1.13.3", "networkx",
                                         "jinja2", "fsspec"])
    # TE's setup.py for a source build (not NVTE_RELEASE_BUILD): one distribution, extras {"test"} only.
    fake_dist(site, "transformer_engine", NGC_TE,
              ["pydantic", "importlib-metadata>=1.0", "packaging", "torch>=2.1", "einops", "onnxscript", "onnx"],
              {"test": ["pytest>=8.2.1", "numpy", "torchvision", "transformers"]})
    for name, version in (("einops", "0.8.1"), ("onnx", "1.18.0"), ("onnxscript", "0.3.1"),
                          ("importlib_metadata", "8.7.0")):
        fake_dist(site, name, version)
    return site


def pypi_te_site(site: Path) -> Path:
    """TE as `pip install --no-build-isolation transformer_engine[pytorch]==2.8.0` leaves it (this torch kept)."""
    fake_dist(site, "transformer_engine", "2.8.0", ["transformer_engine_cu12==2.8.0"],
              {"pytorch": ["transformer_engine_torch==2.8.0"], "jax": ["transformer_engine_jax==2.8.0"]})
    fake_dist(site, "transformer_engine_torch", "2.8.0", ["torch>=2.1", "transformer_engine_cu12==2.8.0"])
    fake_dist(site, "transformer_engine_cu12", "2.8.0", ["pydantic", "packaging"])
    return site


def installed(env: dict, cwd: Path) -> dict[str, str]:
    out = pip(["list", "--format=json"], env, cwd, "pip list").stdout
    return {normalize(d["name"]): d["version"] for d in json.loads(out)}


def dry_run(spec: str, env: dict, cwd: Path, report: Path, *extra: str) -> dict[str, dict]:
    """What ``pip install <spec>`` would install: normalized name -> the report's entry."""
    pip(["install", "--dry-run", "--report", str(report), *build_isolation(), *extra, spec], env, cwd,
        f"resolving {spec}")
    entries = json.loads(report.read_text())["install"]
    return {normalize(e["metadata"]["name"]): e for e in entries}


def assert_keeps_torch_and_te(plan: dict[str, dict]) -> None:
    assert "megatron-md" in plan, f"the report does not install the project: {sorted(plan)}"
    moved = {n: e["metadata"]["version"] for n, e in plan.items() if is_torch_or_te(n)}
    assert not moved, f"pip would install {moved} over the environment's torch / Transformer Engine"


def test_this_environment_keeps_its_torch(source, tmp_path, index_reachable):
    assert_keeps_torch_and_te(dry_run(".", pip_env(), source, tmp_path / "report.json"))


@pytest.mark.parametrize("constrained", [False, True], ids=["plain", "ngc-constraint"])
def test_ngc_container_keeps_torch_and_te(source, tmp_path, index_reachable, constrained):
    from packaging.version import Version

    site = ngc_site(tmp_path / "site")
    constraint = None
    if constrained:  # NGC images since 25.03 pin every package they ship in /etc/pip/constraint.txt
        constraint = tmp_path / "constraint.txt"
        constraint.write_text(f"torch=={NGC_TORCH}\ntransformer_engine=={NGC_TE}\n")
    env = pip_env(site, constraint)
    seen = installed(env, source)
    assert Version(seen["torch"]) == Version(NGC_TORCH), f"pip does not see the fake torch: {seen.get('torch')}"
    assert Version(seen["transformer-engine"]) == Version(NGC_TE), "pip does not see the fake TE"
    assert_keeps_torch_and_te(dry_run(".[gpu]", env, source, tmp_path / "report.json"))


def test_pypi_te_wheels_stay(source, tmp_path, index_reachable):
    env = pip_env(pypi_te_site(tmp_path / "site"))
    seen = installed(env, source)
    assert {"transformer-engine", "transformer-engine-torch", "transformer-engine-cu12"} <= set(seen)
    assert_keeps_torch_and_te(dry_run(".[gpu]", env, source, tmp_path / "report.json"))


def test_control_a_newer_te_would_replace_the_containers(source, tmp_path, index_reachable):
    """The check can fail: a requirement the fake TE does not meet makes pip plan PyPI's over it."""
    env = pip_env(ngc_site(tmp_path / "site"))
    plan = dry_run("transformer-engine>=2.9", env, source, tmp_path / "report.json", "--no-deps")
    assert "transformer-engine" in plan, f"pip planned {sorted(plan)}, not a newer transformer-engine"
    assert plan["transformer-engine"]["download_info"]["url"].startswith(("http://", "https://"))


# ----------------------------------------------------------------------------- 2. the wheel


def package_files() -> list[str]:
    """The package's tracked files (every file under megatron_md/ outside a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "megatron_md"], cwd=REPO, capture_output=True,
                             check=True).stdout.decode()
        files = [p for p in out.split("\0") if p and (REPO / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:
        files = [p.relative_to(REPO).as_posix() for p in (REPO / "megatron_md").rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return sorted(files)


@pytest.mark.multirank
def test_wheel_carries_the_package_data_and_runs_the_demo(source, tmp_path):
    from megatron_md.corpus import CORPUS_PATH, LICENSE_PATH
    from megatron_md.training.config import EXAMPLES_DIR

    env = pip_env()
    wheels = tmp_path / "wheels"
    pip(["wheel", "--no-deps", *build_isolation(), "-w", str(wheels), str(source)], env, tmp_path, "pip wheel")
    (whl,) = wheels.glob("megatron_md-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())

    # What the package reads at runtime, relative to its own files: the recipes and the corpus.
    pkg = REPO / "megatron_md"
    recipes = sorted(p.relative_to(REPO).as_posix() for p in EXAMPLES_DIR.rglob("*.yaml"))
    assert recipes and EXAMPLES_DIR.resolve() == (pkg / "examples").resolve()
    data = [p.resolve().relative_to(REPO).as_posix() for p in (CORPUS_PATH, LICENSE_PATH)]
    missing = [p for p in (*recipes, *data, *package_files()) if p not in names]
    assert not missing, f"the wheel lacks {missing}"

    target, cwd = tmp_path / "T", tmp_path / "cwd"
    pip(["install", "--no-deps", "--no-index", "--target", str(target), str(whl)], env, tmp_path, "pip install")
    cwd.mkdir()
    run_env = dict(os.environ, PYTHONPATH=str(target), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   WANDB_SILENT="true")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        run_env.pop(k, None)

    def run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), cwd=cwd, env=run_env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, (f"{' '.join(args)} exited {proc.returncode}\n--- stdout\n"
                                      f"{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
        return proc

    where = run(sys.executable, "-c", "import megatron_md; print(megatron_md.__file__)").stdout.strip()
    assert Path(where).resolve().is_relative_to(target.resolve()), f"megatron_md imported from {where}, not T"

    cli = str(target / "bin" / "megatron-md")
    listed = run(cli, "recipes").stdout
    unlisted = [r for r in recipes if "examples/" + r.split("megatron_md/examples/", 1)[1] not in listed]
    assert not unlisted, f"megatron-md recipes does not list {unlisted}"

    # No examples/ here: --config examples/... is the shipped recipe.
    demo = run(cli, "demo", "--work-dir", "wd", "--config", "examples/tiny_moe_cpu_demo.yaml", "--train-iters", "2",
               "--device", "cpu", timeout=600)
    assert "too few to judge" in demo.stdout, demo.stdout[-3000:]
    (run_dir,) = (cwd / "wd").glob("run-*")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in recs if r.get("lm_loss") is not None] == [2]
    assert any("eval_lm_loss" in r for r in recs)
    ranks_ran = json.loads((run_dir / "host.json").read_text())["argv"][0]
    assert Path(ranks_ran).resolve().is_relative_to(target.resolve()), f"the ranks ran {ranks_ran}"
