"use strict";
// MegaTrace report: draws the rank grid and the delay matrix on canvases, with a hover tooltip.
// Data comes from the JSON blocks of this page; nothing is fetched.
(function () {
  var tip = document.getElementById("tip");
  function data(id) {
    var el = document.getElementById(id);
    return el ? JSON.parse(el.textContent) : null;
  }
  function showTip(ev, text) {
    tip.textContent = text;
    tip.style.display = "block";
    tip.style.left = (ev.clientX + 12) + "px";
    tip.style.top = (ev.clientY + 12) + "px";
  }
  function hideTip() { tip.style.display = "none"; }
  function heatColour(v) {  // 0 → pale, 1 → dark red
    var t = Math.max(0, Math.min(1, v));
    var r = Math.round(255 - 75 * t), g = Math.round(245 - 215 * t), b = Math.round(235 - 205 * t);
    return "rgb(" + r + "," + g + "," + b + ")";
  }
  function coords(layout, rank) {
    var order = String(layout.order || "tp-dp-pp").split("-"), out = {}, r = rank;
    for (var i = 0; i < order.length; i++) { var k = order[i]; out[k] = r % layout[k]; r = Math.floor(r / layout[k]); }
    return out;
  }

  function drawHeat(h) {
    var cv = document.getElementById("heat");
    if (!cv || !h) return;
    var world = h.world, L = h.layout, rows, cols, cellOf = [];
    var okLayout = L && L.tp && L.pp && L.dp && L.tp * L.pp * L.dp === world;
    if (okLayout) { rows = L.pp * L.tp; cols = L.dp; } else { cols = Math.ceil(Math.sqrt(world)); rows = Math.ceil(world / cols); }
    var size = Math.max(3, Math.min(36, Math.floor(1100 / cols), Math.floor(600 / rows)));
    cv.width = cols * size + 12; cv.height = rows * size + 12;
    var ctx = cv.getContext("2d");
    var max = 0, i;
    for (i = 0; i < world; i++) if (h.blame[i] > max) max = h.blame[i];
    var culprit = {};
    for (i = 0; i < h.culprits.length; i++) culprit[h.culprits[i]] = true;
    var grid = new Int32Array(rows * cols).fill(-1);
    for (var r = 0; r < world; r++) {
      var row, col;
      if (okLayout) { var c = coords(L, r); row = c.pp * L.tp + c.tp; col = c.dp; } else { row = Math.floor(r / cols); col = r % cols; }
      grid[row * cols + col] = r;
      var st = h.statuses[h.status[r]] || "";
      ctx.fillStyle = st === "missing" ? "#c8c8c8" : heatColour(max > 0 ? h.blame[r] / max : 0);
      ctx.fillRect(col * size, row * size, size - (size > 4 ? 1 : 0), size - (size > 4 ? 1 : 0));
    }
    ctx.lineWidth = 2; ctx.strokeStyle = "#b3261e";
    for (var k in culprit) {
      var rr = Number(k), rw, cl;
      if (okLayout) { var cc = coords(L, rr); rw = cc.pp * L.tp + cc.tp; cl = cc.dp; } else { rw = Math.floor(rr / cols); cl = rr % cols; }
      if (size < 12) {  // small cells: fill the culprit and ring it so that it stands out at any scale
        ctx.fillStyle = "#b3261e"; ctx.fillRect(cl * size, rw * size, size, size);
        ctx.beginPath(); ctx.arc(cl * size + size / 2, rw * size + size / 2, 9, 0, 2 * Math.PI); ctx.stroke();
      } else {
        ctx.strokeRect(cl * size + 1, rw * size + 1, size - 3, size - 3);
      }
    }
    cv.addEventListener("mousemove", function (ev) {
      var b = cv.getBoundingClientRect();
      var col = Math.floor((ev.clientX - b.left) / size), row = Math.floor((ev.clientY - b.top) / size);
      if (col < 0 || row < 0 || col >= cols || row >= rows) return hideTip();
      var r = grid[row * cols + col];
      if (r < 0) return hideTip();
      var text = "rank " + r;
      if (okLayout) { var c = coords(L, r); text += " · PP " + c.pp + " TP " + c.tp + " DP " + c.dp; }
      text += " · " + (h.statuses[h.status[r]] || "") + " · critical-path share " + (100 * h.blame[r]).toFixed(1) + "%";
      if (culprit[r]) text += " · culprit";
      showTip(ev, text);
    });
    cv.addEventListener("mouseleave", hideTip);
  }

  function drawDelay(d) {
    var cv = document.getElementById("delay");
    if (!cv || !d) return;
    var m = d.excess_us, n = m.length, size = Math.max(4, Math.min(36, Math.floor(640 / n))), pad = 28;
    cv.width = n * size + pad + 1; cv.height = n * size + pad + 1;
    var ctx = cv.getContext("2d"), max = 0, i, j;
    for (i = 0; i < n; i++) for (j = 0; j < n; j++) if (m[i][j] !== null && m[i][j] > max) max = m[i][j];
    max = Math.max(max, d.scale_us || 0);
    ctx.font = "10px sans-serif"; ctx.fillStyle = "#57606a";
    for (i = 0; i < n; i++) {
      ctx.fillStyle = "#57606a";
      if (size >= 10 || i % 8 === 0) { ctx.fillText(String(i), pad + i * size + 1, 12); ctx.fillText(String(i), 2, pad + i * size + Math.min(size, 12)); }
      for (j = 0; j < n; j++) {
        var v = m[i][j];
        ctx.fillStyle = v === null ? "#eeeeee" : heatColour(max > 0 ? v / max : 0);
        ctx.fillRect(pad + j * size, pad + i * size, size - 1, size - 1);
      }
    }
    cv.addEventListener("mousemove", function (ev) {
      var b = cv.getBoundingClientRect();
      var j = Math.floor((ev.clientX - b.left - pad) / size), i = Math.floor((ev.clientY - b.top - pad) / size);
      if (i < 0 || j < 0 || i >= n || j >= n) return hideTip();
      var v = m[i][j];
      showTip(ev, "ranks " + i + " ↔ " + j + ": " + (v === null ? "not measured" : (v / 1000).toFixed(2) + " ms excess per transfer"));
    });
    cv.addEventListener("mouseleave", hideTip);
  }

  drawHeat(data("heat-data"));
  drawDelay(data("delay-data"));
  document.documentElement.setAttribute("data-report-ready", "1");
})();
