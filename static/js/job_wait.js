// A running audit or held-out delta: poll its job (the database is the source of truth)
// and move the progress bar; when the job ends, reload the page to show its report.
(function () {
  const box = document.getElementById("job-wait");
  if (!box) return;
  const bar = document.getElementById("wait-progress");
  const text = document.getElementById("wait-text");
  const terminal = ["succeeded", "failed", "cancelled", "lost"];
  async function poll() {
    try {
      const response = await fetch(box.dataset.url, { headers: { Accept: "application/json" } });
      if (response.ok) {
        const job = await response.json();
        const { done, total, desc } = job.progress;
        bar.value = total ? Math.min(1, done / total) : 0;
        text.textContent = `${job.status} · ${desc} ${done}/${total}`;
        if (terminal.includes(job.status)) {
          window.location.reload();
          return;
        }
      }
    } catch (error) {
      text.textContent += " (reconnecting…)";
    }
    setTimeout(poll, 1000);
  }
  poll();
})();
