"""model/compute/onednn.py: the oneDNN probe waits for the first dense call that could use it (never at
import) and leaves the global RNG alone, and use_onednn switches between oneDNN and F.linear with the same results. The whole-model
checks of the fast path (every activation, gradients, packed weights) are in test_precision.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from model.compute import onednn

ROOT = Path(__file__).resolve().parents[2]
needs_onednn = pytest.mark.skipif(not onednn.available(), reason="torch without oneDNN")

_FIRST_CALL = textwrap.dedent("""
    import json, torch
    import model, model.modeling, model.compute.onednn as onednn, model.compute.kernels as kernels  # as a service imports them
    def probe_state():
        return {"enabled": kernels.PATHS["onednn-fp32"].decided}
    at_import = probe_state()
    onednn.dense(torch.nn.Linear(8, 4), torch.randn(2, 8))  # too small for oneDNN: nothing to decide
    small = probe_state()
    layer, x, rng = torch.nn.Linear(1024, 1024), torch.randn(2, 1024), torch.get_rng_state()
    with torch.no_grad():
        onednn.dense(layer, x)  # 2M multiply-adds
    first = {**probe_state(), "rng_untouched": torch.equal(rng, torch.get_rng_state())}
    print(json.dumps([at_import, small, first]))
""")


@pytest.mark.slow
def test_the_probe_runs_at_the_first_dense_call_that_could_use_onednn_not_at_import():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_CALL], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    at_import, small, first = json.loads(proc.stdout)
    assert at_import == small == {"enabled": None}
    # Probing mid-run must not draw from the global generator (a resumed run would drop out differently).
    assert first == {"enabled": onednn.available(), "rng_untouched": True}


@needs_onednn
def test_use_onednn_switches_the_path_and_the_results_agree():
    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 512)  # 8 x 1024 x 512 multiply-adds: past the oneDNN threshold
    x, residual = torch.randn(8, 1024), torch.randn(8, 512)
    old = onednn.use_onednn(False)
    try:
        with torch.no_grad():
            slow = [onednn.dense(layer, x, "gelu"), onednn.dense(layer, x, add=residual)]
            assert "_onednn_packed" not in layer.__dict__  # F.linear: nothing packed
            assert onednn.use_onednn(True) is False  # returns the setting it replaces
            fast = [onednn.dense(layer, x, "gelu"), onednn.dense(layer, x, add=residual)]
            assert "_onednn_packed" in layer.__dict__  # oneDNN's layout, kept for the next call
    finally:
        onednn.use_onednn(old)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_every_configurable_activation_has_a_function_and_a_fused_onednn_post_op():
    from model.config import ACTIVATIONS

    assert set(onednn.ACT2FN) == set(ACTIVATIONS) == set(onednn._POSTOPS)
