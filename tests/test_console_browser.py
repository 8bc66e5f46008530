"""The console in a real browser, against a live server (keys set) and a real worker, tiny models:
the key prompt refuses a wrong key; a fill-mask in the playground; a dataset uploaded; the API's 422
shown beside the field; a fine-tune started from the form whose loss curve grows while it runs;
a second job cancelled from its page; a list parameter typed comma-separated reaches the API as a list; a
model card's before/after table in the playground; the pages at 390 px; and no request leaves the page's origin.
Screenshots of each page go to $BERT_CONSOLE_SCREENSHOTS (else a temp folder; the path is printed).

Also here, without a browser: `curl -N /jobs/{id}/events` follows a running job and closes when it ends.

Browser: Debian's chromium and chromium-driver (`apt-get install chromium chromium-driver`), Selenium.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from datadir import NAME_RULE
from tests.helpers import (
    REDIS_URL,
    finetune_request,
    flush_redis,
    labelled_csv,
    make_data_dir,
    start_server,
    start_worker,
    tagged_conll,
)

pytestmark = pytest.mark.slow

API_KEY, ADMIN_KEY = "console-api-key-0123456789", "console-admin-key-0123456789"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    flush_redis()
    root = tmp_path_factory.mktemp("console")
    data_dir = make_data_dir(root / "data")
    server, url = start_server(data_dir, REDIS_URL, root, BERT_API_KEY=API_KEY, BERT_ADMIN_KEY=ADMIN_KEY)
    worker = start_worker(data_dir, REDIS_URL, "console", root, BERT_JOB_PROGRESS_INTERVAL_S="0.2")
    admin = httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    try:
        yield SimpleNamespace(url=url, admin=admin, root=root, data_dir=data_dir)
    finally:
        admin.close()
        worker.stop()
        server.stop()
        flush_redis()


def parse_sse(text: str) -> list[tuple[str, dict]]:
    events = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if fields:
            events.append((fields["event"], json.loads(fields["data"])))
    return events


def test_curl_follows_a_running_job_and_the_stream_closes_when_it_ends(stack):
    r = stack.admin.post("/datasets", files={"file": ("curl.csv", labelled_csv())}, data={"name": "curl-data"})
    assert r.status_code == 201, r.text
    job_id = stack.admin.post("/jobs", json=finetune_request("curl-clf", dataset="curl-data", max_steps=40)).json()[
        "id"
    ]
    curl = subprocess.run(
        [
            "curl",
            "-sSN",
            "--max-time",
            "120",
            "-H",
            f"Authorization: Bearer {ADMIN_KEY}",
            f"{stack.url}/jobs/{job_id}/events",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=130,
    )
    assert curl.returncode == 0, curl.stderr  # closed by the server when the job ended, not by --max-time
    events = parse_sse(curl.stdout)
    # The stream opens with the job's status and state (after any metrics lines the job wrote before the
    # stream's first look: a worker may have started it by then).
    status = [(name, data) for name, data in events if name != "metrics"]
    assert [name for name, _ in status[:2]] == ["progress", "state"]
    assert status[1][1] == {"state": status[0][1]["state"], "previous": None}
    assert events[-1] == ("end", {"state": "succeeded"})
    steps = [data["step"] for name, data in events if name == "metrics" and data["type"] == "train"]
    assert steps == list(range(1, 41))
    assert ("state", {"state": "succeeded", "previous": "running"}) in events
    running = [data for name, data in events if name == "progress" and data["state"] == "running"]
    assert running, "no progress event while the job ran"
    assert events[-2][0] == "state" and [d for n, d in events if n == "progress"][-1]["step"] == 40


# -- the browser -----------------------------------------------------------------------------------


def _browser_missing() -> str | None:
    if not (CHROMIUM and CHROMEDRIVER):
        return "needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "needs selenium (pip install selenium)"
    return None


@pytest.fixture(scope="module")
def browser(stack, tmp_path_factory):
    if (missing := _browser_missing()) is not None:
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    shots = Path(os.environ.get("BERT_CONSOLE_SCREENSHOTS") or tmp_path_factory.mktemp("console-screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    print(f"\nconsole screenshots: {shots}")
    b = SimpleNamespace(driver=driver, url=stack.url, shots=shots, requests=[])
    try:
        yield b
    finally:
        driver.quit()


def requested(b) -> list[str]:
    """Every URL the page has asked for so far (Chrome's performance log, drained into b.requests)."""
    for entry in b.driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            b.requests.append(message["params"]["request"]["url"])
    return b.requests


def until(b, predicate, timeout: float = 30, what: str = "the page"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(b.driver, timeout, poll_frequency=0.1).until(lambda d: predicate(d), f"waiting for {what}")


def css(b, selector: str):
    from selenium.webdriver.common.by import By

    return b.driver.find_elements(By.CSS_SELECTOR, selector)


def text_of(b, selector: str) -> str:
    """The element's visible text, read in one step (the page re-renders live parts under us)."""
    return b.driver.execute_script(
        "const el = document.querySelector(arguments[0]); return el ? el.innerText : ''", selector
    )


def attribute(b, selector: str, name: str) -> str | None:
    return b.driver.execute_script(
        "const el = document.querySelector(arguments[0]); return el ? el.getAttribute(arguments[1]) : null",
        selector,
        name,
    )


def open_page(b, hash_: str):
    b.driver.get(f"{b.url}/console{hash_}")


def shot(b, name: str):
    b.driver.execute_script("window.scrollTo(0, 0)")
    b.driver.save_screenshot(str(b.shots / f"{name}.png"))


def type_into(b, selector: str, text: str):
    el = css(b, selector)[0]
    el.clear()
    el.send_keys(text)


def test_the_key_prompt_refuses_a_wrong_key_then_opens_the_console(browser):
    b = browser
    open_page(b, "#/jobs")
    until(b, lambda d: css(b, "#keys-dialog[open]"), what="the key dialog")
    assert "missing or wrong key" in text_of(b, "#keys-reason")
    shot(b, "keys")
    type_into(b, "#api-key", "not-the-key-0123456789")
    css(b, "#keys-submit")[0].click()
    until(b, lambda d: text_of(b, "#keys-reason").startswith("Refused:"), what="the refusal")
    assert text_of(b, "#keys-reason") == (
        "Refused: missing or wrong API key: send 'Authorization: Bearer <BERT_API_KEY>'"
    )
    assert css(b, "#keys-dialog[open]")
    type_into(b, "#api-key", API_KEY)
    type_into(b, "#admin-key", ADMIN_KEY)
    css(b, "#keys-submit")[0].click()
    until(
        b, lambda d: not css(b, "#keys-dialog[open]") and css(b, "#jobs-table tbody tr[data-job]"), what="the jobs list"
    )
    # Kept for the tab, never in a cookie or the URL.
    assert b.driver.execute_script("return sessionStorage.getItem('bert.adminKey')") == ADMIN_KEY
    assert b.driver.get_cookies() == [] and API_KEY not in b.driver.current_url


def test_models_and_a_fill_mask_in_the_playground(browser):
    b = browser
    open_page(b, "#/models")
    until(b, lambda d: "tiny" in text_of(b, "main table"), what="the models table")
    rows = {r.text.split()[0]: r.text for r in css(b, "main tbody tr")}
    assert "BertForPreTraining" in rows["tiny"] and "mlm, nsp" in rows["tiny"] and "★ default" in rows["tiny"]
    assert "BertForSequenceClassification" in rows["curl-clf"] and "negative, positive" in rows["curl-clf"]
    assert "no evaluation" in rows["tiny"] and "no MLM or NSP head" in rows["curl-clf"]  # their cards
    assert css(b, "main tbody a[href^='#/jobs/']")  # the job that produced curl-clf
    shot(b, "models")
    open_page(b, "#/playground/tiny")
    until(b, lambda d: css(b, "#fill-mask"), what="the fill-mask form")
    assert css(b, "#nsp") and css(b, "#embed") and not css(b, "#classify")  # only what the heads allow
    type_into(b, "#fm-text", "the cat [MASK] on the [MASK] .")
    type_into(b, "#fm-topk", "3")
    css(b, "#fill-mask button[type=submit]")[0].click()
    until(b, lambda d: len(css(b, "#fill-mask-result .bars li")) == 6, what="two masks' candidates")
    assert len(css(b, "#fill-mask-result .bars")) == 2
    css(b, "#embed button[type=submit]")[0].click()
    until(b, lambda d: len(css(b, "#embed-result table.heat tbody td")) == 9, what="the similarity heat map")
    assert text_of(b, "#embed-result tbody tr:first-child td") == "1.00"
    shot(b, "playground")


def test_upload_a_dataset_with_a_progress_bar(browser):
    b = browser
    path = b.shots.parent / "reviews.csv"
    path.write_bytes(labelled_csv())
    open_page(b, "#/datasets")
    until(b, lambda d: css(b, "#upload-file"), what="the upload form")
    css(b, "#upload-file")[0].send_keys(str(path))
    type_into(b, "#upload-name", "reviews")
    css(b, "#upload button[type=submit]")[0].click()
    until(b, lambda d: "40 rows" in text_of(b, "tr[data-dataset='reviews']"), what="the uploaded dataset")
    assert "negative (20), positive (20)" in text_of(b, "tr[data-dataset='reviews']")
    shot(b, "datasets")


def test_a_token_labelled_upload_and_the_task_select_picks_its_datasets(browser):
    from selenium.webdriver.support.ui import Select

    b = browser
    path = b.shots.parent / "ner.conll"
    path.write_bytes(tagged_conll())
    open_page(b, "#/datasets")
    until(b, lambda d: css(b, "#upload-file"), what="the upload form")
    css(b, "#upload-file")[0].send_keys(str(path))
    type_into(b, "#upload-name", "console-ner")
    css(b, "#upload button[type=submit]")[0].click()
    until(b, lambda d: "20 sentences" in text_of(b, "tr[data-dataset='console-ner']"), what="the tagged dataset")
    assert "LOC (15), PER (20), THING (15)" in text_of(b, "tr[data-dataset='console-ner']")
    open_page(b, "#/new")
    until(b, lambda d: css(b, "[id='params.task']"), what="the task select")
    names = lambda: [o.get_attribute("value") for o in Select(css(b, "#new-job #dataset")[0]).options]  # noqa: E731
    assert "console-ner" not in names()
    Select(css(b, "[id='params.task']")[0]).select_by_value("token-classification")
    assert names() == ["console-ner"]
    open_page(b, "#/datasets")  # away, so the next test's #/new is a fresh form
    until(b, lambda d: css(b, "#upload-file"), what="the datasets page")


def submit_job_form(b, fields: dict[str, str]):
    for selector, value in fields.items():
        type_into(b, selector, value)
    css(b, "#submit-job")[0].click()


def test_the_form_shows_the_api_message_beside_the_field(browser):
    b = browser
    open_page(b, "#/new")
    until(b, lambda d: css(b, "#new-job #model_name") and css(b, "[id='params.max_steps']"), what="the form")
    # fine-tuning's defaults (model/options.py): 3 epochs, so max_steps unset
    assert "default: unset" in text_of(b, "[id='hint-params.max_steps']")
    assert "default: 3" in text_of(b, "[id='hint-params.epochs']")
    submit_job_form(b, {"#model_name": "console-clf", "[id='params.max_steps']": "0"})
    until(b, lambda d: text_of(b, "[id='err-params.max_steps']"), what="the max_steps error")
    assert text_of(b, "[id='err-params.max_steps']") == (
        "finetune.params.max_steps: Input should be greater than or equal to 1"
    )
    assert attribute(b, "[id='params.max_steps']", "aria-invalid") == "true"
    submit_job_form(b, {"#model_name": "tmp-clf", "[id='params.max_steps']": "10"})
    until(b, lambda d: text_of(b, "#err-model_name"), what="the model_name error")
    assert text_of(b, "#err-model_name") == f"finetune.model_name: {NAME_RULE}"
    assert text_of(b, "[id='err-params.max_steps']") == ""
    shot(b, "new-job-error")


def chart_points(b) -> int:
    return int(attribute(b, "#charts", "data-points") or 0)


def test_a_finetune_from_the_form_grows_its_curve_and_a_second_job_is_cancelled(browser, stack):
    b = browser
    open_page(b, "#/new")
    until(b, lambda d: css(b, "#new-job #model_name"), what="the form")
    submit_job_form(
        b,
        {
            "#model_name": "console-clf",
            "[id='params.max_steps']": "20000",
            "[id='params.batch_size']": "8",
            "[id='params.max_seq_len']": "32",
            "[id='params.log_every']": "1",
            "[id='params.save_every']": "500",
            "[id='params.lr']": "1e-3",
        },
    )
    until(b, lambda d: "#/jobs/" in d.current_url, what="the job page")
    first = b.driver.current_url.rsplit("/", 1)[1]
    try:
        until(b, lambda d: chart_points(b) >= 3, timeout=60, what="the first points of the curve")
    except Exception:
        print(b.driver.get_log("browser"), text_of(b, "main"), sep="\n")
        raise
    seen = chart_points(b)
    until(b, lambda d: chart_points(b) >= seen + 5, what="the curve to grow")
    assert text_of(b, "#job-live") == "Live (event stream)."
    assert "running" in text_of(b, "#job-facts")
    assert int(attribute(b, "[data-chart='loss']", "data-points")) >= seen + 5
    shot(b, "job")

    # The second job waits behind the first (one worker process) and is cancelled from its page.
    second = stack.admin.post("/jobs", json=finetune_request("console-second")).json()["id"]
    open_page(b, "#/jobs")
    until(
        b,
        lambda d: css(b, f"tr[data-job='{second}']") and "running" in text_of(b, f"tr[data-job='{first}']"),
        what="both jobs listed",
    )
    shot(b, "jobs")
    open_page(b, f"#/jobs/{second}")
    until(b, lambda d: "queued" in text_of(b, "#job-facts"), what="the queued job")
    css(b, "#cancel-job")[0].click()
    until(b, lambda d: "cancelled" in text_of(b, "#job-facts"), what="the second job cancelled")
    until(b, lambda d: text_of(b, "#job-live") == "Finished: cancelled.", what="the end of its stream")
    assert attribute(b, "#cancel-job", "disabled") is not None

    open_page(b, f"#/jobs/{first}")  # and the running one: it stops at its next step, with a checkpoint
    until(b, lambda d: chart_points(b) > 0 and css(b, "#cancel-job:not([disabled])"), what="the first job's page")
    css(b, "#cancel-job")[0].click()
    until(b, lambda d: text_of(b, "#job-live") == "Finished: cancelled.", what="the running job cancelled")
    assert "cancelled" in text_of(b, "#job-facts") and "checkpoints/step-" in text_of(b, "#job-checkpoint")
    assert [e["event"] for e in stack.admin.get(f"/jobs/{first}").json()["events"]][-2:] == [
        "cancel requested",
        "cancelled",
    ]


def test_a_list_parameter_goes_as_a_list_and_a_cards_before_and_after_shows(browser, stack):
    from selenium.webdriver.support.ui import Select

    from datadir.cards import update_card

    b = browser
    open_page(b, "#/new")
    until(b, lambda d: css(b, "[id='params.task']"), what="the task select")
    Select(css(b, "[id='params.task']")[0]).select_by_value("sentence-embedding")
    submit_job_form(b, {"#model_name": "console-embedder", "[id='params.matryoshka_dims']": "16, 32"})
    until(b, lambda d: text_of(b, "#err-params"), what="the params error")
    assert text_of(b, "#err-params") == (  # the API got [16, 32]: numbers in a list
        "finetune.params: matryoshka_dims must descend without repeats (largest first), got [16, 32]"
    )
    rows = [{"metric": "cosine_ndcg@10", "before": 0.5, "after": 0.75}, {"metric": "cosine_mrr@10", "before": 0.25,
                                                                          "after": 0.5}]  # fmt: skip
    update_card(stack.data_dir / "models" / "tiny", before_after=rows)  # as a job that scored its base model
    open_page(b, "#/playground/tiny")
    until(b, lambda d: css(b, "#before-after tbody tr"), what="the before and after table")
    assert [r.text for r in css(b, "#before-after tbody tr")] == ["cosine_ndcg@10 0.5 0.75", "cosine_mrr@10 0.25 0.5"]
    update_card(stack.data_dir / "models" / "tiny", before_after=None)


def test_narrow_screens_and_same_origin(browser):
    b = browser
    b.driver.set_window_size(390, 844)
    try:
        for name, hash_, ready in (
            ("jobs-390", "#/jobs", "#jobs-table tbody tr[data-job]"),
            ("models-390", "#/models", "main tbody tr"),
            ("new-job-390", "#/new", "#new-job #model_name"),
        ):
            open_page(b, hash_)
            until(b, lambda d, ready=ready: css(b, ready), what=name)
            width = b.driver.execute_script("return document.documentElement.scrollWidth")
            assert width <= 390, f"{name}: the page is {width} px wide at 390 px"
            shot(b, name)
    finally:
        b.driver.set_window_size(1280, 900)
    urls = requested(b)
    assert urls and any(u.endswith("/events") for u in urls)
    assert [u for u in urls if not u.startswith(f"{b.url}/")] == []
