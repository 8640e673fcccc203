// Refetch what a view shows when the runs it shows change (throttled: one fetch in flight, one queued).
import { useEffect, useRef } from "preact/hooks";
import { onRunEvent } from "./api.js";

export function useLive(relevant, refetch, deps) {
  const state = useRef({ running: false, again: false });
  const latest = useRef({ relevant, refetch });
  latest.current = { relevant, refetch };
  useEffect(() => {
    const run = async () => {
      const s = state.current;
      if (s.running) {
        s.again = true;
        return;
      }
      s.running = true;
      try {
        await latest.current.refetch();
      } finally {
        s.running = false;
        if (s.again) {
          s.again = false;
          setTimeout(run, 150);
        }
      }
    };
    return onRunEvent((event) => {
      if (event.reload || latest.current.relevant(event)) run();
    });
  }, deps);
}
