// htm bound to Preact's h: the tagged template every component renders with (no JSX, no transpiler).
import { h } from "preact";
import htm from "htm";

export const html = htm.bind(h);
