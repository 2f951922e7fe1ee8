// The live view: one chat box over the server's OpenAI route, asking for each token's provenance ("specdecode"
// in every chunk) and colouring the answer by it. No build step, no network fetch but this server's own routes.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { options: null, lastRun: null, steps: new Map() };

function headers() {
  const key = $("api-key").value.trim();
  return key ? { "Content-Type": "application/json", "Authorization": `Bearer ${key}` }
             : { "Content-Type": "application/json" };
}

function say(text) { $("status").textContent = text; }

async function loadOptions() {
  const response = await fetch("/v1/specdecode/options", { headers: headers() });
  if (response.status === 401) { say("This server needs its API key: enter it above."); return; }
  state.options = await response.json();
  const select = $("method");
  select.innerHTML = "";
  const serverDefault = document.createElement("option");
  serverDefault.value = "";
  serverDefault.textContent = `server default (${state.options.default.method})`;
  select.appendChild(serverDefault);
  for (const method of state.options.methods) {
    const item = document.createElement("option");
    item.value = method.name;
    item.textContent = method.name;
    select.appendChild(item);
  }
  $("num-draft-tokens").value = state.options.default.num_draft_tokens;
  showOptionFields();
  say("Ready.");
}

function showOptionFields() {
  const fields = $("option-fields");
  fields.innerHTML = "";
  const chosen = $("method").value;
  for (const method of state.options ? state.options.methods : []) {
    if (chosen && method.name !== chosen) continue;
    for (const option of method.options) {
      const label = document.createElement("label");
      label.title = option.help;
      label.textContent = `${option.name} `;
      const input = document.createElement("input");
      input.dataset.option = option.name;
      input.dataset.kind = option.type;
      if (option.type === "bool") { input.type = "checkbox"; input.checked = option.default; }
      else { input.type = option.type === "str" ? "text" : "number"; input.value = option.default;
             if (option.type === "float") input.step = "any"; }
      input.dataset.initial = option.type === "bool" ? String(option.default) : String(option.default);
      label.appendChild(input);
      fields.appendChild(label);
    }
  }
}

function speculative(method) {
  const chosen = method === undefined ? $("method").value : method;
  const spec = { num_draft_tokens: Number($("num-draft-tokens").value) };
  if (chosen) spec.method = chosen;
  if (chosen === "none") return { method: "none" };
  for (const input of $("option-fields").querySelectorAll("input")) {
    const value = input.dataset.kind === "bool" ? String(input.checked) : input.value;
    if (value === input.dataset.initial) continue;  // only what the user changed
    spec[input.dataset.option] = input.dataset.kind === "bool" ? input.checked
      : input.dataset.kind === "str" ? value : Number(value);
  }
  return spec;
}

function body(spec, provenance) {
  const temperature = Number($("temperature").value);
  return JSON.stringify({
    messages: [{ role: "user", content: $("prompt").value }], stream: true,
    stream_options: { include_usage: true }, max_tokens: Number($("max-tokens").value), temperature,
    seed: Number($("seed").value), speculative: spec, provenance,
  });
}

// Reads one streamed completion; onChunk(chunk) for every data: payload. -> {text, seconds, usage, speculative}
async function stream(spec, provenance, onChunk) {
  const began = performance.now();
  const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: body(spec, provenance) });
  if (!response.ok) {
    const error = await response.json().catch(() => ({ error: { message: response.statusText } }));
    throw new Error(`${response.status}: ${error.error ? error.error.message : response.statusText}`);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "", text = "", last = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const line = buffered.slice(0, end).trim();
      buffered = buffered.slice(end + 2);
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const chunk = JSON.parse(line.slice(6));
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content) text += chunk.choices[0].delta.content;
      if (chunk.usage) last = chunk;
      onChunk(chunk);
    }
  }
  return { text, seconds: (performance.now() - began) / 1000, usage: last && last.usage,
           speculative: last && last.speculative };
}

function tokenText(decoder, token) {
  return token.special ? "" : decoder.decode(new Uint8Array(token.bytes), { stream: true });
}

function stepTitle(step) {
  if (!step) return "the prefill's first token";
  if (!step.drafted.length) return `step ${step.step}: no drafts, ${(step.seconds * 1000).toFixed(0)} ms`;
  const decoder = new TextDecoder();
  const drafted = step.drafted_bytes.map((b) => JSON.stringify(decoder.decode(new Uint8Array(b)))).join(" ");
  return `step ${step.step} (${step.method}): drafted ${step.drafted.length} [${drafted}], accepted ` +
         `${step.accepted}, ${(step.seconds * 1000).toFixed(0)} ms`;
}

function renderTree(step) {  // the last tree drafted so far; a chain leaves it shown
  const tree = $("tree");
  if (!step.parents) return;
  const decoder = new TextDecoder();
  const texts = step.drafted_bytes.map((b) => JSON.stringify(decoder.decode(new Uint8Array(b))));
  const depth = (node) => (step.parents[node] < 0 ? 1 : 1 + depth(step.parents[node]));
  const lines = texts.map((t, node) => `${"  ".repeat(depth(node) - 1)}└ ${t}`);
  tree.textContent = `last tree (step ${step.step}, ${step.accepted} accepted):\n${lines.join("\n")}`;
  tree.hidden = false;
}

function summary(run, steps) {
  const tokens = run.usage ? run.usage.completion_tokens : 0;
  const spec = run.speculative || {};
  const tried = [], kept = [];
  for (const step of steps) {
    if (!step.drafted.length) continue;
    const deepest = step.parents ? Math.max(...step.parents.map((_, n) => {
      let d = 1; for (let p = step.parents[n]; p >= 0; p = step.parents[p]) d++; return d; })) : step.drafted.length;
    for (let i = 0; i < deepest; i++) tried[i] = (tried[i] || 0) + 1;
    for (let i = 0; i < step.accepted; i++) kept[i] = (kept[i] || 0) + 1;
  }
  const byPosition = tried.map((n, i) => ((kept[i] || 0) / n).toFixed(2)).join(" / ") || "-";
  const guard = spec.guard_pauses || spec.guard_shrinks
    ? `guard: shortened ${spec.guard_shrinks}x, paused ${spec.guard_pauses}x` : "guard: not needed";
  return `${spec.method || "?"}: ${tokens} tokens, ${(tokens / run.seconds).toFixed(1)} tokens/s, mean accepted ` +
         `length ${spec.mean_accepted_length ? spec.mean_accepted_length.toFixed(2) : "1.00"}, accepted by ` +
         `position ${byPosition}; ${guard}`;
}

async function send() {
  const answer = $("answer");
  answer.textContent = "";
  $("comparison").textContent = "";
  $("step-detail").hidden = true;
  state.steps = new Map();
  $("tree").hidden = true;
  $("send").disabled = $("compare").disabled = true;
  say("Generating...");
  const decoder = new TextDecoder();
  const steps = [];
  try {
    const run = await stream(speculative(), true, (chunk) => {
      const trace = chunk.specdecode;
      if (!trace) return;
      for (const step of trace.steps) { state.steps.set(step.step, step); steps.push(step); renderTree(step); }
      for (const token of trace.tokens) {
        const span = document.createElement("span");
        span.textContent = tokenText(decoder, token);
        span.className = token.kind + (token.kind === "draft" ? ` p${Math.min(token.position, 4)}` : "");
        span.dataset.step = token.step;
        span.title = (token.kind === "draft" ? `draft position ${token.position} (${token.method}); `
                      : `${token.kind}; `) + stepTitle(state.steps.get(token.step));
        answer.appendChild(span);
      }
    });
    state.lastRun = run;
    $("stats").textContent = summary(run, steps);
    say("Done.");
    $("compare").disabled = false;
  } catch (error) {
    say(`Error: ${error.message}`);
  } finally {
    $("send").disabled = false;
  }
}

async function compare() {
  $("compare").disabled = true;
  say("Plain decoding of the same prompt...");
  try {
    const plain = await stream({ method: "none" }, false, () => {});
    const ours = state.lastRun;
    const speedup = (ours.usage.completion_tokens / ours.seconds) / (plain.usage.completion_tokens / plain.seconds);
    const greedy = Number($("temperature").value) === 0;
    const same = greedy ? (plain.text === ours.text ? "identical text" : "DIFFERENT text")
                        : "sampling: the same distribution, not the same text";
    $("comparison").textContent = `without speculation: ${(plain.usage.completion_tokens / plain.seconds).toFixed(1)}` +
      ` tokens/s; speedup ${speedup.toFixed(2)}x; ${same}`;
    say("Done.");
  } catch (error) {
    say(`Error: ${error.message}`);
  } finally {
    $("compare").disabled = false;
  }
}

$("answer").addEventListener("click", (event) => {
  const step = state.steps.get(Number(event.target.dataset.step));
  const detail = $("step-detail");
  detail.textContent = event.target.title || stepTitle(step);
  detail.hidden = false;
});
$("method").addEventListener("change", showOptionFields);
$("send").addEventListener("click", send);
$("compare").addEventListener("click", compare);
$("api-key").addEventListener("change", loadOptions);
loadOptions().catch((error) => say(`Cannot reach the server: ${error.message}`));
