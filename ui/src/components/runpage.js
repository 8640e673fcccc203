// One run: what it is, why it waits (blockers with their remedy as an action), every attempt on a waterfall,
// the selected step's results and errors, and the unwind.
import { useEffect, useState } from "preact/hooks";
import { html } from "../lib/html.js";
import { enc, get, post } from "../lib/api.js";
import { between, formatTime } from "../lib/format.js";
import { navigate, runHref } from "../lib/router.js";
import { useLive } from "../lib/live.js";
import { Badge, Copy, Duration, ErrorView, Json, Notice, Time } from "./common.js";
import { CancelForm, RediscoverButton, ResolveForm } from "./actions.js";
import { Waterfall } from "./waterfall.js";
import { VirtualList } from "./virtual.js";

const EXPLAIN = {
  running: "The engine is executing forward work: each discovery pass replays the function with recorded results and reports the next step to run.",
  settling: "An outcome is decided; effect attempts authorized before it must reach a durable outcome before compensation can start.",
  compensating: "Completed steps are being compensated one at a time, newest first. Each compensator receives the step's recorded result.",
  finished: "The run is finished. Its outcome says why execution ended; its recovery says what became of the unwind.",
};
const CALLS = {
  duplicate_step_id: [["first", "first at"], ["duplicate", "again at"]],
  concurrent_step: [["first", "open step"], ["second", "then started"]],
  new_step_before_target: [["first", "new step"], ["second", "before target"]],
};
const RESOLVABLE = new Set(["unknown_outcome", "result_too_large", "compensation_target_not_reached"]);
const REDISCOVERABLE = new Set(["duplicate_step_id", "concurrent_step", "compensation_target_not_reached", "unstable_step_id", "invalid_step"]);

export function RunPage({ id }) {
  const [run, setRun] = useState(null);
  const [error, setError] = useState(null);
  const [now, setNow] = useState(Date.now());
  const [selected, setSelected] = useState(null);
  const load = async () => {
    try {
      const view = await get(`/v1/runs/${enc(id)}`);
      setNow(Date.now());
      setRun((old) => (old && old.id === view.id && old.version === view.version ? old : view));
      setError(null);
    } catch (e) {
      setError(e);
    }
  };
  useEffect(() => {
    setRun(null);
    setSelected(null);
    load();
  }, [id]);
  useLive((event) => event.run_id === id && (!run || event.version !== run.version), load, [id]);
  const changed = (view) => view && view.id === id && setRun(view);

  if (error && !run) return html`<section class="panel"><${Notice} error=${error} /><a href="#/runs">← runs</a></section>`;
  if (!run) return html`<section class="panel"><p class="muted">loading…</p></section>`;
  const step = selected ? run.steps.find((s) => s.id === selected) : null;
  return html`<div class="run-page" data-run-id=${run.id} data-version=${run.version}>
    <${Header} run=${run} onChanged=${changed} />
    ${run.blockers.length ? html`<section class="panel blockers"><h2>Why it waits</h2>
      ${run.blockers.map((b, i) => html`<${BlockerView} key=${i} run=${run} blocker=${b} onChanged=${changed} />`)}</section>` : ""}
    <section class="panel"><h2>Input and result</h2>
      <div class="io">
        <${Json} value=${run.input} label="input" />
        ${run.output !== null ? html`<${Json} value=${run.output} label="output" />` : ""}
        <${ErrorView} error=${run.error} label="the run's error" />
      </div>
    </section>
    <section class="panel"><h2>Attempts</h2>
      <${Waterfall} run=${run} selected=${selected} onSelect=${setSelected} now=${now} />
      ${step ? html`<${StepDetail} run=${run} step=${step} onChanged=${changed} onClose=${() => setSelected(null)} />`
        : html`<p class="muted small">Select a step for its results, errors and attempts.</p>`}
    </section>
    ${run.unwind.length ? html`<${Unwind} run=${run} onSelect=${setSelected} />` : ""}
  </div>`;
}

function Header({ run, onChanged }) {
  const [open, setOpen] = useState(null);
  const [rerun, setRerun] = useState({ busy: false, error: null });
  const live = run.phase !== "finished";
  const doRerun = async () => {
    setRerun({ busy: true, error: null });
    try {
      const started = await post(`/v1/functions/${enc(run.function_id)}/runs`, { input: run.input });
      navigate(runHref(started.id));
    } catch (error) {
      setRerun({ busy: false, error });
    }
  };
  const ms = between(run.created_at, run.finished_at);
  return html`<section class="panel header">
    <div class="title">
      <h1>${run.function_id} <code class="run-id">${run.id}</code> <${Copy} text=${run.id} /></h1>
      <div class="badges"><${Badge} value=${run.phase} /> outcome <${Badge} value=${run.outcome} />
        recovery <${Badge} value=${run.recovery} />${run.blockers.length ? html` <span class="badge s-blocked">blocked</span>` : ""}</div>
    </div>
    <p class="summary-line"><b data-summary>${run.summary}</b></p>
    <p class="muted small">${run.blockers.length ? "The run is blocked: see below." : EXPLAIN[run.phase] || ""}</p>
    <dl class="facts">
      <dt>app</dt><dd>${run.app_id}</dd>
      <dt>created</dt><dd><${Time} at=${run.created_at} /></dd>
      <dt>finished</dt><dd>${run.finished_at ? html`<${Time} at=${run.finished_at} /> (<${Duration} ms=${ms} />)` : "–"}</dd>
      <dt>deadline</dt><dd>${run.deadline.at ? html`<${Time} at=${run.deadline.at} />` : "none"} <span class="muted">source: ${run.deadline.source.replace(/_/g, " ")}</span></dd>
      ${run.stop_intent ? html`<dt>stop intent</dt><dd class="stop-intent"><${Badge} value=${run.stop_intent.kind} /> at <${Time} at=${run.stop_intent.at} />
        ${run.stop_intent.reason ? html` — reason: <q data-reason>${run.stop_intent.reason}</q>` : html` <span class="muted">(no reason given)</span>`}</dd>` : ""}
      ${run.idempotency_key ? html`<dt>idempotency key</dt><dd><code>${run.idempotency_key}</code></dd>` : ""}
      <dt>version</dt><dd>${run.version} <span class="muted">· ${run.discoveries ?? 0} discovery passes</span></dd>
    </dl>
    <div class="toolbar">
      ${live && !run.stop_intent ? html`<button type="button" class="danger" onClick=${() => setOpen(open === "cancel" ? null : "cancel")}>Cancel run…</button>` : ""}
      <button type="button" disabled=${rerun.busy} onClick=${doRerun} title="Start a new run of the same function with this run's input">Rerun with the same input</button>
      <a class="button link" href=${`#/runs?function_id=${enc(run.function_id)}`}>runs of ${run.function_id}</a>
    </div>
    <${Notice} error=${rerun.error} />
    ${open === "cancel" && live && !run.stop_intent ? html`<${CancelForm} run=${run} onDone=${(v) => { setOpen(null); onChanged(v); }} />` : ""}
  </section>`;
}

function Calls({ blocker }) {
  const calls = (CALLS[blocker.type] || []).filter(([k]) => blocker[k]);
  if (!calls.length) return null;
  return html`<ul class="calls">${calls.map(([k, label]) => {
    const c = blocker[k];
    return html`<li>${label} ${c.step_id ? html`<code>${c.step_id}</code> ` : ""}at <code>${c.location || "?"}</code>${c.name ? html` <span class="muted">(${c.name})</span>` : ""}</li>`;
  })}</ul>`;
}

function BlockerView({ run, blocker, onChanged }) {
  const [open, setOpen] = useState(false);
  const attempt = blocker.step_id && blocker.phase && blocker.generation;
  const resolvable = attempt && (RESOLVABLE.has(blocker.type) || (blocker.type === "new_step_before_target" && blocker.generation) || (blocker.type === "concurrent_step" && blocker.generation));
  return html`<div class="blocker" data-blocker=${blocker.type}>
    <div><b>${blocker.type.replace(/_/g, " ")}</b>${blocker.step_id ? html` on <code>${blocker.step_id}</code>` : ""}
      ${attempt ? html` <span class="muted">(${blocker.phase} #${blocker.generation})</span>` : ""}: <span data-message>${blocker.message}</span>
      ${blocker.count > 1 ? html` <span class="muted">(seen ${blocker.count} times)</span>` : ""}</div>
    ${blocker.detail ? html`<div class="muted small">${blocker.detail}</div>` : ""}
    <${Calls} blocker=${blocker} />
    <p class="remedy">${blocker.remedy}</p>
    <div class="toolbar">
      ${REDISCOVERABLE.has(blocker.type) ? html`<${RediscoverButton} run=${run} onDone=${onChanged} />` : ""}
      ${resolvable ? html`<button type="button" onClick=${() => setOpen(!open)}>Resolve ${blocker.step_id}…</button>` : ""}
    </div>
    ${open && resolvable ? html`<${ResolveForm} run=${run} stepId=${blocker.step_id} phase=${blocker.phase} generation=${blocker.generation}
      onDone=${(v) => { setOpen(false); onChanged(v); }} />` : ""}
  </div>`;
}

function AttemptRow({ run, step, a, onChanged }) {
  const [open, setOpen] = useState(false);
  const queue = between(a.not_before && a.not_before > a.queued_at ? a.not_before : a.queued_at, a.authorized_at);
  const endpoint = between(a.authorized_at, a.settled_at);
  return html`<tr class=${`attempt-row s-row-${a.status}`} data-phase=${a.phase} data-generation=${a.generation}>
    <td>${a.phase}</td><td class="num">#${a.generation}</td><td><${Badge} value=${a.status} /></td>
    <td><${Time} at=${a.queued_at} />${a.not_before ? html`<div class="muted small">not before <${Time} at=${a.not_before} /></div>` : ""}</td>
    <td><${Time} at=${a.authorized_at} /></td><td><${Time} at=${a.settled_at} /></td>
    <td class="num"><${Duration} ms=${queue} /></td><td class="num"><${Duration} ms=${endpoint} /></td>
    <td class="detail">
      ${a.lease_expires_at && !a.settled_at ? html`<div>lease until <${Time} at=${a.lease_expires_at} /></div>` : ""}
      ${a.unknown ? html`<div class="unknown">Unknown since <${Time} at=${a.unknown.at} />${a.unknown.reason ? `: ${a.unknown.reason}` : ""}</div>` : ""}
      ${a.resolution ? html`<div class="resolution" data-resolution=${a.resolution.action}>resolved <b>${a.resolution.action}</b> at <${Time} at=${a.resolution.at} />
        ${a.resolution.by ? ` by ${a.resolution.by}` : ""}${a.resolution.reason ? html` — reason: <q>${a.resolution.reason}</q>` : ""}</div>` : ""}
      <${ErrorView} error=${a.error} />
      ${a.detail ? html`<div class="muted small">${a.detail}</div>` : ""}
      ${a.heartbeat ? html`<div>last heartbeat <${Time} at=${a.heartbeat.at} /> <${Heartbeat} details=${a.heartbeat.details} /></div>` : ""}
      ${a.redeliveries ? html`<div class="muted small">${a.redeliveries} redeliveries</div>` : ""}
      ${a.stale_submissions.length ? html`<div class="muted small">${a.stale_submissions.length} stale submission(s): ${a.stale_submissions.map((s) => s.reason).join("; ")}</div>` : ""}
      <div class="muted small">operation <code>${a.operation_id}</code> · release ${a.release_id || "–"}</div>
      ${a.status === "unknown" ? html`<button type="button" onClick=${() => setOpen(!open)}>Resolve…</button>
        ${open ? html`<${ResolveForm} run=${run} stepId=${step.id} phase=${a.phase} generation=${a.generation} onDone=${(v) => { setOpen(false); onChanged(v); }} />` : ""}` : ""}
    </td>
  </tr>`;
}

function Heartbeat({ details }) {
  if (details === null || details === undefined) return null;
  const p = details && typeof details === "object" ? details.progress : undefined;
  if (typeof p === "number" && p >= 0 && p <= 1) return html`<progress max="1" value=${p}></progress> ${Math.round(p * 100)}%`;
  return html`<code>${JSON.stringify(details).slice(0, 200)}</code>`;
}

function StepDetail({ run, step, onChanged, onClose }) {
  const c = step.compensation;
  return html`<div class="step-detail" data-step-id=${step.id}>
    <div class="title"><h3><code>${step.id}</code> <${Badge} value=${step.status} /></h3>
      <button type="button" class="link" onClick=${onClose}>close</button></div>
    <p class="muted small">${step.name ? `${step.name} · ` : ""}${step.location || ""}${step.has_compensation || step.sleep ? "" : " · no compensator declared"}</p>
    ${step.group !== null && step.group !== undefined && run.steps.filter((s) => s.group === step.group).length > 1
      ? html`<p class="group" data-group=${step.group}>declared together with ${run.steps.filter((s) => s.group === step.group && s.id !== step.id).map((s) => s.id).join(", ")}: they run side by side, at most the function's max_parallel at once</p>` : ""}
    ${step.wait_until ? html`<p class="wait" data-wait-until=${step.wait_until}>${step.sleep ? "a durable wait: completes at" : "its first attempt starts no earlier than"} <${Time} at=${step.wait_until} />${step.status === "pending" ? " (waiting: no process runs meanwhile)" : ""}</p>` : ""}
    <${Completion} step=${step} onChanged=${onChanged} />
    <div class="io">
      ${step.result !== null ? html`<${Json} value=${step.result} label="result" />` : ""}
      ${step.omitted_result ? html`<${Json} value=${step.omitted_result} label="result (omitted)" />` : ""}
      <${ErrorView} error=${step.error} label="the step's error" />
      ${step.has_compensation || c.status !== "none" ? html`<div class="compensation"><div>compensation <${Badge} value=${c.status} /></div>
        ${c.result !== null && c.result !== undefined ? html`<${Json} value=${c.result} label="compensation result" />` : ""}
        <${ErrorView} error=${c.error} label="compensation error" /></div>` : ""}
    </div>
    <table class="attempts">
      <thead><tr><th>phase</th><th>gen</th><th>status</th><th>queued</th><th>authorized</th><th>settled</th><th class="num">queue delay</th><th class="num">endpoint time</th><th></th></tr></thead>
      <tbody>${step.attempts.map((a) => html`<${AttemptRow} key=${`${a.phase}-${a.generation}`} run=${run} step=${step} a=${a} onChanged=${onChanged} />`)}</tbody>
    </table>
  </div>`;
}

// Decision 32: a step completed from outside, waiting: the token, the commands that complete it, and a form.
function Completion({ step, onChanged }) {
  const waiting = step.attempts.find((a) => a.status === "waiting" && a.completion_token);
  const [text, setText] = useState('{"approved": true}');
  const [problem, setProblem] = useState("");
  if (!waiting) return "";
  const token = waiting.completion_token;
  async function submit(event) {
    event.preventDefault();
    let result;
    try {
      result = JSON.parse(text);
    } catch (err) {
      setProblem(`not JSON: ${err.message}`);
      return;
    }
    try {
      await post(`/v1/completions/${enc(token)}`, { result });
      setProblem("");
      onChanged();
    } catch (err) {
      setProblem(err.message || String(err));
    }
  }
  return html`<div class="completion" data-token=${token}>
    <p><b>Waiting for its completion from outside</b> since <${Time} at=${waiting.waiting_since} />: the callback handed out this token; the step's result comes with it.</p>
    <p class="small">token <code class="token">${token}</code> <${Copy} text=${token} /></p>
    <pre class="small">ryusen complete ${token} --result JSON
curl -X POST ${location.origin}/v1/completions/${token} -H 'content-type: application/json' -d '{"result": ...}'</pre>
    <form onSubmit=${submit}>
      <label class="small">result (JSON) <textarea name="result" rows="2" value=${text} onInput=${(e) => setText(e.target.value)} /></label>
      <button type="submit">Complete</button>
      ${problem ? html`<span class="problem">${problem}</span>` : ""}
    </form>
  </div>`;
}

function Unwind({ run, onSelect }) {
  const steps = new Map(run.steps.map((s) => [s.id, s]));
  return html`<section class="panel unwind"><h2>Unwind <span class="muted small">(reverse completion order: compensated newest first)</span></h2>
    <${VirtualList} items=${run.unwind} rowHeight=${30} maxHeight=${300} className="unwind-rows" label="unwind"
      renderRow=${(u, i, pos) => {
        const step = steps.get(u.step_id);
        const a = step && step.attempts.filter((x) => x.phase === "compensation").pop();
        return html`<div key=${u.step_id} class="unwind-row" style=${{ top: `${pos.top}px`, height: `${pos.height}px` }} data-step-id=${u.step_id}
          onClick=${() => onSelect(u.step_id)}>
          <span class="idx">${i + 1}</span> <code>${u.step_id}</code> <${Badge} value=${u.status} />
          ${a && a.settled_at ? html` <span class="muted small">settled ${formatTime(a.settled_at)}</span>` : ""}
          ${step && step.compensation.error ? html` <span class="bad small">${step.compensation.error.type}: ${step.compensation.error.message}</span>` : ""}
        </div>`;
      }} />
  </section>`;
}
