// The server API over fetch: reads as they are; a change carries the dev UI's session token
// (local/guard.py), which only this page was given.

const meta = (name) => document.querySelector(`meta[name="${name}"]`)?.content || "";
export const MODE = meta("ryusen-mode") || "dev";

export class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || "http_error";
    this.details = error;
  }
}

async function answer(response) {
  const text = await response.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = { error: { code: "not_json", message: text.slice(0, 300) } };
  }
  if (!response.ok) throw new ApiError(response.status, body);
  return body;
}

export async function get(path, params) {
  const query = params ? new URLSearchParams(Object.entries(params).filter(([, v]) => v !== "" && v != null)) : null;
  const url = query && [...query].length ? `${path}?${query}` : path;
  return answer(await fetch(url, { headers: { accept: "application/json" } }));
}

export async function post(path, body) {
  return answer(
    await fetch(path, {
      method: "POST",
      headers: { "content-type": "application/json", "x-ryusen-session": meta("ryusen-session") },
      body: JSON.stringify(body ?? {}),
    }),
  );
}

export const enc = encodeURIComponent;

// Which runs changed: the dev server's event stream (/dev/events); `ryusen ui` over a deployed API has none,
// and is told to refetch every few seconds instead.
const listeners = new Set();
let source = null;
let timer = null;

function emit(event) {
  for (const fn of [...listeners]) fn(event);
}

function connect() {
  if (MODE !== "dev") {
    timer = setInterval(() => emit({ reload: true }), 3000);
    return;
  }
  source = new EventSource("/dev/events");
  let opened = false;
  source.addEventListener("open", () => {
    if (opened) emit({ reload: true }); // reconnected: what was missed is refetched
    opened = true;
    document.documentElement.dataset.live = "on";
  });
  source.addEventListener("error", () => {
    document.documentElement.dataset.live = "off";
  });
  source.addEventListener("run", (e) => emit(JSON.parse(e.data)));
  source.addEventListener("reload", () => emit({ reload: true }));
}

export function onRunEvent(fn) {
  listeners.add(fn);
  if (!source && !timer) connect();
  return () => listeners.delete(fn);
}
