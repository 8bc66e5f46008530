"""What a model load and unload do for a GPU, without one: the weights are read, checked and cast on the host and
moved once (never fp32 on the device, never a refused model), and the cache is emptied off the event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from app.errors import ServiceError
from app.serving import stored_models
from app.serving.model_registry import ModelRegistry
from app.serving.stored_models import StoredModel, load_stored, read_stored_model
from model.modeling import BertModel
from tests.app.conftest import save_tiny


@pytest.fixture
def moves(monkeypatch):
    """Every Module.to(...) call, as (dtypes of the parameters at the time, its device argument)."""
    seen = []
    real_to = torch.nn.Module.to

    def to(self, *args, **kwargs):
        if isinstance(self, BertModel) or hasattr(self, "bert"):
            seen.append(({p.dtype for p in self.parameters()}, args[0] if args else kwargs.get("device")))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    return seen


def entry_for(path, name="m") -> StoredModel:
    return read_stored_model(name, path, identity=(0, 0))


def test_a_model_is_cast_on_the_host_then_moved(tmp_path, monkeypatch, moves):
    save_tiny(tmp_path / "m", BertModel)
    loaded_on = []
    real_load = stored_models.load_model
    monkeypatch.setattr(
        stored_models, "load_model", lambda path, device: loaded_on.append(device) or real_load(path, device)
    )
    target = torch.device("cpu", 0)  # stands for the GPU: a device the model must be moved to once, last
    load_stored(entry_for(tmp_path / "m"), target, "bf16")
    assert loaded_on == ["cpu"]
    assert moves[-1] == ({torch.bfloat16}, target)  # moved after the cast: bf16 on arrival


def test_a_refused_model_never_reaches_the_device(tmp_path, moves):
    save_tiny(tmp_path / "m", BertModel, vocab_size=20)  # its tokenizer has more tokens than its 20 rows
    with pytest.raises(ServiceError, match="tokenizer has"):
        load_stored(entry_for(tmp_path / "m"), torch.device("cpu", 0), "fp32")
    assert all(device != torch.device("cpu", 0) for _, device in moves)


@pytest.mark.anyio
async def test_an_unload_empties_the_cuda_cache_off_the_event_loop(tmp_path, monkeypatch):
    threads = []
    emptied = threading.Event()

    def empty_cache():
        threads.append(threading.current_thread())
        emptied.set()

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    registry = ModelRegistry(tmp_path, None, torch.device("cuda"))
    registry.unload(StoredModel(name="m", path=tmp_path, identity=(0, 0)))
    assert await asyncio.to_thread(emptied.wait, 30)
    assert threads and threads[0] is not threading.main_thread()


def test_a_gpu_gets_larger_passes_unless_the_setting_is_given(tmp_path, monkeypatch, tf32_given_back):
    from app.prometheus import Metrics
    from app.serving.service import GPU_MAX_BATCH_TOKENS, Service
    from app.settings import Settings
    from tests.app.conftest import settings_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    given = settings_for(tmp_path, device="cuda")  # max_batch_tokens=4096, given
    unset = Settings(**given.model_dump(exclude={"max_batch_tokens"}))
    assert Service(unset, Metrics()).settings.max_batch_tokens == GPU_MAX_BATCH_TOKENS == 16384
    assert Service(given, Metrics()).settings.max_batch_tokens == 4096
    assert Service(Settings(**{**unset.model_dump(), "device": "cpu"}), Metrics()).settings.max_batch_tokens == 4096
