"""A model's card: DATA_DIR/models/<name>/<version>/card.json, what a user reads to judge a model.

One JSON object whose top-level keys are each written by the part that knows them:

    source       where the weights came from: {"kind": "hub" | "directory" | "archive" | "job", ...}
                 (a Hub import adds repo id, revision, resolved commit sha and license; a job its id)
    evaluation   the short held-out evaluation run on import or publish (masked-token and NSP scores)
    job_eval     a fine-tuning job's own evaluation, copied from its record
    before_after that evaluation's metrics before training (the base model's) and after, one row each,
                 when the job evaluated its base model first
    precision    by kind of CPU ("x86 avx512 bf16 vnni amx"): each precision that CPU runs natively, its speed
                 and each output's scores against fp32 (model/precision_choice.py), measured on import or
                 publish, or by a service that loads the model on a kind of CPU the card lacks

`update_card` merges keys into the file and rewrites it whole (temp, fsync, rename), so a reader never
sees half of it; a missing or unreadable card reads as {}.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from datadir.files import atomic_write_bytes

CARD = "card.json"


def read_card(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The card of a model directory, or {} when it has none (or it cannot be read)."""
    try:
        card = json.loads((Path(model_dir) / CARD).read_bytes())
    except (OSError, ValueError):
        return {}
    return card if isinstance(card, dict) else {}


def update_card(model_dir: str | os.PathLike, **fields: Any) -> dict[str, Any]:
    """Set top-level keys of the card (others are kept); the card as written."""
    card = {**read_card(model_dir), **fields}
    atomic_write_bytes(Path(model_dir) / CARD, json.dumps(card, indent=2, sort_keys=True).encode() + b"\n")
    return card
