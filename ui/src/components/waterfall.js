// Every attempt of a run on one time axis: a row per step, its forward lane above its compensation lane. An
// attempt's bar runs from queued_at (a backoff wait up to not_before, hatched), to authorized_at (queue delay,
// light), to settled_at (endpoint time, coloured by status); an unsettled one shows its lease; Unknown is
// marked. The stop intent and the deadline are vertical markers.
import { html } from "../lib/html.js";
import { between, formatDuration, formatTime, parseTime } from "../lib/format.js";
import { Badge } from "./common.js";
import { VirtualList } from "./virtual.js";

const ROW = 44;

export function timeRange(run, now) {
  const times = [parseTime(run.created_at)];
  for (const step of run.steps)
    for (const a of step.attempts)
      for (const t of [a.queued_at, a.not_before, a.authorized_at, a.settled_at, a.unknown && a.unknown.at])
        if (t) times.push(parseTime(t));
  if (run.stop_intent) times.push(parseTime(run.stop_intent.at));
  times.push(run.finished_at ? parseTime(run.finished_at) : now);
  const start = Math.min(...times.filter((t) => t !== null));
  let end = Math.max(...times.filter((t) => t !== null));
  const deadline = parseTime(run.deadline && run.deadline.at);
  // the deadline widens the axis only when it is near: an hour away would squeeze every bar to a line
  if (deadline !== null && deadline > end && deadline - start <= 1.25 * Math.max(end - start, 1)) end = deadline;
  return { start, end: Math.max(end, start + 1) };
}

function segments(a, range, now) {
  const pct = (t) => ((t - range.start) / (range.end - range.start)) * 100;
  const out = [];
  const queued = parseTime(a.queued_at);
  const notBefore = parseTime(a.not_before);
  const authorized = parseTime(a.authorized_at);
  const settled = parseTime(a.settled_at);
  const lease = parseTime(a.lease_expires_at);
  const add = (kind, from, to, title) => {
    if (from === null || to === null) return;
    out.push({ kind, left: pct(from), width: Math.max(pct(to) - pct(from), 0.25), title });
  };
  const waitFrom = queued !== null && notBefore !== null && notBefore > queued ? notBefore : queued;
  if (waitFrom !== queued) add("backoff", queued, notBefore, `backoff until ${formatTime(notBefore)}`);
  add("queue", waitFrom, authorized ?? settled ?? now, `queue delay ${formatDuration((authorized ?? settled ?? now) - waitFrom)}`);
  if (authorized !== null) {
    const end = settled ?? now;
    add(`run s-${a.status}`, authorized, end, `endpoint time ${formatDuration(end - authorized)} (${a.status})`);
    if (settled === null && lease !== null && lease > authorized) add("lease", authorized, lease, `lease until ${formatTime(lease)}`);
  }
  const unknownAt = parseTime(a.unknown && a.unknown.at);
  return { out, unknown: unknownAt === null ? null : pct(unknownAt) };
}

function attemptTitle(step, a) {
  const lines = [
    `${step.id} · ${a.phase} generation ${a.generation}: ${a.status}`,
    `queued ${formatTime(a.queued_at)}`,
    a.not_before ? `not before ${formatTime(a.not_before)}` : "",
    a.authorized_at ? `authorized ${formatTime(a.authorized_at)} (queue delay ${formatDuration(between(a.not_before || a.queued_at, a.authorized_at))})` : "",
    a.settled_at ? `settled ${formatTime(a.settled_at)} (endpoint time ${formatDuration(between(a.authorized_at, a.settled_at))})` : "",
    a.lease_expires_at && !a.settled_at ? `lease until ${formatTime(a.lease_expires_at)}` : "",
    a.unknown ? `Unknown since ${formatTime(a.unknown.at)}: ${a.unknown.reason || ""}` : "",
    a.error ? `${a.error.type}: ${a.error.message}` : "",
    a.resolution ? `resolved: ${a.resolution.action}${a.resolution.reason ? ` (${a.resolution.reason})` : ""}` : "",
  ];
  return lines.filter(Boolean).join("\n");
}

function Lane({ step, attempts, range, now, phase }) {
  return html`<div class=${`lane lane-${phase}`}>
    ${attempts.map((a) => {
      const { out, unknown } = segments(a, range, now);
      const title = attemptTitle(step, a);
      return html`<span class="attempt" data-phase=${a.phase} data-generation=${a.generation} data-status=${a.status} title=${title}>
        ${out.map((s) => html`<span class=${`seg seg-${s.kind}`} style=${{ left: `${s.left}%`, width: `${s.width}%` }}></span>`)}
        ${unknown !== null ? html`<span class="mark-unknown" style=${{ left: `${unknown}%` }} title=${title}>?</span>` : ""}
      </span>`;
    })}
  </div>`;
}

export function Waterfall({ run, selected, onSelect, now }) {
  const range = timeRange(run, now);
  const pct = (t) => ((t - range.start) / (range.end - range.start)) * 100;
  const markers = [];
  if (run.stop_intent) {
    const at = parseTime(run.stop_intent.at);
    markers.push({ kind: "stop", left: pct(at), label: `${run.stop_intent.kind} ${formatTime(at)}` });
  }
  const deadline = parseTime(run.deadline && run.deadline.at);
  const deadlineBeyond = deadline !== null && deadline > range.end;
  if (deadline !== null && !deadlineBeyond) markers.push({ kind: "deadline", left: pct(deadline), label: `deadline ${formatTime(deadline)}` });
  const siblings = {};  // decision 30: steps declared together share a group
  for (const step of run.steps) if (step.group !== null && step.group !== undefined) siblings[step.group] = (siblings[step.group] || 0) + 1;
  const span = range.end - range.start;
  const ticks = [0, 0.25, 0.5, 0.75, 1].map((f) => ({ left: f * 100, label: `+${formatDuration(f * span)}` }));
  const overlay = html`<div class="markers">${markers.map(
    (m) => html`<span class=${`marker marker-${m.kind}`} style=${{ left: `${m.left}%` }} title=${m.label}></span>`,
  )}</div>`;
  return html`<div class="waterfall" data-steps=${run.steps.length}>
    <div class="wf-head">
      <div class="wf-label">step <span class="muted">(${run.steps.length})</span></div>
      <div class="wf-axis">${ticks.map((t) => html`<span class="tick" style=${{ left: `${t.left}%` }}>${t.label}</span>`)}
        ${markers.map((m) => html`<span class=${`marker-label marker-${m.kind}`} style=${{ left: `${m.left}%` }}>${m.label}</span>`)}</div>
    </div>
    ${run.steps.length === 0
      ? html`<p class="muted">No steps yet.</p>`
      : html`<${VirtualList} items=${run.steps} rowHeight=${ROW} maxHeight=${Math.min(528, Math.round(window.innerHeight * 0.55))}
          className="wf-rows" label="waterfall" overlay=${html`<div class="wf-overlay">${overlay}</div>`}
          renderRow=${(step, i, pos) => {
            const fwd = step.attempts.filter((a) => a.phase === "forward");
            const comp = step.attempts.filter((a) => a.phase === "compensation");
            const unknown = step.attempts.some((a) => a.status === "unknown");
            const together = step.group !== null && step.group !== undefined && siblings[step.group] > 1;
            return html`<div key=${step.id} class=${`wf-row${selected === step.id ? " selected" : ""}${unknown ? " has-unknown" : ""}${together ? " in-group" : ""}`}
              style=${{ top: `${pos.top}px`, height: `${pos.height}px` }} data-step-id=${step.id} onClick=${() => onSelect(step.id)}>
              <div class="wf-label"><span class="idx">${i + 1}</span>${together ? html`<span class="group-mark" data-group=${step.group} title=${`declared together with ${siblings[step.group] - 1} other step(s): they run side by side`}>∥</span>` : ""} <code title=${step.name || step.id}>${step.id}</code>
                <${Badge} value=${step.status} />${comp.length || step.compensation.status !== "none"
                  ? html` <${Badge} value=${step.compensation.status} title="compensation" />` : ""}</div>
              <div class="wf-track">
                <${Lane} step=${step} attempts=${fwd} range=${range} now=${now} phase="forward" />
                <${Lane} step=${step} attempts=${comp} range=${range} now=${now} phase="compensation" />
              </div>
            </div>`;
          }} />`}
    <div class="legend muted small">
      <span class="seg-key seg-backoff"></span> backoff <span class="seg-key seg-queue"></span> queue delay
      <span class="seg-key seg-run s-succeeded"></span> endpoint time <span class="seg-key seg-lease"></span> lease
      <span class="mark-key">?</span> Unknown · lanes: forward above, compensation below
      ${run.stop_intent ? html` · <span class="marker-key marker-stop"></span> stop intent` : ""}
      ${deadline !== null ? html` · <span class="marker-key marker-deadline"></span> deadline${deadlineBeyond ? ` (${formatTime(deadline)}, beyond the chart)` : ""}` : ""}
    </div>
  </div>`;
}
