// "Will it fit?": walks common.memory's ladder for the question asked (exported by assets/make_site.py from
// common.memory.Ladder, what `python -m common.memory --json` prints) and takes the first rung whose peak is within
// the usable share of the GPU's memory with room for the model's own error (peak x (1 + error_band)), which is what
// recommend() answers. No memory model here: only that walk,
// the input checks and the drawing.
(function () {
  "use strict";
  var form = document.getElementById("fit-form");
  if (!form) return;

  function $(id) { return document.getElementById(id); }
  var PART_NAMES = {
    weights: "weights", grads: "gradients", optimizer: "AdamW state", master: "fp32 master", copies: "bf16 copies",
    activations: "activations", logits: "logits", buffers: "buffers"
  };
  var index = null;
  var files = {};  // "model/gpus" -> promise of the file's JSON
  var asked = 0;   // the latest question: an older file arriving late draws nothing

  function load(path) {
    if (!files[path]) {
      files[path] = fetch(path).then(function (response) {
        if (!response.ok) throw new Error(path + ": HTTP " + response.status);
        return response.json();
      });
    }
    return files[path];
  }

  function option(select, value, text) {
    var element = document.createElement("option");
    element.value = value;
    element.textContent = text;
    select.appendChild(element);
  }

  function billions(count) {
    return count >= 1e9 ? (count / 1e9).toFixed(1) + "B" : (count / 1e6).toFixed(1) + "M";
  }

  function init(data) {
    index = data;
    data.models.forEach(function (model) {
      option($("fit-model"), model.name, model.name + (model.hub_id ? " (" + model.hub_id + ", " : " (")
        + billions(model.parameters) + " parameters" + (model.moe ? ", mixture of experts" : "") + ")");
    });
    $("fit-model").value = data.models.some(function (m) { return m.name === "qwen3-4b"; }) ? "qwen3-4b"
      : data.models[0].name;
    Object.keys(data.gpu_memory_gib).forEach(function (name) {
      option($("fit-gpu"), String(data.gpu_memory_gib[name]), name + " (" + data.gpu_memory_gib[name] + " GiB)");
    });
    data.seq_lens.forEach(function (length) { option($("fit-seq-lens"), String(length), String(length)); });
    form.querySelectorAll("input[name=training]").forEach(function (radio) {
      var label = radio.parentNode.lastChild;
      if (radio.value === "lora") label.textContent = " LoRA (rank " + data.lora_rank + ")";
      if (radio.value === "qlora") label.textContent = " QLoRA (rank " + data.lora_rank + ", 4-bit base)";
    });
    $("fit-scope").textContent = "Answers exist for " + data.gpus[0] + " to " + data.gpus[data.gpus.length - 1]
      + " GPUs of any memory and for sequence lengths of " + data.seq_lens.join(", ") + " tokens, "
      + data.rows_per_gpu + " rows per GPU and step, PCIe links; a rung fits when its peak plus a "
      + Math.round(data.error_band * 100) + "% margin for the memory model's own error (the largest under-prediction "
      + "over the committed GPU runs) is within " + Math.round(data.usable_fraction * 100) + "% of the GPU's memory, "
      + "in GiB as the driver reports it (an H100 80GB has 79.6).";
    $("fit-gpu").addEventListener("change", function () {
      if ($("fit-gpu").value) $("fit-mem").value = $("fit-gpu").value;
      update();
    });
    $("fit-mem").addEventListener("input", function () {
      if ($("fit-gpu").value !== $("fit-mem").value) $("fit-gpu").value = "";
    });
    form.addEventListener("input", update);
    form.addEventListener("change", update);
    form.addEventListener("submit", function (event) { event.preventDefault(); update(); });
    $("fit-copy").addEventListener("click", copyCommand);
    update();
  }

  function cliCommand(question) {
    return "uv run python -m common.memory --model " + question.model.name + " --gpus " + question.gpusText
      + " --gpu-mem-gib " + question.memText + " --seq-len " + question.seqText
      + (question.training === "lora" ? " --lora-rank " + index.lora_rank : "")
      + (question.training === "qlora" ? " --qlora" : "");
  }

  // The question as typed, or the one line that says what is wrong with it.
  function read() {
    var model = index.models.filter(function (m) { return m.name === $("fit-model").value; })[0];
    var question = {
      model: model, training: form.querySelector("input[name=training]:checked").value,
      gpusText: $("fit-gpus").value.trim(), memText: $("fit-mem").value.trim(), seqText: $("fit-seq").value.trim()
    };
    question.gpus = Number(question.gpusText);
    question.mem = Number(question.memText);
    question.seq = Number(question.seqText);
    var elsewhere = " (the command line answers any: " + "uv run python -m common.memory --model " + model.name
      + " --gpus N --gpu-mem-gib GIB --seq-len TOKENS)";
    if (question.gpusText === "") return "Give the number of GPUs.";
    if (!Number.isInteger(question.gpus) || question.gpus < 1) {
      return "The number of GPUs must be a whole number of at least 1, not " + question.gpusText + ".";
    }
    if (question.memText === "") return "Give the memory of one GPU in GiB (a number above 0), or pick a GPU.";
    if (!(question.mem > 0)) return "The GPU memory must be more than 0 GiB, not " + question.memText + ".";
    if (question.seqText === "") return "Give the sequence length in tokens.";
    if (!Number.isInteger(question.seq) || question.seq < 1) {
      return "The sequence length must be a whole number of at least 1 token, not " + question.seqText + ".";
    }
    if (index.gpus.indexOf(question.gpus) < 0) {
      return "This page holds answers for " + index.gpus[0] + " to " + index.gpus[index.gpus.length - 1]
        + " GPUs, not " + question.gpus + elsewhere + ".";
    }
    if (index.seq_lens.indexOf(question.seq) < 0) {
      return "This page holds sequence lengths of " + index.seq_lens.join(", ") + " tokens, not " + question.seq
        + elsewhere + ".";
    }
    if (model.trainings.indexOf(question.training) < 0) {
      return model.name + " is a mixture of experts: LoRA on its experts is not priced (full fine-tuning only).";
    }
    return question;
  }

  function show(id, on) { $(id).hidden = !on; }

  function error(text) {
    $("fit-error").textContent = text;
    show("fit-error", true);
    show("fit-answer", false);
  }

  function update() {
    if (!index) return;
    var question = read();
    var ticket = ++asked;
    if (typeof question === "string") { error(question); return; }
    load("fit/" + question.model.name + "/" + question.gpus + ".json").then(function (file) {
      if (ticket === asked) draw(question, file.ladders[String(question.seq)][question.training]);
    }).catch(function (failure) {
      if (ticket === asked) error("Could not load the answers for this model: " + failure.message);
    });
  }

  function rungsOf(ladder) {
    return ladder.rungs.map(function (row, position) {
      var group = ladder.groups[row[0]];
      return {
        position: position, group: row[0], strategy: group[0], flags: group[1], lora_rank: group[2], qlora: group[3],
        micro: row[1], accum: row[2], checkpointing: row[3] === 1, peak: row[4], phase: row[5], cpu: row[6],
        parts: row[7], command: row[8]
      };
    });
  }

  // As common.memory labels a rung (recommend.py's _label), with the strategy's own flags after it.
  function label(rung) {
    return rung.strategy + (rung.checkpointing ? " + activation checkpointing" : "")
      + (rung.qlora ? " + QLoRA r" + rung.lora_rank : rung.lora_rank ? " + LoRA r" + rung.lora_rank : "")
      + (rung.micro > 1 ? ", micro-batch " + rung.micro : "");
  }

  function stage(rung) {
    if (!rung.lora_rank) return "Full fine-tuning";
    if (rung.qlora) return "QLoRA, rank " + rung.lora_rank + " on a 4-bit base";
    return "LoRA, rank " + rung.lora_rank + (/-offload$/.test(rung.strategy) ? ", offloaded to the CPU" : "");
  }

  function gib(value, digits) { return value.toFixed(digits) + " GiB"; }

  // The peak with room for the model's own error, computed as common.memory's MemoryEstimate.needed_gib is.
  function needed(rung) { return rung.peak * (1 + index.error_band); }

  function draw(question, ladder) {
    var usable = question.mem * index.usable_fraction;
    var rungs = rungsOf(ladder);
    var first = null;
    for (var i = 0; i < rungs.length; i++) { if (needed(rungs[i]) <= usable) { first = rungs[i]; break; } }
    // One bar per strategy: its first rung that fits, else its smallest; stages up to the answer's.
    var shown = [], byGroup = {};
    rungs.forEach(function (rung) {
      var mine = byGroup[rung.group];
      if (!mine) { mine = byGroup[rung.group] = { fit: null, smallest: rung }; shown.push(mine); }
      if (!mine.fit && needed(rung) <= usable) mine.fit = rung;
      if (rung.peak < mine.smallest.peak) mine.smallest = rung;
    });
    var lastStage = first ? stage(first) : null, passed = false;
    shown = shown.filter(function (entry) {
      var rung = entry.fit || entry.smallest;
      if (passed && stage(rung) !== lastStage) return false;
      if (lastStage && stage(rung) === lastStage) passed = true;
      return true;
    });
    var answer = $("fit-answer");
    answer.dataset.peak = first ? String(first.peak) : "";
    answer.dataset.strategy = first ? first.strategy : "";
    if (first) {
      $("fit-verdict").innerHTML = "";
      var strong = document.createElement("strong");
      strong.textContent = label(first) + (first.flags.length ? " " + first.flags.join(" ") : "");
      $("fit-verdict").appendChild(strong);
      $("fit-verdict").appendChild(document.createTextNode(
        " fits: " + gib(first.peak, 2) + " per GPU (peak at the " + first.phase + ") + "
        + gib(needed(first) - first.peak, 2) + " margin = " + gib(needed(first), 2) + " of " + gib(usable, 1)
        + " usable on each of " + question.gpus + " x " + question.mem + " GiB"
        + (first.cpu ? ", plus " + gib(first.cpu, 1) + " of CPU memory per rank" : "")
        + (stage(first) !== stage(rungs[0]) ? "; " + stage(rungs[0]).toLowerCase() + " fits nowhere" : "") + "."));
      $("fit-command").textContent = first.command;
    } else {
      var smallest = rungs.reduce(function (a, b) { return b.peak < a.peak ? b : a; });
      $("fit-verdict").textContent = "Nothing fits in " + gib(usable, 1) + " per GPU: the smallest, " + label(smallest)
        + ", needs " + gib(needed(smallest), 1) + " with its margin (" + gib(smallest.peak, 1) + " predicted). "
        + "Shorten the sequence, or add GPUs.";
      $("fit-command").textContent = "(none)";
    }
    show("fit-copy", !!first);
    $("fit-copy").textContent = "Copy";
    $("fit-cli").textContent = cliCommand(question);
    drawBars(shown, usable, first);
    show("fit-error", false);
    show("fit-answer", true);
  }

  function drawBars(shown, usable, first) {
    var legend = $("fit-legend"), bars = $("fit-bars");
    legend.innerHTML = "";
    index.parts.forEach(function (part) {
      var key = document.createElement("span");
      key.className = "fit-key fit-part-" + part;
      key.textContent = PART_NAMES[part] || part;
      legend.appendChild(key);
    });
    bars.innerHTML = "";
    var scale = shown.reduce(function (most, entry) {
      return Math.max(most, (entry.fit || entry.smallest).peak);
    }, usable) * 1.02;
    var currentStage = null;
    shown.forEach(function (entry) {
      var rung = entry.fit || entry.smallest;
      if (stage(rung) !== currentStage) {
        currentStage = stage(rung);
        var heading = document.createElement("p");
        heading.className = "fit-stage";
        heading.textContent = currentStage;
        bars.appendChild(heading);
      }
      var row = document.createElement("div");
      row.className = "fit-row" + (entry.fit ? " fit-fits" : " fit-nofit") + (rung === first ? " fit-chosen" : "");
      var name = document.createElement("div");
      name.className = "fit-name";
      name.textContent = (rung === first ? "\u2192 " : "") + rung.strategy
        + (rung.flags.length ? " " + rung.flags.join(" ") : "")
        + (rung.checkpointing ? " + activation checkpointing" : "")
        + ", micro-batch " + rung.micro + " x " + rung.accum;
      var track = document.createElement("div");
      track.className = "fit-track";
      var total = rung.parts.reduce(function (sum, value) { return sum + value; }, 0) || 1;
      index.parts.forEach(function (part, i) {
        if (!rung.parts[i]) return;
        var piece = document.createElement("span");
        piece.className = "fit-piece fit-part-" + part;
        piece.style.width = (100 * rung.parts[i] / scale * rung.peak / total).toFixed(3) + "%";
        piece.title = (PART_NAMES[part] || part) + ": " + gib(rung.parts[i], 2);
        track.appendChild(piece);
      });
      var line = document.createElement("span");
      line.className = "fit-usable";
      line.style.left = (100 * usable / scale).toFixed(3) + "%";
      line.title = "usable: " + gib(usable, 1);
      track.appendChild(line);
      var value = document.createElement("div");
      value.className = "fit-value";
      value.textContent = gib(rung.peak, 1) + (entry.fit ? "" : " (does not fit)");
      row.appendChild(name);
      row.appendChild(track);
      row.appendChild(value);
      bars.appendChild(row);
    });
  }

  function copyCommand() {
    var text = $("fit-command").textContent;
    var done = function () { $("fit-copy").textContent = "Copied"; };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, selectCommand);
    } else {
      selectCommand();
    }
  }

  function selectCommand() {
    var range = document.createRange();
    range.selectNodeContents($("fit-command"));
    var selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    $("fit-copy").textContent = "Selected: press Ctrl+C";
  }

  load("fit/index.json").then(init).catch(function (failure) {
    error("Could not load the calculator's data: " + failure.message);
  });
})();
