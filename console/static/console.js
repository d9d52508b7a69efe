// The console's behaviour: draw Plotly figures, send control actions to the JSON API and show its
// errors, copy text, filter a list by a search box. htmx does the live refreshes; this file holds
// no page-specific logic.
"use strict";

(function () {
  const config = { responsive: true, displayModeBar: false };

  function drawCharts(root) {
    for (const el of root.querySelectorAll(".chart[data-figure]")) {
      const figure = JSON.parse(el.dataset.figure);
      Plotly.react(el, figure.data, figure.layout, config);
    }
  }

  function flash(message) {
    const box = document.getElementById("flash");
    box.textContent = message;
    box.hidden = !message;
  }

  // "--a 1 --b 'x y'" -> ["--a", "1", "--b", "x y"]
  function splitArgs(text) {
    const out = [];
    const re = /"([^"]*)"|'([^']*)'|(\S+)/g;
    let m;
    while ((m = re.exec(text)) !== null) out.push(m[1] ?? m[2] ?? m[3]);
    return out;
  }

  function formBody(form) {
    const body = {};
    const extraFlags = [];
    for (const el of form.elements) {
      if (!el.name || el.disabled) continue;
      if (el.type === "checkbox" && el.dataset.addsFlags !== undefined) {
        if (el.checked) extraFlags.push(...splitArgs(el.dataset.addsFlags));
        continue;
      }
      if (el.type === "checkbox") { body[el.name] = el.checked; continue; }
      if (el.value === "" && !el.required) continue;
      if (el.dataset.kind === "args") body[el.name] = splitArgs(el.value);
      else if (el.dataset.kind === "int") body[el.name] = parseInt(el.value, 10);
      else if (el.dataset.kind === "int-list") body[el.name] = el.value.split(/[\s,]+/).filter(Boolean).map(Number);
      else body[el.name] = el.value;
    }
    if (extraFlags.length) body.flags = (body.flags || []).concat(extraFlags);
    return body;
  }

  async function callApi(method, url, body, then, errorBox) {
    flash("");
    if (errorBox) { errorBox.hidden = true; errorBox.textContent = ""; }
    let response;
    try {
      response = await fetch(url, {
        method: method,
        headers: { "Content-Type": "application/json", "Accept": "application/json" },
        body: body === undefined ? undefined : JSON.stringify(body),
        credentials: "same-origin",
      });
    } catch (err) {
      show(String(err), errorBox);
      return;
    }
    let reply = null;
    try { reply = await response.json(); } catch (err) { reply = null; }
    if (!response.ok) {
      // `localized`: the same message in the page's language, where it is not English
      const error = reply && reply.error;
      const message = error ? error.localized || error.message : response.status + " " + response.statusText;
      show(message, errorBox);
      return;
    }
    after(then, reply);
  }

  function show(message, errorBox) {
    if (errorBox) { errorBox.textContent = message; errorBox.hidden = false; }
    else flash(message);
  }

  function after(then, reply) {
    if (!then || then === "refresh") { htmx.trigger(document.body, "refresh"); return; }
    if (then === "reload") { window.location.reload(); return; }
    if (then.startsWith("go:")) {
      // go:/servers/{id} fills {id} from the reply
      window.location.href = then.slice(3).replace("{id}", reply && reply.id !== undefined ? reply.id : "");
    }
  }

  // The clipboard API needs a secure context (https, or the PC itself); a LAN browser on plain
  // http has none, so the text is selected for the person to copy.
  function copy(source, button) {
    const text = source.textContent.trim();
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(function () {
        button.textContent = button.dataset.copied;
      }, function () { select(source, button); });
      return;
    }
    select(source, button);
  }

  function select(source, button) {
    const range = document.createRange();
    range.selectNodeContents(source);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    button.textContent = button.dataset.selected || button.dataset.copied;
  }

  document.addEventListener("submit", function (event) {
    const form = event.target.closest("form[data-api]");
    if (!form) return;
    event.preventDefault();
    callApi(form.dataset.method || "POST", form.dataset.api, formBody(form),
            form.dataset.then, form.querySelector(".form-error"));
  });

  document.addEventListener("click", function (event) {
    const button = event.target.closest("[data-api-post],[data-copy]");
    if (!button) return;
    if (button.dataset.copy) {
      copy(document.querySelector(button.dataset.copy), button);
      return;
    }
    if (button.dataset.confirm && !window.confirm(button.dataset.confirm)) return;
    button.disabled = true;
    callApi(button.dataset.method || "POST", button.dataset.apiPost, undefined, button.dataset.then, null)
      .finally(function () { button.disabled = false; });
  });

  // a search box that reveals the items it names: `data-filter` selects the items, and those
  // whose text holds what is typed get the class "found" (the stylesheet decides what it shows)
  document.addEventListener("input", function (event) {
    const box = event.target.closest("input[data-filter]");
    if (!box) return;
    const query = box.value.trim().toLowerCase();
    for (const item of document.querySelectorAll(box.dataset.filter)) {
      item.classList.toggle("found", query !== "" && item.textContent.toLowerCase().includes(query));
    }
  });

  // on a phone the nav is one row that scrolls sideways: keep the current page's link in sight
  document.addEventListener("DOMContentLoaded", function () {
    const current = document.querySelector(".nav [aria-current=page]");
    const nav = current && current.parentElement;
    if (nav && nav.scrollWidth > nav.clientWidth) {
      nav.scrollLeft = current.offsetLeft - nav.offsetLeft - (nav.clientWidth - current.offsetWidth) / 2;
    }
  });

  // htmx fires its load event on <body> once the page is ready, and on every swapped-in part
  htmx.onLoad(drawCharts);
})();
