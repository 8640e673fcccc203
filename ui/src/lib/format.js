// One time format throughout: local time, ISO-like, with milliseconds ("2026-12-03 14:05:06.123");
// durations in seconds ("1.2 s").

const pad = (n, w = 2) => String(n).padStart(w, "0");

export function parseTime(value) {
  if (!value) return null;
  const t = Date.parse(value);
  return Number.isNaN(t) ? null : t;
}

export function formatTime(value) {
  const t = typeof value === "number" ? value : parseTime(value);
  if (t === null || t === undefined) return "–";
  const d = new Date(t);
  return (
    `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`
  );
}

export function formatDuration(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return "–";
  const sign = ms < 0 ? "-" : "";
  const s = Math.abs(ms) / 1000;
  if (s < 10) return `${sign}${s.toFixed(s < 1 ? 3 : 1).replace(/\.?0+$/, "") || "0"} s`;
  if (s < 60) return `${sign}${s.toFixed(1)} s`;
  if (s < 3600) return `${sign}${Math.floor(s / 60)} min ${(s % 60).toFixed(0)} s`;
  return `${sign}${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

export function between(from, to) {
  const a = parseTime(from);
  const b = parseTime(to);
  return a === null || b === null ? null : b - a;
}

export function formatJson(value, indent = 2) {
  if (value === undefined) return "";
  try {
    return JSON.stringify(value, null, indent);
  } catch {
    return String(value);
  }
}

export function shortId(id) {
  return id && id.length > 14 ? id.slice(0, 14) : id;
}

// A shell word: quoted only when it must be.
export function shellQuote(text) {
  const s = String(text);
  return /^[A-Za-z0-9_./:=@%+-]+$/.test(s) ? s : `'${s.replace(/'/g, "'\\''")}'`;
}
