// The ryusen dev UI: runs, one run, functions. Routes live in the URL's hash, so Back and Forward work.
import "./app.css";
import { render } from "preact";
import { useEffect, useState } from "preact/hooks";
import { html } from "./lib/html.js";
import { MODE, get } from "./lib/api.js";
import { useRoute } from "./lib/router.js";
import { RunList } from "./components/runlist.js";
import { RunPage } from "./components/runpage.js";
import { FunctionsPage } from "./components/functions.js";

function useFunctions() {
  const [state, setState] = useState({ functions: [], apps: [], error: null });
  const load = async () => {
    try {
      const [f, a] = await Promise.all([get("/v1/functions"), get("/v1/apps")]);
      setState({ functions: f.functions, apps: a.apps, error: null });
    } catch (error) {
      setState((s) => ({ ...s, error }));
    }
  };
  useEffect(() => {
    load();
    const t = setInterval(load, 10000); // a reload of an app syncs a new release
    return () => clearInterval(t);
  }, []);
  return state;
}

function App() {
  const route = useRoute();
  const { functions, apps, error } = useFunctions();
  const [section, id] = route.parts;
  let page;
  if (section === "functions") page = html`<${FunctionsPage} functions=${functions} apps=${apps} error=${error} />`;
  else if (section === "runs" && id) page = html`<${RunPage} key=${id} id=${id} />`;
  else page = html`<${RunList} params=${route.params} functions=${functions} />`;
  useEffect(() => {
    document.title = section === "runs" && id ? `${id} · Ryusen` : section === "functions" ? "Functions · Ryusen" : "Runs · Ryusen";
  }, [section, id]);
  return html`<header class="top">
      <a class="brand" href="#/runs">Ryusen <span>${MODE === "dev" ? "dev" : "ui"}</span></a>
      <nav><a href="#/runs" class=${section !== "functions" ? "active" : ""}>Runs</a>
        <a href="#/functions" class=${section === "functions" ? "active" : ""}>Functions</a></nav>
      <span class="live" title="live updates from the server">live</span>
    </header>
    <main>${page}</main>`;
}

render(html`<${App} />`, document.getElementById("app"));
