// pagewise admin dashboard: refreshes the live engine figures of a page every few seconds.
// An element with data-live-source names the JSON endpoint; each [data-live=FIELD] inside the page shows that
// field. Throughput is derived from two readings of generation_tokens_total. No other script, no other host.
"use strict";

(function () {
  const source = document.querySelector("[data-live-source]");
  if (!source) return;
  const url = source.getAttribute("data-live-source");
  const PERIOD_MS = 3000;
  let previous = null;

  function show(field, text) {
    document.querySelectorAll(`[data-live="${field}"]`).forEach((el) => { el.textContent = text; });
  }

  function format(el, value) {
    return el && el.getAttribute("data-format") === "percent"
      ? `${(value * 100).toFixed(1)}%`
      : Number(value).toLocaleString("en-US");
  }

  async function refresh() {
    try {
      const response = await fetch(url, { credentials: "same-origin", headers: { accept: "application/json" } });
      if (!response.ok) return;
      const stats = await response.json();
      for (const [field, value] of Object.entries(stats)) {
        show(field, format(document.querySelector(`[data-live="${field}"]`), value));
      }
      if (previous && stats.at > previous.at) {
        const rate = (stats.generation_tokens_total - previous.generation_tokens_total) / (stats.at - previous.at);
        show("throughput", rate.toFixed(1));
      }
      previous = stats;
    } catch (error) {
      // a missed reading: the next one retries
    }
  }

  refresh();
  setInterval(refresh, PERIOD_MS);
})();
