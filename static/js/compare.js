/* Compare runs: one metric of several jobs overlaid in one panel, fetched from the API. */
"use strict";

(() => {
  const data = JSON.parse(document.getElementById("compare-data").textContent);
  const container = document.getElementById("compare-chart");
  const grid = new Charts.Grid(container, { panelOf: () => data.metric });
  Charts.bindControls(grid, {
    slider: document.getElementById("ema"),
    output: document.getElementById("ema-value"),
    axis: document.getElementById("x-axis"),
  });
  Promise.all(
    data.series.map((series) =>
      fetch(`${series.url}?names=${encodeURIComponent(data.metric)}`, { credentials: "same-origin" })
        .then((response) => response.json())
        .then((body) => {
          for (const point of body.metrics[data.metric] || []) {
            grid.add(series.label, point.step, point.value, point.t - series.started, data.metric);
          }
        })
    )
  ).then(() => {
    const empty = container.querySelector(".empty");
    if (empty) empty.textContent = "None of these jobs reported this metric.";
  });
})();
