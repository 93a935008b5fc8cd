"""The service's web page (``GET /``): type text, pick a beam size, translate.

One self-contained HTML document (no build step, no external assets): it
posts the text box's lines to ``/translate`` as ``texts`` and shows the
translations, one per line, with the request's latency, or the service's
error message (an over-long text, too many lines, a missing API key). With
API keys required it shows a key field; the key stays in the page.
"""
from __future__ import annotations

from typing import Sequence

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>xfmr_jax translator</title>
<style>
  body { font: 16px/1.4 system-ui, sans-serif; max-width: 48rem;
         margin: 2rem auto; padding: 0 1rem; color: #222; }
  textarea { width: 100%; min-height: 8rem; font: inherit; padding: .5rem;
             box-sizing: border-box; }
  .row { display: flex; gap: 1rem; align-items: center; margin: .75rem 0; }
  button { font: inherit; padding: .4rem 1.2rem; }
  #output { white-space: pre-wrap; border: 1px solid #ccc; min-height: 3rem;
            padding: .5rem; }
  #error { color: #b00020; white-space: pre-wrap; }
  #latency { color: #666; }
  [hidden] { display: none; }
</style>
</head>
<body>
<h1>Translate</h1>
<p>One sentence per line (at most __MAX_TEXTS__ lines of __MAX_CHARS__
characters).</p>
<textarea id="source" aria-label="text to translate"></textarea>
<div class="row">
  <label>Beam size
    <select id="beam">__BEAM_OPTIONS__</select>
  </label>
  <label id="key-label" __KEY_HIDDEN__>API key
    <input id="key" type="password" autocomplete="off">
  </label>
  <button id="translate" type="button">Translate</button>
  <span id="latency"></span>
</div>
<div id="output" aria-live="polite"></div>
<p id="error" role="alert"></p>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
async function translate() {
  const button = $("translate");
  $("error").textContent = "";
  $("latency").textContent = "";
  const headers = {"Content-Type": "application/json"};
  if ($("key").value) headers["X-API-Key"] = $("key").value;
  const texts = $("source").value.split("\\n");
  button.disabled = true;
  const start = performance.now();
  try {
    const response = await fetch("translate", {
      method: "POST", headers,
      body: JSON.stringify({texts, beam_size: Number($("beam").value)})});
    const body = await response.json();
    if (!response.ok) {
      $("output").textContent = "";
      $("error").textContent = `${response.status}: ${body.error}`;
      return;
    }
    $("output").textContent = body.translations.join("\\n");
    $("latency").textContent =
        `${Math.round(performance.now() - start)} ms`;
  } catch (e) {
    $("error").textContent = `the service did not answer: ${e}`;
  } finally {
    button.disabled = false;
  }
}
$("translate").addEventListener("click", translate);
$("source").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) translate();
});
</script>
</body>
</html>
"""


def render(beam_sizes: Sequence[int], *, max_texts: int, max_chars: int,
           needs_key: bool) -> str:
  """The page for a service with these beam sizes (the first selected)
  and limits."""
  options = ''.join(
      f'<option value="{int(b)}"{" selected" if i == 0 else ""}>{int(b)}'
      '</option>' for i, b in enumerate(beam_sizes))
  return (_PAGE.replace('__BEAM_OPTIONS__', options)
          .replace('__MAX_TEXTS__', str(int(max_texts)))
          .replace('__MAX_CHARS__', str(int(max_chars)))
          .replace('__KEY_HIDDEN__', '' if needs_key else 'hidden'))
