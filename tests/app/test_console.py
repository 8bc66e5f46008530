"""GET /console and its files (app/api/routes/console.py): open with keys set, same-origin only, a fixed
set of files, and the new-job form's parameters read off the API's own request types. The console
in a real browser is tests/test_console_browser.py.
"""

from __future__ import annotations

import re

from app.api.routes.console import ASSETS, ROOT, form_fields
from app.schemas.jobs import FinetuneParams, PretrainParams
from tests.app.test_jobs_api import make_client
from tests.helpers import make_data_dir

KEYS = {"service": {"api_key": "inference-key-0123456789"}, "admin_key": "admin-key-0123456789"}


def test_the_page_and_its_files_need_no_key_and_stay_on_the_origin(tmp_path):
    with make_client(make_data_dir(tmp_path / "data"), **KEYS) as client:
        page = client.get("/console")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
        linked = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert {url for url in linked if not url.startswith("#")} == {f"/console/{a}" for a in ASSETS}
        for asset, media_type in ASSETS.items():
            r = client.get(f"/console/{asset}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(media_type), asset
            assert r.content == (ROOT / asset).read_bytes()
        assert client.get("/console/job-form.json").status_code == 200
        # The data stays behind the keys.
        assert client.get("/models").status_code == 401 and client.get("/jobs").status_code == 401


def test_only_the_console_files_are_served(tmp_path):
    with make_client(make_data_dir(tmp_path / "data"), **KEYS) as client:
        for path in (
            "/console/index.html",
            "/console/vendor/README.md",
            "/console/..%2Fsettings.py",
            "/console/%2e%2e/%2e%2e/main.py",
        ):
            r = client.get(path)
            assert r.status_code == 404, path
            assert r.json()["error_type"] == "not_found"


def test_a_trailing_slash_leads_to_the_page(tmp_path):
    with make_client(make_data_dir(tmp_path / "data"), **KEYS) as client:
        r = client.get("/console/", follow_redirects=False)
        assert (r.status_code, r.headers["location"]) == (308, "/console")
        page = client.get("/console/")  # followed
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")


def test_our_files_name_no_other_host():
    for name in ("index.html", "console.js", "console.css"):  # the browser test watches every request too
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", (ROOT / name).read_text()), name


def test_the_job_form_offers_every_parameter_with_the_api_defaults():
    fields = form_fields()
    for kind, model in (("finetune", FinetuneParams), ("pretrain", PretrainParams)):
        by_name = {f["name"]: f for f in fields[kind]}
        top_level = {name.split(".")[0] for name in by_name}
        assert top_level == set(model.model_fields), kind
        for name, info in model.model_fields.items():
            if name != "config":
                assert by_name[name]["default"] == info.default, (kind, name)
    pretrain = {f["name"]: f for f in fields["pretrain"]}
    assert pretrain["config.hidden_size"] == {
        "name": "config.hidden_size",
        "type": "integer",
        "default": 256,
        "minimum": 8,
        "maximum": 4096,
        "description": "The size of a model pretrained from scratch (BERT-base: 768, 12, 12, 3072, 512).",
    }
    assert pretrain["precision"]["type"] == "enum" and pretrain["precision"]["enum"] == ["auto", "fp32", "bf16"]
    assert pretrain["max_runtime"]["type"] == "duration" and pretrain["nsp"]["type"] == "boolean"
    assert pretrain["lr"]["exclusiveMinimum"] == 0.0
    finetune = {f["name"]: f for f in fields["finetune"]}  # a list option: the form splits it on commas
    assert (finetune["matryoshka_dims"]["type"], finetune["matryoshka_dims"]["default"]) == ("array", None)
    assert finetune["matryoshka_dims"]["items"] == {"type": "integer", "minimum": 1, "maximum": 65536}
    assert finetune["directions"]["default"] == ["query_to_doc"]
    assert finetune["directions"]["items"]["enum"] == ["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]


def test_the_job_form_names_the_dataset_kinds_of_every_task(tmp_path):
    """The form offers a job the datasets its task trains on, as POST /jobs checks them (KINDS_OF_TASK)."""
    from datadir.datasets import KINDS_OF_TASK
    from model.options import TASKS

    with make_client(make_data_dir(tmp_path / "data")) as client:
        kinds = client.get("/console/job-form.json").json()["dataset_kinds"]
    assert kinds == {"pretrain": ["corpus"], **{task: list(k) for task, k in KINDS_OF_TASK.items()}}
    assert set(TASKS) <= set(kinds) and kinds["sequence-classification"] == ["labelled"]
    assert not any("retrieval" in k for k in kinds.values())  # evaluation only
