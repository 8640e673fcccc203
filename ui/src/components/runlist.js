// The run list: filters, search (run id, a prefix of one, or an idempotency key), cursor paging, live.
import { useEffect, useRef, useState } from "preact/hooks";
import { html } from "../lib/html.js";
import { ApiError, enc, get } from "../lib/api.js";
import { between, shortId } from "../lib/format.js";
import { href, navigate, runHref } from "../lib/router.js";
import { useLive } from "../lib/live.js";
import { Badge, Duration, Notice, Time } from "./common.js";

const FILTERS = {
  phase: ["running", "settling", "compensating", "finished"],
  outcome: ["completed", "failed", "cancelled", "timed_out"],
  recovery: ["pending", "compensating", "not_required", "compensated", "partially_compensated"],
  blocked: ["true", "false"],
};
const PAGE = 50;
const PREFIX_PAGES = 5; // as the CLI: a prefix is looked up among the newest runs

function filtersOf(params) {
  const out = {};
  for (const name of ["function_id", ...Object.keys(FILTERS)]) if (params[name]) out[name] = params[name];
  return out;
}

// What the search finds: the run with that id, runs whose id starts with it, runs started with it as their
// idempotency key (of the function filtered on, or of every function).
async function search(q, filters, functions) {
  const found = new Map();
  const add = (run) => found.set(run.id, run);
  for (const id of q.startsWith("run_") ? [q] : [q, `run_${q}`]) {
    try {
      const run = await get(`/v1/runs/${enc(id)}`);
      add({ ...run, steps: run.steps.length, blocked: run.blockers.length > 0 });
    } catch (e) {
      if (!(e instanceof ApiError) || e.status !== 404) throw e;
    }
  }
  const ids = filters.function_id ? [filters.function_id] : functions.map((f) => f.id);
  for (const function_id of ids) {
    const page = await get("/v1/runs", { ...filters, function_id, idempotency_key: q });
    page.runs.forEach(add);
  }
  const prefix = q.startsWith("run_") ? q : `run_${q}`;
  let cursor = null;
  for (let i = 0; i < PREFIX_PAGES; i++) {
    const page = await get("/v1/runs", { ...filters, limit: 200, cursor });
    page.runs.filter((r) => r.id.startsWith(prefix) || r.id.startsWith(q)).forEach(add);
    cursor = page.cursor;
    if (!cursor) break;
  }
  return [...found.values()];
}

export function RunList({ params, functions }) {
  const filters = filtersOf(params);
  const q = params.q || "";
  const cursor = params.cursor || null;
  const [data, setData] = useState({ runs: null, cursor: null, error: null });
  const [text, setText] = useState(q);
  const key = JSON.stringify([filters, q, cursor]);

  const current = useRef(key);
  current.current = key;
  const load = async () => {
    const asked = key;
    try {
      let next;
      if (q) next = { runs: await search(q, filters, functions), cursor: null };
      else {
        const page = await get("/v1/runs", { ...filters, limit: PAGE, cursor });
        next = { runs: page.runs, cursor: page.cursor };
      }
      if (current.current === asked) setData({ ...next, error: null, key: asked });
    } catch (error) {
      if (current.current === asked) setData((d) => ({ ...d, error }));
    }
  };
  useEffect(() => {
    setText(q);
    setData((d) => (d.key === key ? d : { runs: null, cursor: null, error: null, key }));
    load();
  }, [key]);
  useEffect(() => {
    if (q && functions.length) load(); // a search by idempotency key asks every function
  }, [functions.length]);
  // a run shown changed, or a new run may belong on the newest page
  useLive((event) => (data.runs || []).some((r) => r.id === event.run_id) || (!cursor && !q), load, [key]);

  const set = (changes) => {
    const next = { ...filters, q, ...changes };
    if (!("cursor" in changes)) delete next.cursor;
    else next.cursor = changes.cursor;
    navigate(href("/runs", next));
  };

  return html`<section class="panel runs">
    <form class="filters" onSubmit=${(e) => { e.preventDefault(); set({ q: text.trim() }); }}>
      <label>function
        <select name="function_id" value=${filters.function_id || ""} onChange=${(e) => set({ function_id: e.currentTarget.value })}>
          <option value="">all</option>
          ${functions.map((f) => html`<option value=${f.id}>${f.id}</option>`)}
        </select></label>
      ${Object.entries(FILTERS).map(
        ([name, values]) => html`<label>${name}
          <select name=${name} value=${filters[name] || ""} onChange=${(e) => set({ [name]: e.currentTarget.value })}>
            <option value="">any</option>
            ${values.map((v) => html`<option value=${v}>${v.replace(/_/g, " ")}</option>`)}
          </select></label>`,
      )}
      <label class="grow">search
        <input name="q" type="search" placeholder="run id, a prefix of one, or an idempotency key" value=${text}
          onInput=${(e) => setText(e.currentTarget.value)} /></label>
      <button type="submit">Search</button>
      ${Object.keys(filters).length || q ? html`<a class="button link" href="#/runs">clear</a>` : ""}
    </form>
    <${Notice} error=${data.error} />
    ${q ? html`<p class="muted">Search results for <code>${q}</code> (id, id prefix among the newest runs, idempotency key)</p>` : ""}
    ${data.runs === null
      ? html`<p class="muted">loading…</p>`
      : data.runs.length === 0
        ? html`<p class="empty">No runs${Object.keys(filters).length || q ? " match" : " yet: start one from "}${Object.keys(filters).length || q ? "" : html`<a href="#/functions">Functions</a>`}.</p>`
        : html`<table class="runs-table">
            <thead><tr><th>run</th><th>function</th><th>status</th><th>summary</th><th class="num">steps</th><th>created</th><th class="num">duration</th></tr></thead>
            <tbody>${data.runs.map((r) => html`<${RunRow} key=${r.id} run=${r} />`)}</tbody>
          </table>`}
    <nav class="pager">
      ${cursor ? html`<a class="button" href=${href("/runs", { ...filters })}>⇤ newest</a>` : ""}
      ${data.cursor && !q ? html`<a class="button" href=${href("/runs", { ...filters, cursor: data.cursor })} rel="next">older →</a>` : ""}
    </nav>
  </section>`;
}

function RunRow({ run }) {
  const ms = between(run.created_at, run.finished_at);
  return html`<tr class="run-row" data-run-id=${run.id}>
    <td><a href=${runHref(run.id)} title=${run.id}><code>${shortId(run.id)}</code></a></td>
    <td>${run.function_id}</td>
    <td class="status"><${Badge} value=${run.phase} />${run.outcome ? html` <${Badge} value=${run.outcome} />` : ""}
      ${run.recovery && run.recovery !== "not_required" ? html` <${Badge} value=${run.recovery} />` : ""}
      ${run.blocked ? html` <span class="badge s-blocked">blocked</span>` : ""}</td>
    <td class="summary">${run.summary}</td>
    <td class="num">${run.steps}</td>
    <td><${Time} at=${run.created_at} /></td>
    <td class="num">${ms === null ? html`<span class="muted">running</span>` : html`<${Duration} ms=${ms} />`}</td>
  </tr>`;
}
