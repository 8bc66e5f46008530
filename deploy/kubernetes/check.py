"""Check the Kubernetes manifests as `kubectl apply -k` would see them: `make k8s-check`.

Renders every overlay (and the cpu overlay with components/external-redis, and with
components/https-egress) with kustomize (the one in kubectl), validates what comes out against the Kubernetes API schemas of KUBERNETES_VERSIONS
(kubernetes-validate, strict: an unknown field is an error), and runs checkov's Kubernetes checks on
the kustomizations. A check may be skipped only by a `checkov.io/skipN` annotation on the resource,
with its reason; any failed check fails. Stand-alone checkov has no severities, so none is waived.

It runs on a copy of the folder, with a keys.env made of dummy values from keys.env.example: the
Secret is rendered as a user's would be, and a real keys.env is never read. The tools come from the
Python environment that runs this script (make installs them into .tools-venv from
check-tools.lock).

    .tools-venv/bin/python deploy/kubernetes/check.py [FOLDER]   # default: this script's folder
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The oldest release the manifests promise to work on, and the newest that kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
OVERLAYS = ("overlays/cpu", "overlays/gpu", "overlays/cpu-external-redis", "overlays/cpu-https-egress")
# The cpu overlay with each component, as docs/kubernetes.md has a user write it.
COMPONENT_OVERLAY = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [../cpu]
components: [../../components/{}]
"""


def tool(name: str) -> str:
    """An executable of the environment running this script (.tools-venv/bin), else of PATH."""
    path = Path(sys.executable).parent / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        sys.exit(f"{name} is not installed: `make k8s-tools` installs the checkers into .tools-venv")
    return found


def prepare(source: Path, work: Path) -> Path:
    """A copy of `source` with dummy keys and an overlay for each component; the copy's root."""
    root = work / "kubernetes"
    shutil.copytree(source, root, ignore=shutil.ignore_patterns("keys.env", "__pycache__", "*.py"))
    names = [line.split("=", 1)[0] for line in (root / "base" / "keys.env.example").read_text().splitlines()]
    dummy = [f"{name}={'0123456789abcdef' * 2}" for name in names if name and not name.startswith("#")]
    dummy.append("BERT_BROKER_URL=redis://:0123456789abcdef@redis.example.com:6379/0")
    (root / "base" / "keys.env").write_text("\n".join(dummy) + "\n")
    for component in ("external-redis", "https-egress"):
        (root / "overlays" / f"cpu-{component}").mkdir()
        (root / "overlays" / f"cpu-{component}" / "kustomization.yaml").write_text(COMPONENT_OVERLAY.format(component))
    return root


def render(root: Path, out: Path) -> tuple[list[Path], list[str]]:
    """Each overlay rendered to a file in `out`; (the files, the errors)."""
    files, errors = [], []
    for overlay in OVERLAYS:
        proc = subprocess.run([tool("kubectl"), "kustomize", str(root / overlay)], capture_output=True, text=True)
        if proc.returncode != 0:
            errors.append(f"kustomize {overlay}: {proc.stderr.strip()}")
            continue
        path = out / (overlay.replace("/", "_") + ".yaml")
        path.write_text(proc.stdout)
        files.append(path)
    return files, errors


def validate(files: list[Path]) -> list[str]:
    """kubernetes-validate's complaints about the rendered files, for every version."""
    errors = []
    for version in KUBERNETES_VERSIONS:
        cmd = [tool("kubernetes-validate"), "--strict", "--quiet", "-k", version, *map(str, files)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            errors.append(f"kubernetes-validate {version}:\n{proc.stdout.strip()}\n{proc.stderr.strip()}".strip())
    return errors


def checkov(root: Path) -> tuple[dict, list[str]]:
    """checkov's kustomize framework on `root`: (its summary, the failures)."""
    env = {**os.environ, "PATH": f"{Path(tool('kubectl')).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = [tool("checkov"), "-d", str(root), "--framework", "kustomize", "--skip-download", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    try:
        report = json.loads(proc.stdout)
        summary, results = report["summary"], report["results"]
    except (ValueError, KeyError, TypeError):
        return {}, [f"checkov gave no report (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"]
    errors = [
        f"checkov {c['check_id']} ({c['check_name']}): {c['resource']} in {c['file_path']}"
        for c in results["failed_checks"]
    ]
    if summary["parsing_errors"]:
        errors.append(f"checkov could not parse {summary['parsing_errors']} file(s)")
    # checkov leaves out a kustomization that kustomize cannot build: each overlay must have results.
    checked = {c["file_path"] for kind in ("passed_checks", "failed_checks", "skipped_checks") for c in results[kind]}
    errors += [f"checkov checked nothing of {o}" for o in OVERLAYS if f"/{o}/kustomization.yaml" not in checked]
    return summary, errors


def check(source: Path) -> int:
    with tempfile.TemporaryDirectory(prefix="k8s-check-") as work:
        root = prepare(source, Path(work))
        files, errors = render(root, Path(work))
        errors += validate(files)
        summary, failures = checkov(root)
        errors += failures
    versions = ", ".join(KUBERNETES_VERSIONS)
    print(f"rendered {len(files)} of {len(OVERLAYS)} overlays; schemas of Kubernetes {versions}")
    if summary:
        print(
            f"checkov {summary['checkov_version']}: {summary['passed']} passed, {summary['failed']} failed, "
            f"{summary['skipped']} skipped (each by an annotation with its reason)"
        )
    for error in errors:
        print(error, file=sys.stderr)
    return 1 if errors else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, default=HERE, help="the manifests (default: %(default)s)")
    sys.exit(check(parser.parse_args().folder))


if __name__ == "__main__":
    main()
