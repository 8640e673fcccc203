// Deep links that follow the browser's history: #/runs?filters, #/runs/RUN_ID, #/functions.
import { useEffect, useState } from "preact/hooks";

export function parseHash(hash = location.hash) {
  const raw = hash.replace(/^#/, "") || "/runs";
  const [path, query = ""] = raw.split("?");
  const params = Object.fromEntries(new URLSearchParams(query));
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { path, parts, params };
}

export function href(path, params) {
  const query = params ? new URLSearchParams(Object.entries(params).filter(([, v]) => v !== "" && v != null)) : null;
  return `#${path}${query && [...query].length ? `?${query}` : ""}`;
}

export function runHref(id) {
  return `#/runs/${encodeURIComponent(id)}`;
}

export function navigate(to) {
  if (location.hash !== to) location.hash = to; // a new history entry: Back returns here
}

export function useRoute() {
  const [route, setRoute] = useState(parseHash());
  useEffect(() => {
    const changed = () => setRoute(parseHash());
    window.addEventListener("hashchange", changed);
    return () => window.removeEventListener("hashchange", changed);
  }, []);
  return route;
}
