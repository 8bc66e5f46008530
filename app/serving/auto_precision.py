"""`auto` on a CPU: the precision a model's card measured best on this kind of CPU (model/precision_choice.py),
and the background measurement for a kind of CPU its card lacks.

The card's "precision" table has a row per kind of CPU (precision_choice.cpu_kind), written when the model was
imported or published (model.model_card.write_card). The registry reads the table with the model's directory
(StoredModel.precision_table, at each scan that finds a new version); `choice` picks from this CPU's row with
the service's bounds (BERT_AUTO_MIN_COSINE, BERT_AUTO_MIN_AGREEMENT, BERT_AUTO_MIN_TOP5_OVERLAP).

A CPU where only fp32 is native (no bf16, no VNNI) serves fp32 without measuring. A model loaded on a kind
of CPU its card lacks is served in fp32 meanwhile, and measured once, in a background thread (never on a
request's path; one model at a time), when two fp32 copies of it and a small forward pass fit in the memory
budget beside the models loaded (else at a later load). The row is written into the card; a measurement that
failed is kept as the row's error (fp32, that reason shown) and not tried again (`bert evaluate-card` measures
again). Writing the card changes the version directory, so the registry reads the entry again at the next
request, and loads the model at the chosen precision: the fp32 copy is dropped as an unloaded model is
(requests on it finish first). A reload rather than waiting for a restart, because the measurement is made
once per model and kind of CPU, and a pinned model would otherwise keep fp32 for the life of the process.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from app.serving.stored_models import StoredModel
from app.settings import Settings
from model import precision_choice
from model.sizing import engine_working_bytes, format_bytes, inference_weight_bytes

if TYPE_CHECKING:
    from app.serving.model_registry import ModelRegistry

log = logging.getLogger("bertserve.precision")


class AutoPrecision:
    def __init__(self, settings: Settings):
        self.bounds = precision_choice.Bounds(
            cosine=settings.auto_min_cosine,
            agreement=settings.auto_min_agreement,
            top5=settings.auto_min_top5_overlap,
        )
        self.kind = precision_choice.cpu_kind()
        self.native = precision_choice.native_precisions()
        self._lock = threading.Lock()
        self._measuring: set[Path] = set()  # model directories measured now (or queued)
        self._postponed: dict[Path, str] = {}  # why a directory was not measured at its last load
        self._turn = threading.Lock()  # one measurement at a time

    def choice(self, entry: StoredModel | None) -> tuple[str, str]:
        """(precision, why) for a model served with auto on this CPU, from its card's row for this kind of CPU."""
        chosen = precision_choice.auto_choice(entry.precision_table if entry is not None else None, self.bounds)
        if chosen is None:
            if entry is not None and entry.path in self._measuring:
                return "fp32", f"its precisions are being measured on this kind of CPU ({self.kind})"
            if entry is not None and entry.path in self._postponed:
                return "fp32", f"not measured on this kind of CPU ({self.kind}) yet: {self._postponed[entry.path]}"
            return "fp32", f"not measured on this kind of CPU ({self.kind}) yet: it is, in the background, at its load"
        return chosen

    def measure_if_missing(self, entry: StoredModel, registry: ModelRegistry) -> None:
        """At a load (in the load's thread): start measuring the entry's precisions in the background when its
        card has no row for this kind of CPU and the measurement fits in the memory budget."""
        if self.native == ["fp32"] or self.kind in (entry.precision_table or {}):
            return
        if entry.config is None or entry.num_parameters is None:
            return
        # an fp32 copy and one other precision's (at most as large) at a time, and a small forward pass
        need = 2 * inference_weight_bytes(entry.config, entry.num_parameters, "fp32") + engine_working_bytes(
            entry.config, precision_choice.MAX_TEXTS * precision_choice.MAX_TOKENS, "fp32"
        )
        with self._lock:
            if entry.path in self._measuring:
                return
            budget = registry.memory_budget
            # the models' weights (this one's reserved for its load) and the serving pass's working set
            in_use = sum(e.reserved_bytes for e in registry.entries()) + registry.estimate(entry)[1]
            if budget is not None and in_use + need > budget:
                self._postponed[entry.path] = (
                    f"the measurement's {format_bytes(need)} does not fit in the memory budget beside the models "
                    "loaded; it is tried again at the next load"
                )
                log.info("model %s: %s", entry.name, self._postponed[entry.path])
                return
            self._postponed.pop(entry.path, None)
            self._measuring.add(entry.path)
        threading.Thread(target=self._measure, args=(entry,), name="precision-measure", daemon=True).start()

    def _measure(self, entry: StoredModel) -> None:
        from model.model_card import write_precision_row

        try:
            with self._turn:
                log.info("model %s: measuring its precisions on this kind of CPU (%s)", entry.name, self.kind)
                row = write_precision_row(entry.path)  # the directory changes: the next request reads it again
                precision, why = precision_choice.choose(row, self.bounds)
                log.info("model %s: auto is %s here (%s), from its next load", entry.name, precision, why)
        except Exception:
            log.exception("model %s: measuring its precisions failed", entry.name)
        finally:
            with self._lock:
                self._measuring.discard(entry.path)
