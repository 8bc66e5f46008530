"""The data directory's models and datasets, administered: promote a version, delete a model, one of its
versions or a dataset, refusing what requests default to or a queued or running job uses.

Each change runs under the job service's submission lock (`JobService.submit_lock`), so no job can be
accepted on a model or dataset between the in-use check and the change. Blocking calls run in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from app.errors import ServiceError
from app.keys.keyfile import Key
from app.keys.keyring import ANONYMOUS
from app.keys.ownership import may_change_dataset
from app.settings import Settings
from datadir import TERMINAL, DataDir, JobRecords, delete_dataset, read_meta, versions
from datadir.publish import set_shared


class Catalog:
    """Promote and delete the models and datasets of one data directory (the /models and /datasets routes)."""

    def __init__(self, settings: Settings, data_dir: Path, records: JobRecords, submit_lock: asyncio.Lock):
        self.settings, self.data_dir, self.records, self.submit_lock = settings, data_dir, records, submit_lock

    async def promote(self, name: str, version: int) -> None:
        """Make `version` the one requests for `name` get; 404 for an unknown model or version."""
        async with self.submit_lock:
            await asyncio.to_thread(_data_call, versions.promote, self.data_dir, name, version)

    async def share(self, name: str, shared: bool) -> None:
        """Share model `name` with every key or stop sharing it; 404 for an unknown model."""
        async with self.submit_lock:
            await asyncio.to_thread(_data_call, set_shared, self.data_dir, name, shared)

    async def delete_model(self, name: str, version: int | None = None) -> int:
        """Delete a model (or one version of it; the last one deletes the model); the bytes freed.

        409 while requests default to it (BERT_DEFAULT_MODEL and the other default-model settings) and the whole
        model would go, or while a queued or running job trains from it, or for the promoted version
        while others exist."""
        async with self.submit_lock:
            numbers = await asyncio.to_thread(versions.version_numbers, DataDir(self.data_dir).model(name))
            if not numbers:
                raise ServiceError("not_found", str(versions.ModelNotFound(name)))
            if version is None or numbers == [version]:  # the whole model would go
                self._refuse_default(name)
            await asyncio.to_thread(self._refuse_in_use, "base_model", name, "model")
            await asyncio.to_thread(self._refuse_in_use, "params.retriever_model", name, "model")
            await asyncio.to_thread(self._refuse_in_use, "params.teacher_model", name, "model")
            if version is None:
                return await asyncio.to_thread(_data_call, versions.delete_model, self.data_dir, name)
            return await asyncio.to_thread(_data_call, versions.delete_version, self.data_dir, name, version)

    async def delete_dataset(self, name: str, caller: Key = ANONYMOUS) -> int:
        """Delete a dataset; the bytes freed. 404 when there is none (or it is not `caller`'s: another key's
        datasets are not shown to it); 409 while a queued or running job uses it. Under the data directory's
        submission lock too, so no process (another replica, `bert datasets delete`) accepts a job on it
        between the check and the deletion."""
        async with self.submit_lock:
            held = contextlib.ExitStack()
            await asyncio.to_thread(held.enter_context, self.records.submitting())
            with held:
                return await asyncio.to_thread(self._delete_dataset, name, caller)

    def _delete_dataset(self, name: str, caller: Key) -> int:
        meta = read_meta(self.data_dir, name)
        if meta is None or not may_change_dataset(caller, meta):
            raise ServiceError("not_found", f"dataset '{name}' not found")
        self._refuse_in_use("dataset", name, "dataset")
        self._refuse_in_use("eval_dataset", name, "dataset")
        try:
            return delete_dataset(self.data_dir, name)
        except FileNotFoundError:
            raise ServiceError("not_found", f"dataset '{name}' not found") from None

    def _refuse_default(self, name: str) -> None:
        for value, setting in (
            (self.settings.default_model, "BERT_DEFAULT_MODEL"),
            (self.settings.default_mlm_model, "BERT_DEFAULT_MLM_MODEL"),
            (self.settings.rerank_model, "BERT_RERANK_MODEL"),
            (self.settings.predict_model, "BERT_PREDICT_MODEL"),
        ):
            if value == name:
                raise ServiceError(
                    "conflict", f"model '{name}' is the default model ({setting}): set another before deleting it"
                )

    def _refuse_in_use(self, field: str, name: str, what: str) -> None:
        """409 naming the queued or running job whose `field` (base_model, dataset, eval_dataset,
        params.retriever_model, params.teacher_model) is `name`; a mining job's corpus dataset (params.corpus) is in use as its dataset is."""
        for record in self.records.list():
            used = {_field_of(record, field)} | ({_field_of(record, "params.corpus")} if field == "dataset" else set())
            if name in used and record["state"] not in TERMINAL:
                raise ServiceError(
                    "conflict",
                    f"{what} '{name}' is in use by job {record['id']} ({record['state']}); "
                    "delete it once the job has finished (or cancel the job)",
                )


def _field_of(record: Mapping[str, Any], field: str) -> Any:
    """A record's `field`, or its params' for a "params." name."""
    if field.startswith("params."):
        return (record.get("params") or {}).get(field.removeprefix("params."))
    return record.get(field)


def _data_call(call: Callable[..., Any], *args: Any) -> Any:
    """A datadir.versions call, its refusals as the service's errors (404, 409)."""
    try:
        return call(*args)
    except (versions.ModelNotFound, versions.VersionNotFound) as e:
        raise ServiceError("not_found", str(e)) from None
    except versions.PromotedVersion as e:
        raise ServiceError("conflict", str(e)) from None
