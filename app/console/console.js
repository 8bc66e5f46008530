// The bertserve console: one page, hash routes (#/models, #/playground/NAME, #/jobs, #/jobs/ID,
// #/new, #/datasets), the service's own JSON API on the page's origin, nothing else.
// Keys: kept in sessionStorage (this tab only), sent as `Authorization: Bearer`, never in a URL or
// a cookie; a 401 brings the key dialog back. A job page follows GET /jobs/{id}/events (read with
// fetch, since EventSource cannot send a header), and polls when the stream drops.
"use strict";

// -- small helpers -------------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") el.textContent = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const child of children.flat(Infinity)) {
    if (child !== null && child !== undefined && child !== false) el.append(child);
  }
  return el;
}

const fmt = {
  count(n) {
    if (n === null || n === undefined) return "–";
    for (const [size, unit] of [[1e9, " B"], [1e6, " M"], [1e3, " k"]]) {
      if (Math.abs(n) >= size) return (n / size).toLocaleString(undefined, {maximumFractionDigits: 1}) + unit;
    }
    return n.toLocaleString();
  },
  num(x, digits = 4) {
    return x === null || x === undefined ? "–" : Number(x).toLocaleString(undefined, {maximumSignificantDigits: digits});
  },
  bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "kB", "MB", "GB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return `${n.toLocaleString(undefined, {maximumFractionDigits: 1})} ${units[i]}`;
  },
  duration(s) {
    if (s === null || s === undefined) return "–";
    s = Math.round(s);
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  },
  time(iso) { return iso ? new Date(iso).toLocaleString() : "–"; },
  rate(x) { return x === null || x === undefined ? "–" : `${Math.round(x).toLocaleString()} tokens/s`; },
  percent(x) { return `${(100 * x).toLocaleString(undefined, {maximumFractionDigits: 1})} %`; },
};

function stateBadge(state) { return h("span", {class: `state state-${state}`, text: state}); }

// -- keys and the API ----------------------------------------------------------------------------

const keys = {
  get api() { return sessionStorage.getItem("bert.apiKey") || ""; },
  get admin() { return sessionStorage.getItem("bert.adminKey") || ""; },
  save(api, admin) {
    for (const [name, value] of [["bert.apiKey", api], ["bert.adminKey", admin]]) {
      if (value) sessionStorage.setItem(name, value); else sessionStorage.removeItem(name);
    }
  },
};

class ApiError extends Error {
  constructor(status, body) {
    super(body && body.error ? body.error : `HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

const isAdminPath = (path) => /^\/(jobs|datasets)(\/|$|\?)/.test(path);

function authHeaders(path) {
  const key = isAdminPath(path) ? (keys.admin || keys.api) : keys.api;
  return key ? {Authorization: `Bearer ${key}`} : {};
}

// quiet: a 401 is the caller's business (no dialog), e.g. the job links on the models page.
async function api(path, {method = "GET", json, quiet = false} = {}) {
  const headers = authHeaders(path);
  let body;
  if (json !== undefined) { headers["Content-Type"] = "application/json"; body = JSON.stringify(json); }
  const r = await fetch(path, {method, headers, body, cache: "no-store", credentials: "omit"});
  let data = null;
  try { data = await r.json(); } catch (e) { data = null; }
  if (!r.ok) {
    const err = new ApiError(r.status, data);
    if (r.status === 401 && !quiet) askForKeys(err.message);
    throw err;
  }
  return data;
}

const dialog = () => document.getElementById("keys-dialog");

function askForKeys(reason) {
  const d = dialog();
  document.getElementById("keys-reason").textContent = reason || "";
  if (!d.open) {
    document.getElementById("api-key").value = keys.api;
    document.getElementById("admin-key").value = keys.admin;
    d.showModal();
    document.getElementById("api-key").focus();
  }
}

async function useKeys(event) {
  event.preventDefault();
  const apiKey = document.getElementById("api-key").value.trim();
  const admin = document.getElementById("admin-key").value.trim();
  // Try them before keeping them: a key the service does not know is refused here, with its words. /info
  // takes any key it knows, whatever its scopes; a page a key's scopes do not open says so itself (403).
  try {
    await probe(apiKey);
    if (admin) await probe(admin);
  } catch (err) {
    document.getElementById("keys-reason").textContent = `Refused: ${err.message}`;
    return;
  }
  keys.save(apiKey, admin);
  dialog().close();
  route();
}

async function probe(key) {
  const headers = key ? {Authorization: `Bearer ${key}`} : {};
  const r = await fetch("/info", {headers, cache: "no-store", credentials: "omit"});
  if (r.status !== 401) return;
  let data = null;
  try { data = await r.json(); } catch (e) { data = null; }
  throw new ApiError(r.status, data);
}

// -- routing ---------------------------------------------------------------------------------------

let leaving = [];  // what the current view must stop (timers, streams) when another one opens
const view = () => document.getElementById("view");

function onLeave(fn) { leaving.push(fn); }

function show(title, ...content) {
  const v = view();
  v.replaceChildren(h("h1", {text: title}), ...content);
  document.title = `${title} · bertserve`;
}

function failure(err) {
  if (err instanceof ApiError && err.status === 401) {
    return h("section", {class: "card"},
      h("p", {class: "error", role: "alert", text: err.message}),
      h("button", {type: "button", onclick: () => askForKeys(err.message), text: "Enter keys"}));
  }
  return h("p", {class: "error", role: "alert", text: err.message});
}

async function route() {
  for (const fn of leaving) fn();
  leaving = [];
  const [page, arg] = (location.hash.replace(/^#\/?/, "") || "jobs").split("/").map(decodeURIComponent);
  for (const a of document.querySelectorAll("nav a")) {
    if (a.dataset.page === page) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
  }
  const pages = {models: modelsPage, playground: playgroundPage, jobs: arg ? jobPage : jobsPage, new: newJobPage,
                 datasets: datasetsPage};
  try {
    await (pages[page] || jobsPage)(arg);
  } catch (err) {
    show("Error", failure(err));
  }
}

// -- models ----------------------------------------------------------------------------------------

async function modelsPage() {
  show("Models", h("p", {text: "Loading…"}));
  const {models} = await api("/models");
  let producedBy = {};
  try {  // the job that published each model: needs the admin key; without it, no links
    const {jobs} = await api("/jobs?state=succeeded", {quiet: true});
    for (const job of jobs) if (job.model_name && !(job.model_name in producedBy)) producedBy[job.model_name] = job.id;
  } catch (err) { producedBy = {}; }
  const rows = models.map((m) => h("tr", {},
    h("td", {}, h("a", {href: `#/playground/${encodeURIComponent(m.name)}`, text: m.name}),
      m.default ? h("span", {class: "hint", text: " ★ default"}) : null),
    h("td", {text: m.architecture || "–"}),
    h("td", {text: m.heads.join(", ") || "encoder only"}),
    h("td", {text: m.labels ? m.labels.join(", ") : "–"}),
    h("td", {class: "num", text: fmt.count(m.num_parameters)}),
    h("td", {class: "num hide-narrow", text: m.hidden_size ?? "–"}),
    h("td", {text: m.precision}),
    h("td", {text: m.error ? "cannot load" : m.loaded ? "loaded" : "not loaded"}),
    heldOutCell(m.card),
    h("td", {}, producedBy[m.name] ? h("a", {href: `#/jobs/${producedBy[m.name]}`, text: producedBy[m.name]}) : "–"),
    h("td", {class: "error", text: m.error || ""})));
  show("Models", h("div", {class: "table-wrap"}, h("table", {},
    h("thead", {}, h("tr", {}, ["Name", "Architecture", "Heads", "Labels", "Parameters", "Hidden", "Precision",
                                "State", "Held-out scores", "Produced by", ""].map((t, i) =>
      h("th", {scope: "col", class: i === 4 ? "num" : i === 5 ? "num hide-narrow" : null, text: t})))),
    h("tbody", {}, rows))),
  h("p", {class: "hint", text: "Open a model to try it in the playground."}));
}

// A model card's evaluation (GET /models' `card`): masked-token top-1 and NSP accuracy on the held-out set.
function heldOutCell(card) {
  const ev = card && card.evaluation;
  if (!ev) return h("td", {class: "hint", text: "no evaluation"});
  if (ev.error) return h("td", {class: "error", title: ev.error, text: "evaluation failed"});
  if (ev.skipped) return h("td", {class: "hint", title: ev.skipped, text: "no MLM or NSP head"});
  const nsp = ev.nsp_accuracy == null ? "" : ` · NSP ${fmt.percent(ev.nsp_accuracy)}`;
  return h("td", {title: `${ev.set}: ${ev.sequences} sequences, ${ev.masked_tokens} masked tokens; ` +
                         `top-5 ${fmt.percent(ev.mlm_top5)}`,
                  text: `MLM top-1 ${fmt.percent(ev.mlm_top1)}${nsp}`});
}

// -- playground ------------------------------------------------------------------------------------

function form(id, fields, submitLabel, onsubmit) {
  const error = h("p", {class: "error", role: "alert", id: `${id}-error`});
  const result = h("div", {id: `${id}-result`, "aria-live": "polite"});
  const button = h("button", {type: "submit", text: submitLabel});
  const f = h("form", {id, novalidate: true}, fields, h("div", {class: "buttons"}, button), error, result);
  f.addEventListener("submit", async (e) => {
    e.preventDefault();
    error.textContent = "";
    button.disabled = true;
    try { result.replaceChildren(await onsubmit()); } catch (err) { error.textContent = err.message; } finally {
      button.disabled = false;
    }
  });
  return f;
}

function field(id, label, input, hint) {
  input.id = id;
  input.name = id;
  return [h("label", {for: id, text: label}), input, hint ? h("p", {class: "hint", text: hint}) : null];
}

const lines = (text) => text.split("\n").map((s) => s.trim()).filter(Boolean);

function barList(items) {  // [[label, score 0..1]]
  return h("ul", {class: "bars"}, items.map(([label, score]) => {
    const bar = h("div", {class: "bar", role: "img", "aria-label": fmt.percent(score)});
    bar.style.width = `${Math.max(0, Math.min(1, score)) * 100}%`;
    return h("li", {}, h("span", {text: label}), bar, h("span", {class: "num", text: fmt.percent(score)}));
  }));
}

function heatMap(names, matrix) {
  const cell = (v) => {
    const td = h("td", {text: v.toFixed(2)});
    const t = (v + 1) / 2;  // cosine -1..1 to 0..1
    td.style.backgroundColor = `hsl(${220 - 220 * t}, 70%, ${88 - 30 * t}%)`;
    return td;
  };
  return h("div", {class: "table-wrap"}, h("table", {class: "heat", "aria-label": "cosine similarity"},
    h("thead", {}, h("tr", {}, h("th", {}), names.map((_, j) => h("th", {scope: "col", text: `#${j + 1}`})))),
    h("tbody", {}, matrix.map((row, i) => h("tr", {}, h("th", {scope: "row", text: `#${i + 1} ${names[i]}`}),
      row.map(cell))))));
}

async function playgroundPage(name) {
  if (!name) { location.hash = "#/models"; return; }
  const m = await api(`/models/${encodeURIComponent(name)}`);
  const sections = [h("p", {class: "hint"}, `${m.architecture || "?"} · heads: ${m.heads.join(", ") || "none"} · `,
                        `${fmt.count(m.num_parameters)} parameters · ${m.precision}`)];
  const beforeAfter = (m.card && m.card.before_after) || [];  // the job's metrics, base model and fine-tuned
  if (beforeAfter.length) {
    sections.push(h("section", {class: "card", id: "before-after"}, h("h2", {text: "Training: before and after"}),
      h("div", {class: "table-wrap"}, h("table", {},
        h("thead", {}, h("tr", {}, ["Metric", "Base model", "Trained"].map((t) => h("th", {scope: "col", text: t})))),
        h("tbody", {}, beforeAfter.map((r) => h("tr", {}, h("th", {scope: "row", text: r.metric}),
          h("td", {class: "num", text: fmt.num(r.before)}), h("td", {class: "num", text: fmt.num(r.after)}))))))));
  }
  if (m.heads.includes("mlm")) {
    sections.push(h("section", {class: "card"}, h("h2", {text: "Fill-mask"}), form("fill-mask", [
      field("fm-text", "Texts, one per line, each with one or more [MASK]",
            h("textarea", {}, "the cat sat on the [MASK] .")),
      field("fm-topk", "Candidates per [MASK]", h("input", {type: "number", min: 1, max: 100, value: 5})),
    ], "Fill", async () => {
      const inputs = lines(document.getElementById("fm-text").value);
      const topK = Number(document.getElementById("fm-topk").value);
      const out = await api("/fill-mask", {method: "POST", json: {inputs, top_k: topK, model: name}});
      return h("div", {}, inputs.map((text, i) => {
        const masks = Array.isArray(out[i][0]) ? out[i] : [out[i]];
        return h("div", {class: "fill-result"}, h("p", {}, h("code", {text})),
          masks.map((cands, k) => h("div", {}, h("p", {class: "hint", text: `[MASK] ${k + 1}`}),
            barList(cands.map((c) => [c.token_str, c.score])))));
      }));
    })));
  }
  if (m.heads.includes("nsp")) {
    sections.push(h("section", {class: "card"}, h("h2", {text: "Next sentence"}), form("nsp", [
      field("nsp-a", "Sentence A", h("input", {type: "text", value: "I went to the store."})),
      field("nsp-b", "Sentence B", h("input", {type: "text", value: "I bought a gallon of milk."})),
    ], "Score", async () => {
      const inputs = {text_a: document.getElementById("nsp-a").value, text_b: document.getElementById("nsp-b").value};
      const out = await api("/nsp", {method: "POST", json: {inputs, model: name}});
      return h("div", {}, h("p", {text: out.is_next ? "B follows A" : "B does not follow A"}),
        barList([["P(B follows A)", out.score]]));
    })));
  }
  if (m.heads.includes("classifier")) {
    sections.push(h("section", {class: "card"}, h("h2", {text: "Classification"}), form("classify", [
      field("cls-text", "Texts, one per line", h("textarea", {}, "i love this film")),
    ], "Classify", async () => {
      const inputs = lines(document.getElementById("cls-text").value);
      const out = await api("/classify", {method: "POST", json: {inputs, model: name}});
      return h("div", {}, inputs.map((text, i) => h("div", {}, h("p", {}, h("code", {text}), ` → ${out[i].label}`),
        barList(Object.entries(out[i].scores).sort((a, b) => b[1] - a[1])))));
    })));
  }
  sections.push(h("section", {class: "card"}, h("h2", {text: "Embeddings"}), form("embed", [
    field("emb-text", "Sentences, one per line (cosine similarity of every pair)",
          h("textarea", {}, "the cat sat on the mat .\na dog ran in the park .\nthe cat sat on a mat .")),
  ], "Compare", async () => {
    const inputs = lines(document.getElementById("emb-text").value);
    const vectors = await api("/embeddings", {method: "POST", json: {inputs, model: name, normalize: true}});
    const dot = (a, b) => a.reduce((s, x, i) => s + x * b[i], 0);
    return heatMap(inputs, vectors.map((a) => vectors.map((b) => dot(a, b))));
  })));
  show(`Playground: ${name}`, ...sections);
}

// -- jobs list -------------------------------------------------------------------------------------

// A training job counts steps, a batch lines; an import counts the bytes it has downloaded.
function progressOf(job) {
  if (job.kind === "import") {
    const done = job.downloaded_bytes || 0, total = job.total_bytes || 0;
    return {value: done, max: total || 1, text: total ? `${fmt.bytes(done)} / ${fmt.bytes(total)}` : "–",
            label: `${fmt.bytes(done)} of ${fmt.bytes(total)} downloaded`};
  }
  // a batch's steps are its input lines, a mining job's the texts it has embedded
  const unit = job.kind === "batch" ? "lines" : job.kind === "mine-negatives" ? "texts" : "steps";
  return {value: job.step, max: job.total_steps, text: `${job.step} / ${job.total_steps}`,
          label: `${job.step} of ${job.total_steps} ${unit}`};
}

function progressCell(job) {
  const p = progressOf(job);
  return h("progress", {max: p.max, value: p.value, "aria-label": p.label});
}

async function jobsPage() {
  const body = h("tbody", {});
  const note = h("p", {class: "live"});
  show("Jobs", h("p", {}, h("a", {href: "#/new", text: "Start a new job"})),
    h("div", {class: "table-wrap"}, h("table", {id: "jobs-table"},
      h("thead", {}, h("tr", {}, ["Job", "Model", "State", "Progress", "Step", "Loss", "Throughput", "ETA",
                                  "Created"].map((t, i) =>
        h("th", {scope: "col", class: [4, 5, 6, 7].includes(i) ? "num" : i === 8 ? "hide-narrow" : null, text: t})))),
      body)), note);
  let timer = null;
  const refresh = async () => {
    try {
      const {jobs} = await api("/jobs");
      body.replaceChildren(...jobs.map((j) => h("tr", {"data-job": j.id},
        h("td", {}, h("a", {href: `#/jobs/${j.id}`, text: j.id}), h("div", {class: "hint", text: j.kind})),
        h("td", {text: j.model_name ?? `dataset ${j.dataset}`}),  // a dataset import publishes no model
        h("td", {}, stateBadge(j.state)),
        h("td", {}, progressCell(j)),
        h("td", {class: "num", text: progressOf(j).text}),
        h("td", {class: "num", text: fmt.num(j.loss)}),
        h("td", {class: "num", text: fmt.rate(j.tokens_per_s)}),
        h("td", {class: "num", text: fmt.duration(j.eta_s)}),
        h("td", {class: "hide-narrow", text: fmt.time(j.created_at)}))));
      if (!jobs.length) body.replaceChildren(h("tr", {}, h("td", {colspan: 9, text: "No jobs yet."})));
      note.textContent = `Updated ${new Date().toLocaleTimeString()}; refreshed every 2 s.`;
      timer = setTimeout(refresh, 2000);
    } catch (err) {
      note.replaceChildren(failure(err));  // a 401 stops here: the dialog asks, route() reruns
    }
  };
  onLeave(() => clearTimeout(timer));
  await refresh();
}

// -- one job ---------------------------------------------------------------------------------------

const CHARTS = [  // [id, title, series: [record type, key, label]]
  ["loss", "Loss", [["train", "loss", "train loss"], ["eval", "loss", "eval loss"]]],
  ["lr", "Learning rate", [["train", "lr", "lr"]]],
  ["accuracy", "Accuracy / F1", [["eval", "accuracy", "accuracy"], ["eval", "macro_f1", "macro F1"],
                                 ["eval", "mlm_accuracy", "MLM accuracy"], ["eval", "nsp_accuracy", "NSP accuracy"]]],
  ["retrieval", "Retrieval / similarity", [["eval", "cosine_ndcg@10", "NDCG@10"], ["eval", "cosine_mrr@10", "MRR@10"],
                                         ["eval", "cosine_recall@10", "recall@10"],
                                         ["eval", "spearman_cosine", "Spearman"]]],
  ["throughput", "Throughput (tokens/s)", [["train", "tokens_per_s", "tokens/s"]]],
];
const COLORS = ["#4c7be0", "#e0774c", "#3aa35b", "#a04ce0"];

class Curves {
  constructor(container) {
    this.records = [];
    this.plots = [];
    this.container = container;
    this.pending = false;
  }

  add(records) { this.records.push(...records); this.schedule(); }
  reset(records = []) { this.records = records.slice(); this.schedule(); }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => { this.pending = false; this.draw(); });
  }

  data(series) {
    const steps = [...new Set(this.records.filter((r) => series.some(([t]) => r.type === t)).map((r) => r.step))]
      .sort((a, b) => a - b);
    const index = new Map(steps.map((s, i) => [s, i]));
    const columns = series.map(() => steps.map(() => null));
    for (const r of this.records) {
      series.forEach(([type, key], k) => {
        if (r.type === type && typeof r[key] === "number" && index.has(r.step)) columns[k][index.get(r.step)] = r[key];
      });
    }
    return [steps, ...columns];
  }

  draw() {
    const trainPoints = this.records.filter((r) => r.type === "train").length;
    this.container.dataset.points = trainPoints;
    CHARTS.forEach(([id, title, series], i) => {
      const data = this.data(series);
      const shown = series.map((_, k) => data[k + 1].some((v) => v !== null));
      const box = this.container.querySelector(`[data-chart="${id}"]`);
      box.dataset.points = data[0].length;
      if (!this.plots[i]) {
        if (!data[0].length) {
          box.querySelector(".plot").textContent = ["accuracy", "retrieval"].includes(id) ? "No evaluation yet." :
            "No points yet.";
          return;
        }
        box.querySelector(".plot").textContent = "";
        const width = Math.max(260, box.clientWidth || 480);
        this.plots[i] = new uPlot({
          width, height: 200, title: undefined, scales: {x: {time: false}},
          axes: [{label: "step", stroke: "currentColor"},
                 {stroke: "currentColor", size: 84, values: (u, ticks) => ticks.map((v) => fmt.num(v, 3))}],
          series: [{label: "step"}, ...series.map(([, , label], k) => ({label, stroke: COLORS[k], width: 1.5,
                                                                          spanGaps: true, show: shown[k]}))],
        }, data, box.querySelector(".plot"));
      } else {
        this.plots[i].setData(data);
      }
    });
  }

  resize() {
    this.plots.forEach((p, i) => {
      const box = this.container.querySelector(`[data-chart="${CHARTS[i][0]}"]`);
      if (p) p.setSize({width: Math.max(260, box.clientWidth), height: 200});
    });
  }

  destroy() { this.plots.forEach((p) => p && p.destroy()); }
}

// Server-Sent Events over fetch (a header can carry the key; EventSource cannot).
async function followEvents(jobId, handlers, signal) {
  const r = await fetch(`/jobs/${jobId}/events`, {headers: {...authHeaders("/jobs"), Accept: "text/event-stream"},
                                                 cache: "no-store", credentials: "omit", signal});
  if (!r.ok) {
    let body = null;
    try { body = await r.json(); } catch (e) { body = null; }
    throw new ApiError(r.status, body);
  }
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return false;  // closed without an `end`: the stream dropped
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (!data) continue;  // a keep-alive comment
      const payload = JSON.parse(data);
      if (handlers[event]) handlers[event](payload);
      if (event === "end") return true;
    }
  }
}

async function jobPage(jobId) {
  const job = await api(`/jobs/${jobId}`);
  const facts = h("dl", {class: "facts", id: "job-facts"});
  const progress = h("progress", {id: "job-progress", max: 1, value: 0});
  const live = h("p", {class: "live", id: "job-live"});
  const cancelError = h("p", {class: "error", role: "alert", id: "cancel-error"});
  const cancel = h("button", {type: "button", class: "danger", id: "cancel-job", text: "Cancel job"});
  const events = h("tbody", {});
  const checkpoint = h("p", {id: "job-checkpoint"});
  const charts = h("div", {class: "charts", id: "charts"}, CHARTS.map(([id, title]) =>
    h("section", {class: "card chart", "data-chart": id}, h("h3", {text: title}), h("div", {class: "plot"}))));
  show(`Job ${jobId}`, h("p", {}, h("a", {href: "#/jobs", text: "← all jobs"})),
    h("section", {class: "card"}, facts, progress, live, h("div", {class: "buttons"}, cancel), cancelError), charts,
    h("h2", {text: "Checkpoints and result"}), checkpoint,
    h("h2", {text: "Events"}), h("div", {class: "table-wrap"}, h("table", {},
      h("thead", {}, h("tr", {}, ["Time", "Event", "Detail"].map((t) => h("th", {scope: "col", text: t})))), events)));

  let current = job;
  const render = (j) => {
    current = j;
    const fact = (label, value) => h("div", {}, h("dt", {text: label}), h("dd", {}, value));
    facts.replaceChildren(
      fact("State", stateBadge(j.state)), fact("Kind", j.kind), fact("Model", j.model_name ?? "–"),
      fact("Base model", j.base_model || "from scratch"), fact("Dataset", j.dataset),
      fact(j.kind === "import" ? "Downloaded" : j.kind === "batch" ? "Lines" : "Step", progressOf(j).text), fact("Loss", fmt.num(j.loss)), fact("Learning rate", fmt.num(j.lr, 3)),
      fact("Throughput", fmt.rate(j.tokens_per_s)), fact("ETA", fmt.duration(j.eta_s)),
      fact("Attempts", String(j.attempts)), fact("Runtime", fmt.duration(j.runtime_s)),
      fact("Created", fmt.time(j.created_at)), fact("Finished", fmt.time(j.finished_at)),
      fact("Priority", String(j.priority)),
      ...(j.phase ? [fact("Doing", j.phase)] : []),  // before its first step report
      ...(j.queue_position ? [fact("In line", `#${j.queue_position}, waiting for ${j.waiting_for}` +
        (j.start_estimate_s == null ? "" : ` (starts in about ${fmt.duration(j.start_estimate_s)})`))] : []));
    const p = progressOf(j);
    progress.max = p.max;
    progress.value = p.value;
    progress.setAttribute("aria-label", p.label);
    const finished = ["succeeded", "failed", "cancelled"].includes(j.state);
    cancel.disabled = finished || j.cancel_requested;
    cancel.textContent = j.cancel_requested && !finished ? "Cancel requested…" : "Cancel job";
    const result = !j.result ? "" : j.result.dataset ? ` · imported dataset ${j.result.dataset}`
      : ` · published ${j.result.model || j.model_name}`;
    checkpoint.textContent = `Latest checkpoint: ${j.latest_checkpoint || "none yet"}${result}` +
      (j.error ? ` · error: ${j.error}` : "");
    events.replaceChildren(...j.events.slice().reverse().map((e) => h("tr", {},
      h("td", {text: fmt.time(e.at)}), h("td", {text: e.event}), h("td", {text: e.detail || ""}))));
  };
  render(job);
  cancel.addEventListener("click", async () => {
    cancelError.textContent = "";
    try { render(await api(`/jobs/${jobId}/cancel`, {method: "POST"})); } catch (err) {
      cancelError.textContent = err.message;
    }
  });

  const curves = new Curves(charts);
  const controller = new AbortController();
  let timer = null;
  const onResize = () => curves.resize();
  window.addEventListener("resize", onResize);
  onLeave(() => {
    controller.abort(); clearTimeout(timer); window.removeEventListener("resize", onResize); curves.destroy();
  });

  const poll = async () => {  // the fallback: the record and the whole curve every 2 s
    try {
      const [j, m] = await Promise.all([api(`/jobs/${jobId}`), api(`/jobs/${jobId}/metrics`)]);
      render(j);
      curves.reset(m.records);
      if (["succeeded", "failed", "cancelled"].includes(j.state)) { live.textContent = "Finished."; return; }
      timer = setTimeout(poll, 2000);
    } catch (err) {
      if (!controller.signal.aborted) live.replaceChildren(failure(err));
    }
  };
  const handlers = {
    progress: render,
    metrics: (record) => curves.add([record]),
    reset: () => curves.reset(),
    end: (e) => { live.textContent = `Finished: ${e.state}.`; },
  };
  live.textContent = "Live (event stream).";
  followEvents(jobId, handlers, controller.signal).then((ended) => {
    if (!ended && !controller.signal.aborted) { live.textContent = "Stream closed; polling every 2 s."; poll(); }
  }, (err) => {
    if (controller.signal.aborted) return;
    if (err instanceof ApiError && err.status === 401) { live.replaceChildren(failure(err)); askForKeys(err.message); return; }
    live.textContent = "Stream unavailable; polling every 2 s.";
    poll();
  });
}

// -- new job ---------------------------------------------------------------------------------------

// GET /console/job-form.json: the parameters per kind, as the API declares them, and the dataset kinds each
// task trains on (dataset_kinds).
let jobForm = null;

async function newJobPage() {
  jobForm = jobForm || await (await fetch("/console/job-form.json", {credentials: "omit"})).json();
  const [{models}, {datasets}] = await Promise.all([api("/models"), api("/datasets")]);
  const kind = h("select", {}, h("option", {value: "finetune", text: "fine-tune (classifier, NER tagger, QA, sentence embeddings)"}),
                 h("option", {value: "pretrain", text: "pretrain (MLM, NSP)"}));
  const base = h("select", {});
  const dataset = h("select", {});
  const params = h("div", {class: "grid", id: "params"});
  const formError = h("p", {class: "error", role: "alert", id: "job-form-error"});
  const errorSlot = (name) => h("p", {class: "error field-error", id: `err-${name}`, role: "alert"});
  const top = [
    ...field("kind", "Kind", kind),
    ...field("model_name", "Name of the model to publish", h("input", {type: "text", required: true,
                                                                        "aria-describedby": "err-model_name"})),
    errorSlot("model_name"),
    ...field("base_model", "Base model", base), errorSlot("base_model"),
    ...field("dataset", "Dataset", dataset), errorSlot("dataset"),
  ];

  // A fine-tuning option whose default depends on the task carries task_defaults (the API's x-task-defaults).
  const defaultOf = (p, task) => (p.task_defaults ? p.task_defaults[task || "sequence-classification"] : p.default);
  const fill = () => {
    const k = kind.value;
    base.replaceChildren(...(k === "pretrain" ? [h("option", {value: "", text: "— none: from scratch —"})] : []),
      ...models.filter((m) => !m.error).map((m) => h("option", {value: m.name, text: m.name})));
    params.replaceChildren(...jobForm[k].map((p) => {
      const id = `params.${p.name}`;
      let input;
      if (p.type === "boolean" || p.type === "enum") {
        const options = p.type === "boolean" ? ["true", "false"] : p.enum;
        input = h("select", {}, h("option", {value: "", text: `default (${defaultOf(p) ?? "unset"})`}),
                  options.map((o) => h("option", {value: o, text: o})));
      } else {
        input = h("input", {type: "text", inputmode: p.type === "integer" ? "numeric" : null,
                            placeholder: String(defaultOf(p) ?? "unset")});
      }
      input.setAttribute("aria-describedby", `err-${id} hint-${id}`);
      const bounds = [p.minimum !== undefined ? `≥ ${p.minimum}` : null, p.exclusiveMinimum !== undefined ?
        `> ${p.exclusiveMinimum}` : null, p.maximum !== undefined ? `≤ ${p.maximum}` : null].filter(Boolean).join(", ");
      const hint = [`default: ${defaultOf(p) ?? "unset"}`, bounds, p.description].filter(Boolean).join(" · ");
      return h("div", {}, h("label", {for: id, text: p.name}), Object.assign(input, {id, name: id}),
               h("p", {class: "hint", id: `hint-${id}`, text: hint}), errorSlot(id));
    }));
  };
  // The datasets a job can use: a corpus to pretrain, else the kinds its params.task trains on.
  const fillDatasets = () => {
    const task = params.querySelector('[id="params.task"]');
    const wanted = jobForm.dataset_kinds[kind.value === "pretrain" ? "pretrain" :
                                         (task && task.value) || "sequence-classification"];
    dataset.replaceChildren(...datasets.filter((d) => wanted.includes(d.kind)).map((d) =>
      h("option", {value: d.name, text: `${d.name} (${d.kind})`})));
    if (!dataset.options.length) {
      dataset.append(h("option", {value: "", text: `no ${wanted.join(" or ")} dataset: upload one`}));
    }
  };
  // The task's own defaults, in the placeholders and hints of the options that have one per task.
  const fillTaskDefaults = () => {
    const task = params.querySelector('[id="params.task"]');
    for (const p of jobForm[kind.value].filter((p) => p.task_defaults)) {
      const shown = String(defaultOf(p, task && task.value) ?? "unset");
      params.querySelector(`[id="params.${p.name}"]`).placeholder = shown;
      const hint = params.querySelector(`[id="hint-params.${p.name}"]`);
      hint.textContent = hint.textContent.replace(/^default: [^·]*·/, `default: ${shown} ·`);
    }
  };
  const refill = () => {
    fill();
    fillDatasets();
    const task = params.querySelector('[id="params.task"]');
    if (task) task.addEventListener("change", () => { fillDatasets(); fillTaskDefaults(); });
  };
  kind.addEventListener("change", refill);
  refill();

  const submit = h("button", {type: "submit", id: "submit-job", text: "Start job"});
  const f = h("form", {id: "new-job", novalidate: true}, h("section", {class: "card"}, top),
              h("section", {class: "card"}, h("h2", {text: "Parameters"}),
                h("p", {class: "hint", text: "Empty fields take the default shown."}), params, errorSlot("params")),
              h("div", {class: "buttons"}, submit), formError);
  f.addEventListener("submit", async (e) => {
    e.preventDefault();
    for (const el of f.querySelectorAll(".field-error")) el.textContent = "";
    for (const el of f.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
    formError.textContent = "";
    const k = kind.value;
    const body = {kind: k, model_name: f.elements.model_name.value.trim(), dataset: dataset.value};
    if (base.value) body.base_model = base.value;
    const p = {};
    for (const spec of jobForm[k]) {
      const raw = f.elements[`params.${spec.name}`].value.trim();
      if (raw === "") continue;
      let value = raw;  // what does not parse goes as typed, so the API's message names it
      if (spec.type === "boolean") value = raw === "true";
      else if (spec.type === "integer" && /^-?\d+$/.test(raw)) value = Number(raw);
      else if (spec.type === "number" && raw !== "" && Number.isFinite(Number(raw))) value = Number(raw);
      else if (spec.type === "duration" && /^\d+$/.test(raw)) value = Number(raw);
      else if (spec.type === "array") {  // comma-separated items: "384, 256" -> [384, 256]
        value = raw.split(",").map((s) => s.trim()).filter(Boolean)
          .map((s) => (spec.items.type === "integer" && /^-?\d+$/.test(s) ? Number(s) : s));
      }
      const path = spec.name.split(".");
      let target = p;
      for (const part of path.slice(0, -1)) target = target[part] = target[part] || {};
      target[path[path.length - 1]] = value;
    }
    body.params = p;
    submit.disabled = true;
    try {
      const created = await api("/jobs", {method: "POST", json: body});
      location.hash = `#/jobs/${created.id}`;
    } catch (err) {
      // 422: a field's value; 409: a field's name is taken (a model a job is already training)
      if (err.status === 422 || err.status === 409) showFieldErrors(f, err.message, formError);
      else formError.textContent = err.message;
    } finally {
      submit.disabled = false;
    }
  });
  show("New job", f);
}

// "finetune.params.max_steps: Input should be ...; model_name: ..." -> beside each field it names.
function showFieldErrors(f, message, formError) {
  const slots = [...f.querySelectorAll(".field-error")].map((el) => el.id.slice(4));
  // Parts are joined by "; " (app/errors.py); a message may hold "; " itself, so split only before a location.
  for (const part of message.split(/; (?=(?:(?:finetune|pretrain)\.)?[\w.]+: )/)) {
    const m = /^(?:(?:finetune|pretrain)\.)?([\w.]+): ([\s\S]*)$/.exec(part);
    const path = m ? m[1] : null;
    const name = path && slots.filter((s) => path === s || path.startsWith(`${s}.`))
      .sort((a, b) => b.length - a.length)[0];
    if (!name) { formError.textContent += (formError.textContent ? "; " : "") + part; continue; }
    const slot = document.getElementById(`err-${name}`);
    slot.textContent = part;
    const input = document.getElementById(name);
    if (input) input.setAttribute("aria-invalid", "true");
  }
  const first = f.querySelector("[aria-invalid='true']");
  if (first) first.focus();
}

// -- datasets --------------------------------------------------------------------------------------

function upload(formData, onProgress) {  // XMLHttpRequest: fetch cannot report upload progress
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", "/datasets");
    for (const [k, v] of Object.entries(authHeaders("/datasets"))) xhr.setRequestHeader(k, v);
    xhr.upload.onprogress = (e) => { if (e.lengthComputable) onProgress(e.loaded / e.total); };
    xhr.onload = () => {
      let body = null;
      try { body = JSON.parse(xhr.responseText); } catch (e) { body = null; }
      if (xhr.status >= 200 && xhr.status < 300) { resolve(body); return; }
      const err = new ApiError(xhr.status, body);
      if (xhr.status === 401) askForKeys(err.message);
      reject(err);
    };
    xhr.onerror = () => reject(new Error("the upload failed (network)"));
    xhr.send(formData);
  });
}

async function datasetsPage() {
  const {datasets} = await api("/datasets");
  const counts = (d) => d.kind === "labelled" ? `${fmt.count(d.rows)} rows${d.is_pair ? " (pairs)" : ""}` :
    d.kind === "token-labelled" ? `${fmt.count(d.sentences)} sentences, ${fmt.count(d.tokens)} tokens` :
    d.kind === "qa" ? `${fmt.count(d.questions)} questions (${fmt.count(d.impossible)} impossible)` :
    d.kind === "pairs" ? `${fmt.count(d.rows)} rows, ${fmt.count(d.negatives)} hard negatives each` :
    d.kind === "scored-pairs" ? `${fmt.count(d.rows)} rows, mean score ${fmt.num(d.mean_score)}` :
    d.kind === "retrieval" ? `${fmt.count(d.queries)} queries, ${fmt.count(d.documents)} documents, ` +
      `${fmt.count(d.judgements)} judgements (${d.split})` :
    `${fmt.count(d.documents)} documents, ${fmt.count(d.sentences)} sentences`;
  const tally = (c) => Object.entries(c).map(([l, n]) => `${l} (${n})`).join(", ");
  const labels = (d) => d.label_counts ? tally(d.label_counts) : d.entity_counts ? tally(d.entity_counts) :
    (d.labels || []).join(", ") || "–";
  const table = h("div", {class: "table-wrap"}, h("table", {id: "datasets-table"},
    h("thead", {}, h("tr", {}, ["Name", "Kind", "Contents", "Labels", "Size", "Uploaded"].map((t, i) =>
      h("th", {scope: "col", class: i === 4 ? "num" : i === 5 ? "hide-narrow" : null, text: t})))),
    h("tbody", {}, datasets.length ? datasets.map((d) => h("tr", {"data-dataset": d.name},
      h("td", {text: d.name}), h("td", {text: `${d.kind} (${d.format})`}), h("td", {text: counts(d)}),
      h("td", {text: labels(d)}), h("td", {class: "num", text: fmt.bytes(d.bytes)}),
      h("td", {class: "hide-narrow", text: fmt.time(d.created_at)}))) :
      h("tr", {}, h("td", {colspan: 6, text: "No datasets yet."})))));
  const bar = h("progress", {id: "upload-progress", max: 1, value: 0, hidden: true, "aria-label": "upload progress"});
  const uploadForm = form("upload", [
    field("upload-file", "File (.txt or .jsonl corpus; .csv, .tsv or .jsonl with text,label; CoNLL or .jsonl with " +
          "tokens,tags; SQuAD .json; .csv, .tsv or .jsonl with anchor,positive[,negative] or " +
          "sentence1,sentence2,score; a .zip or .tar.gz of a BEIR folder)",
          h("input", {type: "file", accept: ".txt,.jsonl,.csv,.tsv,.conll,.iob,.iob2,.bio,.json,.zip,.tar.gz,.tgz,.tar"})),
    field("upload-name", "Name (empty: the file name's stem)", h("input", {type: "text"})),
    field("upload-kind", "Kind", h("select", {}, h("option", {value: "", text: "from the file"}),
                                   h("option", {value: "corpus", text: "corpus"}),
                                   h("option", {value: "labelled", text: "labelled"}),
                                   h("option", {value: "token-labelled", text: "token-labelled (NER)"}),
                                   h("option", {value: "qa", text: "qa (SQuAD)"}),
                                   h("option", {value: "pairs", text: "pairs (anchor, positive, negatives)"}),
                                   h("option", {value: "scored-pairs", text: "scored-pairs (sentence1, sentence2, score)"}),
                                   h("option", {value: "retrieval", text: "retrieval (evaluation: BEIR)"}))),
    bar,
  ], "Upload", async () => {
    const file = document.getElementById("upload-file").files[0];
    if (!file) throw new Error("choose a file first");
    const data = new FormData();
    data.append("file", file);
    const name = document.getElementById("upload-name").value.trim();
    const kind = document.getElementById("upload-kind").value;
    if (name) data.append("name", name);
    if (kind) data.append("kind", kind);
    bar.hidden = false;
    const meta = await upload(data, (fraction) => { bar.value = fraction; });
    bar.value = 1;
    setTimeout(route, 300);
    return h("p", {text: `Uploaded ${meta.name}: ${counts(meta)}.`});
  });
  show("Datasets", table, h("section", {class: "card"}, h("h2", {text: "Upload"}), uploadForm));
}

// -- start -----------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("keys-form").addEventListener("submit", useKeys);
  document.getElementById("keys-cancel").addEventListener("click", () => dialog().close());
  document.getElementById("keys-button").addEventListener("click", () => askForKeys(""));
  window.addEventListener("hashchange", route);
  route();
});
