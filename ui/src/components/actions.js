// Operator actions, each with a reason that is recorded, a JSON editor where a value is given, and the same
// action on the command line beside it.
import { useState } from "preact/hooks";
import { html } from "../lib/html.js";
import { enc, post } from "../lib/api.js";
import { formatJson, shellQuote } from "../lib/format.js";
import { Cli, JsonEditor, Notice, jsonProblem } from "./common.js";

function useSubmit(onDone) {
  const [state, setState] = useState({ busy: false, error: null, ok: null });
  const submit = async (path, body, ok) => {
    setState({ busy: true, error: null, ok: null });
    try {
      const run = await post(path, body);
      setState({ busy: false, error: null, ok });
      onDone && onDone(run);
    } catch (error) {
      setState({ busy: false, error, ok: null });
    }
  };
  return [state, submit];
}

function Reason({ value, onInput, placeholder }) {
  return html`<label class="field"><span>reason <span class="muted">(recorded)</span></span>
    <textarea name="reason" rows="2" maxlength="1024" placeholder=${placeholder} value=${value}
      onInput=${(e) => onInput(e.currentTarget.value)}></textarea></label>`;
}

export function CancelForm({ run, onDone }) {
  const [reason, setReason] = useState("");
  const [state, submit] = useSubmit(onDone);
  const cli = `ryusen cancel ${run.id}${reason.trim() ? ` --reason ${shellQuote(reason.trim())}` : ""}`;
  return html`<form class="action" data-action="cancel" onSubmit=${(e) => {
    e.preventDefault();
    submit(`/v1/runs/${enc(run.id)}/cancel`, { reason: reason.trim() || null }, "Stop intent recorded: the run settles, then compensates.");
  }}>
    <p class="muted small">Cancelling stops new forward work; attempts already authorized settle, then completed steps are
      compensated, newest first. It cannot be undone.</p>
    <${Reason} value=${reason} onInput=${setReason} placeholder="why this run is cancelled" />
    <button class="danger" type="submit" disabled=${state.busy || !reason.trim()}>Cancel run</button>
    <${Cli} command=${cli} />
    <${Notice} error=${state.error} ok=${state.ok} />
  </form>`;
}

export function RediscoverButton({ run, onDone }) {
  const [state, submit] = useSubmit(onDone);
  return html`<div class="action" data-action="rediscover">
    <button type="button" disabled=${state.busy} onClick=${() => submit(`/v1/runs/${enc(run.id)}/rediscover`, {}, "Rediscovery queued.")}>
      Rediscover</button>
    <${Cli} command=${`ryusen rediscover ${run.id}`} />
    <${Notice} error=${state.error} ok=${state.ok} />
  </div>`;
}

export function ResolveForm({ run, stepId, phase, generation, onDone, initial = "succeed" }) {
  const [action, setAction] = useState(initial);
  const [result, setResult] = useState("{}");
  const [message, setMessage] = useState("");
  const [type, setType] = useState("declared_failure");
  const [final, setFinal] = useState(false);
  const [reason, setReason] = useState("");
  const [state, submit] = useSubmit(onDone);
  const actions = phase === "compensation" ? ["succeed", "fail", "retry", "skip"] : ["succeed", "fail", "retry"];
  const problem = action === "succeed" ? jsonProblem(result) : action === "fail" && !message.trim() ? "a message is needed" : null;
  let cli = `ryusen resolve ${run.id} ${shellQuote(stepId)} --phase ${phase} --generation ${generation}`;
  if (action === "succeed") cli += ` --succeed ${shellQuote(problem ? result : formatJson(JSON.parse(result), 0))}`;
  if (action === "fail") cli += ` --fail ${shellQuote(message || "MESSAGE")}${final ? " --final" : ""}`;
  if (action === "retry") cli += " --retry";
  if (action === "skip") cli += " --skip";
  if (reason.trim()) cli += ` --reason ${shellQuote(reason.trim())}`;
  const send = (e) => {
    e.preventDefault();
    const body = { action, reason: reason.trim() };
    if (action === "succeed") body.result = JSON.parse(result);
    if (action === "fail") body.error = { type: type.trim() || "declared_failure", message: message.trim(), retryable: !final };
    const path = `/v1/runs/${enc(run.id)}/steps/${enc(stepId)}/${phase}/${generation}/resolve`;
    submit(path, body, `Resolved ${stepId} ${phase} #${generation}: ${action}.`);
  };
  const explain = {
    succeed: "It happened: record this result as the attempt's, as the external system has it.",
    fail: "It did not happen, or failed: the step's retry policy applies (unless final).",
    retry: "Run it again under the same operation id: only if the callback is safe to run twice.",
    skip: "You undid the effect yourself: the unwind moves on without running the compensator.",
  };
  return html`<form class="action resolve" data-action="resolve" onSubmit=${send}>
    <div class="choices" role="radiogroup">
      ${actions.map((a) => html`<label><input type="radio" name="action" value=${a} checked=${action === a}
        onChange=${() => setAction(a)} /> ${a}</label>`)}
    </div>
    <p class="muted small">${explain[action]}</p>
    ${action === "succeed" ? html`<${JsonEditor} name="result" label="result (JSON)" value=${result} onInput=${setResult} />` : ""}
    ${action === "fail"
      ? html`<div class="row">
          <label class="field"><span>error type</span><input name="error_type" value=${type} onInput=${(e) => setType(e.currentTarget.value)} /></label>
          <label class="field grow"><span>message</span><input name="error_message" value=${message} onInput=${(e) => setMessage(e.currentTarget.value)} /></label>
          <label class="check"><input type="checkbox" name="final" checked=${final} onChange=${(e) => setFinal(e.currentTarget.checked)} /> final (no retry)</label>
        </div>`
      : ""}
    <${Reason} value=${reason} onInput=${setReason} placeholder="how you know (a ticket, the provider's dashboard…)" />
    <button type="submit" disabled=${state.busy || !!problem || !reason.trim()}>Resolve: ${action}</button>
    ${problem && action === "fail" ? html`<span class="problem">${problem}</span>` : ""}
    <${Cli} command=${cli} />
    <${Notice} error=${state.error} ok=${state.ok} />
  </form>`;
}
