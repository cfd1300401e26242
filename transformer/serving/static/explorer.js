// The attention explorer: asks POST /translate for a translation and one layer's attention at a time
// ({"attention": true, "attention_layer": n}), and draws the weights of the hypothesis chosen: query
// pieces on the left, key pieces on the right, a line per (query, key) whose opacity is the weight
// (one colour per head when all heads are overlaid), or a heatmap. Hovering a piece keeps only its lines.
// The hard alignment (alignment=true) marks on the encoder-decoder heatmap the cell of each target piece
// and the source piece it links: the row of the query that output it, the column of that source piece.

const HEAD_COLOURS = ["#1b6ec2", "#d1495b", "#2a9d8f", "#e9a03b", "#6a4c93", "#8a5a44", "#3d9970", "#ff6f91",
  "#0081a7", "#9c6644", "#5e548e", "#f07167", "#4d908e", "#c9184a", "#577590", "#f3722c"];
const SIDES = {  // kind -> [query side, key side]
  encoder_self: ["source", "source"],
  decoder_self: ["target", "target"],
  cross: ["target", "source"],
};
const HEATMAP = {cell: 18, left: 150, top: 110};  // a cell's size and the room for the labels, in pixels
const $ = (id) => document.getElementById(id);
const state = {request: null, answer: null, layers: {}, hypothesis: 0, nLayers: 0};

async function ask(layer) {
  const body = {...state.request, attention: true, attention_layer: layer};
  const response = await fetch("/translate", {
    method: "POST",
    headers: {"Content-Type": "application/json"},
    body: JSON.stringify(body),
  });
  const payload = await response.json().catch(() => ({error: `the server answered ${response.status}`}));
  if (!response.ok) throw new Error(payload.error || `the server answered ${response.status}`);
  return payload;
}

async function translate(event) {
  event.preventDefault();
  const text = $("text").value;
  if (!text.trim()) return show("The text is empty: type a sentence to translate.");
  const nbest = Number($("nbest").value);
  // one source, whose attention is drawn: a text longer than the model takes is truncated, not split
  const lines = [text.split(/\r?\n/).join(" ")];
  state.request = {text: lines, nbest, beam_size: Math.max(4, nbest), long_inputs: "truncate", alignment: true};
  state.layers = {};
  show("Translating...");
  try {
    state.answer = await ask(-1);  // the last layer first
    const first = state.answer.translations[0].hypotheses[0];
    if (!first) return show("No translation: the text holds nothing the model can read.");
    state.nLayers = first.attention.layers[0] + 1;
    state.layers[state.nLayers - 1] = state.answer;
    state.hypothesis = 0;
    fillControls(first.attention.heads);
    show("");
    render();
  } catch (error) {
    show(error.message);
  }
}

function show(message) {
  $("message").textContent = message;
  $("result").hidden = message !== "" || !state.answer;
}

function fillControls(heads) {
  const options = (select, values) => {
    select.replaceChildren(...values.map(([value, label]) => new Option(label, value)));
  };
  options($("layer"), [...Array(state.nLayers).keys()].map((i) => [i, `layer ${i + 1}`]));
  $("layer").value = state.nLayers - 1;
  options($("head"), [["all", "all heads, overlaid"], ...[...Array(heads).keys()].map((h) => [h, `head ${h + 1}`])]);
  const list = $("hypotheses");
  list.replaceChildren(...state.answer.translations[0].hypotheses.map((h, i) => {
    const item = document.createElement("li");
    item.dir = "auto";
    item.textContent = `${h.text}  (score ${h.score.toFixed(3)}, log P ${h.log_prob.toFixed(3)})`;
    item.className = i === state.hypothesis ? "chosen" : "";
    item.onclick = () => { state.hypothesis = i; fillControls(heads); render(); };
    return item;
  }));
}

async function changeLayer() {
  const layer = Number($("layer").value);
  if (!state.layers[layer]) {
    show("Fetching layer " + (layer + 1) + "...");
    try {
      state.layers[layer] = await ask(layer);
    } catch (error) {
      return show(error.message);
    }
    show("");
  }
  render();
}

function render() {
  const layer = Number($("layer").value);
  if (!state.layers[layer]) return;  // still on its way (changeLayer renders it)
  const hypothesis = state.layers[layer].translations[0].hypotheses[state.hypothesis];
  const attention = hypothesis.attention;
  const kind = $("kind").value;
  const [querySide, keySide] = SIDES[kind];
  const queries = attention[querySide + "_pieces"], keys = attention[keySide + "_pieces"];
  const weights = attention[kind][0];  // (heads, queries, keys) of this layer, in thousandths
  const head = $("head").value;
  const heads = head === "all" ? [...weights.keys()] : [Number(head)];
  $("note").textContent = attention.note || "";
  $("legend").replaceChildren(...heads.map((h) => {
    const span = document.createElement("span");
    span.textContent = `head ${h + 1}`;
    span.style.color = HEAD_COLOURS[h % HEAD_COLOURS.length];
    return span;
  }));
  const titles = [`${querySide} (queries)`, `${keySide} (keys)`];
  const heatmap = $("style").value === "heatmap";
  $("alignment").disabled = !(heatmap && kind === "cross");
  if (heatmap) drawHeatmap(queries, keys, weights, heads);
  else drawLines(queries, keys, weights, heads, titles);
  if (heatmap && kind === "cross" && $("alignment").checked) markAlignment(hypothesis, queries, keys);
}

function svgElement(name, attributes, text) {
  const element = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  if (text !== undefined) element.textContent = text;
  return element;
}

function drawLines(queries, keys, weights, heads, titles) {
  const row = 22, width = 520, left = 170, right = width - 170, top = 26;
  const svg = $("drawing");
  svg.setAttribute("width", width);
  svg.setAttribute("height", top + row * Math.max(queries.length, keys.length) + 20);
  svg.replaceChildren();
  svg.appendChild(svgElement("text", {x: left - 8, y: 14, "text-anchor": "end", class: "title"}, titles[0]));
  svg.appendChild(svgElement("text", {x: right + 8, y: 14, class: "title"}, titles[1]));
  const lines = svg.appendChild(svgElement("g", {transform: `translate(0 ${top})`}));
  for (const h of heads) {
    weights[h].forEach((weightsOfQuery, q) => weightsOfQuery.forEach((w, k) => {
      if (w < 5) return;  // below 0.005: invisible anyway
      lines.appendChild(svgElement("line", {
        x1: left, y1: row * q + 15, x2: right, y2: row * k + 15, class: "weight",
        stroke: HEAD_COLOURS[h % HEAD_COLOURS.length], "stroke-opacity": w / 1000, "stroke-width": 2,
        "data-head": h, "data-q": q, "data-k": k, "data-w": w,
      }));
    }));
  }
  const piece = (text, x, y, side, index, anchor) => {
    const label = svgElement("text", {x, y, "text-anchor": anchor, class: `piece ${side}`, "data-index": index}, text);
    label.addEventListener("mouseenter", () => highlight(side === "query" ? "data-q" : "data-k", index));
    label.addEventListener("mouseleave", () => highlight(null));
    svg.appendChild(label);
  };
  queries.forEach((text, q) => piece(text, left - 8, top + row * q + 19, "query", q, "end"));
  keys.forEach((text, k) => piece(text, right + 8, top + row * k + 19, "key", k, "start"));
}

function drawHeatmap(queries, keys, weights, heads) {
  const {cell, left, top} = HEATMAP;
  const svg = $("drawing");
  svg.setAttribute("width", left + cell * keys.length + 10);
  svg.setAttribute("height", top + cell * queries.length + 10);
  svg.replaceChildren();
  keys.forEach((text, k) => svg.appendChild(svgElement("text", {
    x: left + cell * k + 12, y: top - 6, transform: `rotate(-60 ${left + cell * k + 12} ${top - 6})`,
    class: "piece key", "data-index": k}, text)));
  queries.forEach((text, q) => {
    svg.appendChild(svgElement("text", {x: left - 6, y: top + cell * q + 13, "text-anchor": "end",
      class: "piece query", "data-index": q}, text));
    keys.forEach((_, k) => {
      const w = Math.round(heads.reduce((sum, h) => sum + weights[h][q][k], 0) / heads.length);
      svg.appendChild(svgElement("rect", {x: left + cell * k, y: top + cell * q, width: cell - 1,
        height: cell - 1, fill: "#1b6ec2", "fill-opacity": w / 1000, class: "weight",
        "data-q": q, "data-k": k, "data-w": w}));
    });
  });
}

function markAlignment(hypothesis, queries, keys) {
  // target piece j is the output of query j (whose input is the piece before it)
  const {cell, left, top} = HEATMAP, svg = $("drawing");
  for (const [k, q] of hypothesis.piece_alignment) {
    if (q >= queries.length || k >= keys.length) continue;  // outside the window drawn
    const mark = svg.appendChild(svgElement("rect", {x: left + cell * k, y: top + cell * q, width: cell - 1,
      height: cell - 1, class: "link", "data-q": q, "data-k": k}));
    mark.appendChild(svgElement("title", {}, `${hypothesis.pieces[q]} aligns with ${keys[k]}`));
  }
}

function highlight(attribute, index) {
  for (const line of $("drawing").querySelectorAll("line.weight")) {
    line.classList.toggle("faded", attribute !== null && Number(line.getAttribute(attribute)) !== index);
  }
}

$("ask").addEventListener("submit", translate);
$("layer").addEventListener("change", changeLayer);
for (const id of ["kind", "head", "style", "alignment"]) $(id).addEventListener("change", render);
