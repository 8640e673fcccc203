import { useState } from "preact/hooks";
import { html } from "../lib/html.js";
import { formatDuration, formatJson, formatTime } from "../lib/format.js";

export function Badge({ value, title }) {
  if (value === null || value === undefined) return html`<span class="badge none">–</span>`;
  return html`<span class="badge s-${value}" title=${title}>${String(value).replace(/_/g, " ")}</span>`;
}

export function Time({ at }) {
  return html`<time datetime=${at || ""}>${formatTime(at)}</time>`;
}

export function Duration({ ms }) {
  return html`<span class="dur">${formatDuration(ms)}</span>`;
}

export function Json({ value, label, open = true }) {
  if (value === undefined) return null;
  const text = formatJson(value);
  const long = text.split("\n").length > 12;
  return html`<details class="json" open=${open && !long}>
    <summary>${label || "JSON"}${long ? html` <span class="muted">(${text.split("\n").length} lines)</span>` : ""}</summary>
    <pre>${text}</pre>
  </details>`;
}

// Where an error was raised: its innermost frame, every frame when opened.
export function Traceback({ traceback }) {
  if (!traceback || !Array.isArray(traceback.frames) || !traceback.frames.length) return null;
  const frames = traceback.frames;
  const inner = frames[frames.length - 1];
  const at = (f) => `${f.file}:${f.line} in ${f.function}`;
  const lines = frames.map((f) => `  ${at(f)}${f.code ? `\n    ${f.code}` : ""}`).join("\n");
  const left = traceback.omitted
    ? `\n(${traceback.omitted} frames in Ryusen's SDK or the middle of a deep stack left out)`
    : "";
  const text = `Traceback (most recent call last):\n${lines}${left}`;
  return html`<details class="traceback">
    <summary>raised at <code>${at(inner)}</code>${inner.code ? html` <code class="muted">${inner.code}</code>` : ""}</summary>
    <pre>${text}</pre>
  </details>`;
}

export function ErrorView({ error, label }) {
  if (!error) return null;
  return html`<div class="error">
    ${label ? html`<div class="muted small">${label}</div>` : ""}
    <div><b>${error.type}</b>: ${error.message}
      ${error.retryable === false ? html` <span class="badge s-final" title="retryable: false">not retryable</span>` : ""}</div>
    ${error.data !== null && error.data !== undefined ? html`<${Json} value=${error.data} label="error data" />` : ""}
    <${Traceback} traceback=${error.traceback} />
  </div>`;
}

export function Cli({ command }) {
  return html`<div class="cli" title="The same from the command line"><span class="muted">CLI</span> <code>${command}</code></div>`;
}

export function Notice({ error, ok }) {
  if (error)
    return html`<div class="notice bad" role="alert"><b>${error.code || "error"}</b>: ${error.message}</div>`;
  if (ok) return html`<div class="notice good" role="status">${ok}</div>`;
  return null;
}

// A JSON value typed by hand, checked as it is typed.
export function JsonEditor({ value, onInput, label, rows = 4, name }) {
  const problem = jsonProblem(value);
  return html`<label class="field">
    <span>${label}</span>
    <textarea name=${name} rows=${rows} spellcheck="false" class=${problem ? "invalid" : ""}
      value=${value} onInput=${(e) => onInput(e.currentTarget.value)}></textarea>
    ${problem ? html`<span class="problem">${problem}</span>` : html`<span class="ok">valid JSON</span>`}
  </label>`;
}

export function jsonProblem(text) {
  if (!text.trim()) return "empty: a JSON value is needed (null, {}, \"text\", 1...)";
  try {
    JSON.parse(text);
    return null;
  } catch (e) {
    return `not JSON: ${e.message}`;
  }
}

export function Copy({ text }) {
  const [done, setDone] = useState(false);
  return html`<button class="link" type="button" title="Copy" onClick=${async () => {
    try {
      await navigator.clipboard.writeText(text);
      setDone(true);
      setTimeout(() => setDone(false), 1000);
    } catch {
      /* no clipboard (insecure context): the text is selectable */
    }
  }}>${done ? "copied" : "copy"}</button>`;
}
