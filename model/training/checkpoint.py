"""Training checkpoints: everything needed to continue a run exactly, written crash-safely.

A checkpoint is `<run_dir>/checkpoints/step-<N>/`, itself a normal model directory plus training state:

    config.json, model.safetensors     the model, as `save_pretrained` writes it (loads with from_pretrained)
    vocab.txt, tokenizer.json, ...     the tokenizer, when the trainer has one
    optimizer.safetensors              optimizer state tensors, keyed "<param index>.<name>"
    rng.safetensors                    torch CPU (and CUDA) generator states, numpy's MT19937 key
    state.json                         optimizer hyper-parameters, scheduler state, python/numpy RNG
                                       scalars, data position (epoch, batch) and trainer state (step, best)
    COMPLETE                           manifest (every file and its size), written last

Nothing is pickled: tensors go through safetensors, the rest is JSON. The directory is written with
`datadir.files.atomic_dir` (temp dir, fsync, rename) and COMPLETE is the last file in the temp dir, so a
crash at any point leaves either a complete checkpoint or a hidden `.tmp-*` directory that
`latest_checkpoint` never returns. Pruned checkpoints (`CheckpointRotation` keeps the newest few and
the best) are renamed to a `.tmp-` name before deletion for the same reason.

References: HF transformers Trainer's checkpoint layout (optimizer/scheduler/rng files, rotation
keeping the best), PyTorch's "Saving and loading a general checkpoint" recipe.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from datadir.files import TMP_PREFIX, atomic_dir
from datadir.jobs import CHECKPOINTS

COMPLETE = "COMPLETE"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------------------- finding checkpoints


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step}"


def is_complete(path: str | Path) -> bool:
    """True when `path` holds a COMPLETE manifest whose files all exist with the recorded sizes."""
    path = Path(path)
    try:
        manifest = json.loads((path / COMPLETE).read_text())
        return all((path / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp dirs and unfinished ones are skipped)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and is_complete(child):
            found.append((int(m.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_step(path: str | Path) -> int:
    m = _STEP_DIR.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a step-N checkpoint directory")
    return int(m.group(1))


def read_state(path: str | Path) -> dict[str, Any]:
    """The JSON part of a checkpoint (trainer, data, scheduler state): cheap, loads no tensors."""
    return json.loads((Path(path) / "state.json").read_text())


def remove_stale_temp_dirs(run_dir: str | Path) -> None:
    """Delete `.tmp-*` leftovers of writes that a crash interrupted (only at the start of a run)."""
    root = Path(run_dir) / CHECKPOINTS
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(TMP_PREFIX):
                shutil.rmtree(child, ignore_errors=True)


def start_point(run_dir: str | Path | None, resume: bool | str | Path) -> Path | None:
    """The checkpoint a run starts from (None: a fresh start), once a crashed write's leftovers are gone.

    `resume`: False = a fresh start, True = the run's latest complete checkpoint if it has one, a
    path = that checkpoint. A fresh start in a directory with checkpoints is a ValueError: it would
    prune (and later "resume") another run's checkpoints.
    """
    path = None
    if resume is True and run_dir is not None:
        path = latest_checkpoint(run_dir)
    elif resume and resume is not True:
        path = Path(resume)
    if run_dir is not None:
        remove_stale_temp_dirs(run_dir)
        if path is None and latest_checkpoint(run_dir) is not None:
            raise ValueError(f"{run_dir} already has checkpoints; resume, or use another run directory")
    return path


def prune_checkpoints(run_dir: str | Path, keep_last: int, keep: Iterable[Path] = frozenset()) -> list[Path]:
    """Delete complete checkpoints except the newest `keep_last` and those in `keep`; returns the deleted."""
    found = list_checkpoints(run_dir)
    protected = set(found[-keep_last:] if keep_last > 0 else []) | {Path(p) for p in keep}
    removed = []
    for path in found:
        if path not in protected:
            # Rename first: a crash mid-rmtree must not leave a step-N dir with a stale COMPLETE.
            doomed = path.parent / f"{TMP_PREFIX}del-{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(path)
    return removed


class CheckpointRotation:
    """Which checkpoints a run keeps: the newest `keep_last`, plus the one with the best eval metric.

        rotation.consider(path, eval_metrics)   before writing checkpoint `path`: is it the new best?
        rotation.prune(run_dir)                 after writing it: delete the others

    `best_value` and `best_checkpoint` belong in the trainer state each checkpoint stores, so a
    resumed run goes on from the same best.
    """

    def __init__(self, keep_last: int, metric: str = "loss", greater_is_better: bool = False):
        self.keep_last, self.metric, self.greater_is_better = keep_last, metric, greater_is_better
        self.best_value: float | None = None
        self.best_checkpoint: str | None = None

    def consider(self, path: str | Path, metrics: dict[str, Any] | None) -> None:
        """Make `path` the best checkpoint if `metrics` (this step's evaluation; None if there was
        none) beat the best value so far."""
        value = metrics.get(self.metric) if metrics else None
        if value is not None and self._is_better(value):
            self.best_value, self.best_checkpoint = value, str(path)

    def _is_better(self, value: float) -> bool:
        if self.best_value is None:
            return True
        return value > self.best_value if self.greater_is_better else value < self.best_value

    def prune(self, run_dir: str | Path) -> list[Path]:
        """Delete the run's checkpoints but the newest `keep_last` and the best; returns the deleted."""
        keep = {Path(self.best_checkpoint)} if self.best_checkpoint else set()
        return prune_checkpoints(run_dir, self.keep_last, keep)


# ---------------------------------------------------------------------------- saving


def save_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    trainer_state: dict,
    data_state: dict,
    tokenizer=None,
) -> Path:
    """Write a complete checkpoint atomically to `path` (normally `checkpoint_dir(run_dir, step)`)."""
    path = Path(path)
    with atomic_dir(path) as tmp:
        _save_model(model, tmp, tokenizer)
        opt_tensors, opt_json = _optimizer_state(optimizer)
        save_file(opt_tensors, tmp / "optimizer.safetensors")
        rng_tensors, rng_json = _rng_state()
        save_file(rng_tensors, tmp / "rng.safetensors")
        state = {
            "format_version": FORMAT_VERSION,
            "trainer": trainer_state,
            "data": data_state,
            "optimizer": opt_json,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_json,
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        _write_manifest(tmp)
    return path


def _save_model(model: torch.nn.Module, out: Path, tokenizer) -> None:
    """What save_pretrained writes, but into our temp dir (save_pretrained makes its own atomic dir)."""
    model.write_files(out, tokenizer)  # type: ignore[operator]  # every model of model/modeling.py has it


def _optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entry in sd["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    numpy_state = np.random.get_state()
    assert isinstance(numpy_state, tuple)  # the legacy form, get_state's default
    kind, key, pos, has_gauss, cached = numpy_state
    tensors["numpy_key"] = torch.from_numpy(key.astype(np.int64))
    version, internal, gauss_next = random.getstate()
    return tensors, {
        "numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }


def _write_manifest(out: Path) -> None:
    files = {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    (out / COMPLETE).write_text(json.dumps({"format_version": FORMAT_VERSION, "files": files}, indent=1))


# ---------------------------------------------------------------------------- loading


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore a checkpoint into existing objects; returns {"trainer": ..., "data": ...} state."""
    path = Path(path)
    if not is_complete(path):
        raise ValueError(f"{path} is not a complete checkpoint (no valid {COMPLETE} manifest)")
    state = read_state(path)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {state.get('format_version')!r}, expected {FORMAT_VERSION}")
    device = next(model.parameters()).device
    model.load_state_dict(load_file(path / "model.safetensors", device=str(device)))
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state_dict(path, state["optimizer"]))
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        _restore_rng(load_file(path / "rng.safetensors"), state["rng"])
    return {"trainer": state["trainer"], "data": state["data"]}


def _optimizer_state_dict(path: Path, saved: dict) -> dict:
    per_param: dict[int, dict[str, Any]] = {}
    for key, value in load_file(path / "optimizer.safetensors").items():
        index, name = key.split(".", 1)
        per_param.setdefault(int(index), {})[name] = value
    for key, value in saved["scalars"].items():
        index, name = key.split(".", 1)
        per_param.setdefault(int(index), {})[name] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in saved["param_groups"]]
    return {"state": per_param, "param_groups": groups}


def _restore_rng(tensors: dict[str, torch.Tensor], saved: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[f"torch_cuda_{i}"] for i in range(sum(k.startswith("torch_cuda_") for k in tensors))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    n = saved["numpy"]
    np.random.set_state(
        (n["kind"], tensors["numpy_key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = saved["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
