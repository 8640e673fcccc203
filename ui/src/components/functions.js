// Functions with their app, timeout and newest release; start a run of one.
import { useState } from "preact/hooks";
import { html } from "../lib/html.js";
import { enc, post } from "../lib/api.js";
import { formatDuration, shellQuote } from "../lib/format.js";
import { navigate, runHref } from "../lib/router.js";
import { Cli, JsonEditor, Notice, Time, jsonProblem } from "./common.js";

export function FunctionsPage({ functions, apps, error }) {
  const [chosen, setChosen] = useState(null);
  return html`<section class="panel functions">
    <h2>Functions</h2>
    <${Notice} error=${error} />
    <table class="functions-table">
      <thead><tr><th>function</th><th>app</th><th>timeout</th><th>newest release</th><th>synced</th><th></th></tr></thead>
      <tbody>${functions.map((f) => html`<tr key=${`${f.app_id}/${f.id}`} data-function-id=${f.id}>
        <td><b>${f.id}</b></td><td>${f.app_id}</td>
        <td>${f.timeout_s ? formatDuration(f.timeout_s * 1000) : html`<span class="muted">none</span>`}</td>
        <td><code title=${`build ${f.release.build_id}`}>${f.release.release_id}</code><div class="muted small">${f.release.url}</div></td>
        <td><${Time} at=${f.release.synced_at} /></td>
        <td><button type="button" onClick=${() => setChosen(f.id)}>Start a run…</button>
          <a class="button link" href=${`#/runs?function_id=${enc(f.id)}`}>runs</a></td>
      </tr>`)}</tbody>
    </table>
    ${functions.length === 0 ? html`<p class="empty">No functions: start <code>ryusen dev APP</code> with an app, or sync one (<code>ryusen sync URL</code>).</p>` : ""}
    ${chosen ? html`<${StartForm} key=${chosen} functionId=${chosen} />` : ""}
    ${apps.length ? html`<h2>Apps</h2><table class="apps-table"><thead><tr><th>app</th><th>release</th><th>build</th><th>url</th><th>synced</th><th>signed</th></tr></thead>
      <tbody>${apps.map((a) => html`<tr key=${a.app_id}><td>${a.app_id}</td><td><code>${a.release_id}</code></td><td><code>${a.build_id}</code></td>
        <td class="small">${a.url}</td><td><${Time} at=${a.synced_at} /></td><td>${a.signed ? "yes" : "no"}</td></tr>`)}</tbody></table>` : ""}
  </section>`;
}

export function StartForm({ functionId, input: initial = "{}" }) {
  const [input, setInput] = useState(initial);
  const [key, setKey] = useState("");
  const [timeout, setTimeout_] = useState("");
  const [state, setState] = useState({ busy: false, error: null });
  const problem = jsonProblem(input) || (timeout && !(Number(timeout) > 0) ? "timeout: a number of seconds above 0" : null);
  const submit = async (e) => {
    e.preventDefault();
    setState({ busy: true, error: null });
    const body = { input: JSON.parse(input) };
    if (key.trim()) body.idempotency_key = key.trim();
    if (timeout) body.timeout_s = Number(timeout);
    try {
      const run = await post(`/v1/functions/${enc(functionId)}/runs`, body);
      navigate(runHref(run.id));
    } catch (error) {
      setState({ busy: false, error });
    }
  };
  let cli = `ryusen run ${functionId} --input ${shellQuote(jsonProblem(input) ? input : JSON.stringify(JSON.parse(input)))}`;
  if (key.trim()) cli += ` --idempotency-key ${shellQuote(key.trim())}`;
  if (timeout) cli += ` --timeout ${timeout}`;
  return html`<form class="action start" data-action="start" onSubmit=${submit}>
    <h3>Start a run of <code>${functionId}</code></h3>
    <${JsonEditor} name="input" label="input (JSON)" value=${input} onInput=${setInput} rows=${6} />
    <div class="row">
      <label class="field grow"><span>idempotency key <span class="muted">(optional: the same key returns the same run)</span></span>
        <input name="idempotency_key" value=${key} onInput=${(e) => setKey(e.currentTarget.value)} /></label>
      <label class="field"><span>run timeout, s <span class="muted">(optional)</span></span>
        <input name="timeout_s" inputmode="decimal" value=${timeout} onInput=${(e) => setTimeout_(e.currentTarget.value)} /></label>
    </div>
    <button type="submit" disabled=${state.busy || !!problem}>Start run</button>
    ${problem && !jsonProblem(input) ? html`<span class="problem">${problem}</span>` : ""}
    <${Cli} command=${cli} />
    <${Notice} error=${state.error} />
  </form>`;
}
