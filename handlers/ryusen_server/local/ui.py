"""The development UI: one page that reads the server API and explains each run."""

UI_HTML = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Ryusen dev</title>
<meta name="ryusen-session" content="__RYUSEN_SESSION__">
<style>
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
header{background:#1d2430;color:#fff;padding:10px 18px;display:flex;gap:18px;align-items:baseline}
header h1{font-size:17px;margin:0} header span{opacity:.7}
main{display:grid;grid-template-columns:minmax(300px,1fr) 2fr;gap:14px;padding:14px}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:10px 14px;overflow:auto}
table{border-collapse:collapse;width:100%} td,th{text-align:left;padding:4px 6px;border-bottom:1px solid #eef0f2;vertical-align:top}
tr.run{cursor:pointer} tr.run:hover{background:#f0f4ff} tr.sel{background:#e4ecff}
.badge{display:inline-block;padding:0 6px;border-radius:9px;font-size:12px;background:#e8eaed}
.completed,.succeeded,.compensated{background:#d7f5dd} .failed,.partially_compensated{background:#fde0e0}
.unknown,.blocked{background:#ffe9b3} .running,.authorized,.compensating,.settling{background:#dbe8ff}
.fenced,.skipped,.not_reached,.not_required{background:#ececec}
.blocker{border-left:4px solid #e0a100;background:#fff8e5;padding:6px 10px;margin:8px 0}
.explain{color:#4a5564;font-size:13px;margin:6px 0 10px} code{font-size:12px} .att{color:#4a5564;font-size:12.5px}
pre{background:#f3f4f6;padding:6px;border-radius:4px;white-space:pre-wrap;margin:4px 0}
</style></head><body>
<header><h1>Ryusen dev</h1><span id="fns"></span><b id="notice" style="color:#ffd27a"></b></header>
<main><section><h3>Runs</h3><table id="runs"><tbody></tbody></table></section>
<section id="detail"><p class="explain">Select a run to see its steps, attempts and unwind.</p></section></main>
<script>
const esc = s => String(s ?? "").replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]));
const badge = s => `<span class="badge ${esc(s)}">${esc(s ?? "-")}</span>`;
let selected = new URLSearchParams(location.hash.slice(1)).get("run");
const EXPLAIN = {
  running: "The engine is executing forward work: each discovery pass replays the function with recorded results and reports the next step to run.",
  settling: "An outcome is decided; effect attempts authorized before it must reach a durable outcome before compensation can start.",
  compensating: "Completed steps are being compensated one at a time, newest first. Each compensator receives the step's recorded result.",
  finished: "The run is finished. Its outcome says why execution ended; its recovery says what became of the unwind."
};
async function j(url){ const r = await fetch(url); return r.json(); }
async function act(path, body){
  const session = document.querySelector('meta[name="ryusen-session"]').content;
  const r = await fetch(path, {method: "POST", headers: {"content-type": "application/json", "x-ryusen-session": session}, body: JSON.stringify(body||{})});
  const out = await r.json();
  document.getElementById("notice").textContent = r.ok ? "" : `${out.error.code}: ${out.error.message}`;
  refresh();
}
function resolveUnknown(run, b, action){
  let body = {action};
  if (action === "succeed") {
    const text = prompt(`Result of ${b.step_id} (JSON), as the external system recorded it:`, "{}");
    if (text === null) return;
    try { body.result = JSON.parse(text); } catch (e) { alert("not JSON: " + e); return; }
  }
  if (action === "fail") {
    const message = prompt(`Why is ${b.step_id} declared failed?`, "it did not happen");
    if (message === null) return;
    body.error = {type: "declared_failure", message};
  }
  act(`/v1/runs/${encodeURIComponent(run)}/steps/${encodeURIComponent(b.step_id)}/${b.phase}/${b.generation}/resolve`, body);
}
async function refresh(){
  const fns = await j("/v1/functions");
  document.getElementById("fns").textContent = fns.functions.map(f => `${f.app_id}/${f.id} @ ${f.release.release_id}`).join("   ");
  const page = await j("/v1/runs?limit=50");
  document.querySelector("#runs tbody").innerHTML = page.runs.map(r =>
    `<tr class="run ${r.id===selected?"sel":""}" data-id="${esc(r.id)}"><td><code>${esc(r.id.slice(0,16))}</code><br>${esc(r.function_id)}</td>
     <td>${badge(r.phase)} ${r.blocked?badge("blocked"):""}<br>${esc(r.summary)}</td></tr>`).join("");
  document.querySelectorAll("tr.run").forEach(tr => tr.onclick = () => { selected = tr.dataset.id; location.hash = "run="+selected; refresh(); });
  if (selected) renderRun(await j("/v1/runs/" + encodeURIComponent(selected)));
}
function attempts(list){
  return list.map(a => `<div class="att">${esc(a.phase)} #${a.generation} ${badge(a.status)}
    authorized ${esc((a.authorized_at||"-").slice(11,23))} settled ${esc((a.settled_at||"-").slice(11,23))}
    · op <code>${esc(a.operation_id)}</code> · release ${esc(a.release_id||"-")}
    ${a.error?`<br>&nbsp;&nbsp;${esc(a.error.type)}: ${esc(a.error.message)}${trace(a.error)}`:""}${a.detail?`<br>&nbsp;&nbsp;${esc(a.detail)}`:""}
    ${a.stale_submissions.length?`<br>&nbsp;&nbsp;${a.stale_submissions.length} stale submission(s)`:""}
    ${a.heartbeat?`<br>&nbsp;&nbsp;last heartbeat ${esc((a.heartbeat.at||"-").slice(11,23))} ${heartbeat(a.heartbeat.details)}`:""}</div>`).join("");
}
function trace(err){  // where an error was raised (issue 26): its innermost frame, every frame when opened
  const tb = err && err.traceback;
  if (!tb || !Array.isArray(tb.frames) || !tb.frames.length) return "";
  const at = f => `${esc(f.file)}:${esc(String(f.line))} in ${esc(f.function)}`;
  const inner = tb.frames[tb.frames.length-1];
  const lines = tb.frames.map(f => `${at(f)}${f.code?"\n    "+esc(f.code):""}`).join("\n");
  const left = tb.omitted ? `\n(${tb.omitted} frames in Ryusen's SDK or the middle of a deep stack left out)` : "";
  return `<details class="trace"><summary>raised at ${at(inner)}</summary><pre>Traceback (most recent call last):\n${lines}${left}</pre></details>`;
}
function heartbeat(details){  // decision 33: a progress bar where the details carry a fraction
  if (details === null || details === undefined) return "";
  const p = details && typeof details === "object" ? details.progress : undefined;
  if (typeof p === "number" && p >= 0 && p <= 1)
    return `<progress max="1" value="${p}"></progress> ${Math.round(p*100)}%`;
  return `<code>${esc(JSON.stringify(details).slice(0,200))}</code>`;
}
const CALLS = {  // how a blocker names the two calls it is about
  duplicate_step_id: [["first", "first at"], ["duplicate", "again at"]],
  concurrent_step: [["first", "open step"], ["second", "then started"]],
  new_step_before_target: [["first", "new step"], ["second", "before target"]],
};
function calls(b){
  const parts = (CALLS[b.type]||[]).filter(([k]) => b[k]).map(([k, label]) =>
    `${label} ${b[k].step_id?`<code>${esc(b[k].step_id)}</code> at `:""}${esc(b[k].location||"?")}${b[k].name?` (${esc(b[k].name)})`:""}`);
  return parts.length ? `<br><span class="att">${parts.join(", ")}</span>` : "";
}
function renderRun(r){
  if (r.error && r.error.code) { document.getElementById("detail").innerHTML = `<p>${esc(r.error.message)}</p>`; return; }
  window.currentBlockers = r.blockers;
  const blockers = r.blockers.map((b, i) => `<div class="blocker"><b>${esc(b.type)}</b>${b.step_id?` on <code>${esc(b.step_id)}</code>`:""}: ${esc(b.message)}
     ${b.count>1?` (seen ${b.count} times)`:""}${b.detail?`<br><span class="att">${esc(b.detail)}</span>`:""}
     ${calls(b)}
     <br><span class="explain">${esc(b.remedy)}</span><br>
     ${b.type!=="unknown_outcome" ? `<button onclick="act('/v1/runs/${esc(r.id)}/rediscover')">Rediscover</button>` : ""}
     ${b.type==="unknown_outcome" || (b.type==="new_step_before_target" && b.generation)
       ? `<button onclick="resolveUnknown('${esc(r.id)}', currentBlockers[${i}], 'succeed')">It succeeded…</button>
          <button onclick="resolveUnknown('${esc(r.id)}', currentBlockers[${i}], 'fail')">It failed…</button>
          <button onclick="resolveUnknown('${esc(r.id)}', currentBlockers[${i}], 'retry')">Retry (same operation id)</button>` : ""}</div>`).join("");
  const steps = r.steps.map(s => `<tr><td><code>${esc(s.id)}</code><br><span class="att">${esc(s.name||"")} ${esc(s.location||"")}</span></td>
     <td>${badge(s.status)} ${s.has_compensation?"":'<span class="att">no compensator declared</span>'}
     ${s.result!==null?`<pre>${esc(JSON.stringify(s.result))}</pre>`:""}${s.error?`<div class="att">${esc(s.error.type)}: ${esc(s.error.message)}</div>`:""}
     ${attempts(s.attempts)}</td></tr>`).join("");
  const unwind = r.unwind.map(u => `<li><code>${esc(u.step_id)}</code> ${badge(u.status)}</li>`).join("");
  document.getElementById("detail").innerHTML = `<h3>${esc(r.function_id)} <code>${esc(r.id)}</code></h3>
    <p>${badge(r.phase)} outcome ${badge(r.outcome)} recovery ${badge(r.recovery)} — <b>${esc(r.summary)}</b></p>
    <p class="explain">${r.blockers.length ? "The run is blocked: see below." : (EXPLAIN[r.phase]||"")}</p>
    ${r.phase!=="finished" && !r.stop_intent && !r.outcome ? `<button onclick="confirm('Cancel run ${esc(r.id)}? Its completed steps are compensated; this cannot be undone.') && act('/v1/runs/${esc(r.id)}/cancel')">Cancel run</button>` : ""}

    <p class="att">deadline: ${esc(r.deadline.at||"none")} (source ${esc(r.deadline.source)}) · created ${esc(r.created_at)}
      ${r.stop_intent?` · stop intent: ${esc(r.stop_intent.kind)} at ${esc(r.stop_intent.at)}`:""}</p>
    ${blockers}
    <h4>Steps</h4><table>${steps}</table>
    ${unwind?`<h4>Unwind (reverse completion order)</h4><ol>${unwind}</ol>`:""}
    ${r.output!==null?`<h4>Output</h4><pre>${esc(JSON.stringify(r.output,null,1))}</pre>`:""}
    ${r.error?`<h4>Error</h4><pre>${esc(r.error.type)}: ${esc(r.error.message)}</pre>${trace(r.error)}`:""}`;
}
refresh(); setInterval(refresh, 1500);
</script></body></html>
"""
