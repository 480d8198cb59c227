/* The environment config page: the preview follows the form. Each edit (after a short
 * pause) asks the server for the examples these parameters would give, so a person sees
 * what they are about to save; a value the env refuses shows its error in the preview. */
"use strict";

(() => {
  const form = document.getElementById("env-config-form");
  const preview = document.getElementById("env-preview");
  const body = document.getElementById("preview-body");
  const seed = document.getElementById("preview-seed");
  let timer = null;
  let asked = 0;

  async function refresh() {
    const params = new URLSearchParams();
    for (const [name, value] of new FormData(form)) {
      if (name.startsWith("param_")) params.set(name, value);
    }
    for (const box of form.querySelectorAll("input[type=checkbox][name^=param_]")) {
      params.set(box.name, box.checked ? "on" : "");
    }
    params.set("seed", seed.value || "0");
    const ticket = ++asked;
    const response = await fetch(`${preview.dataset.previewUrl}?${params}`, { credentials: "same-origin" });
    if (ticket !== asked) return; // a newer edit's preview is on its way
    body.innerHTML = await response.text();
    document.getElementById("preview-of").textContent = "(this form)";
  }

  function later() {
    clearTimeout(timer);
    timer = setTimeout(refresh, 300);
  }

  form.addEventListener("input", later);
  form.addEventListener("change", later);
  seed.addEventListener("input", later);
})();
