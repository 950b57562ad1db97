"""Offline translation benchmark: the same weights and sentences through PyTorch (greedy with its
KV cache), ONNX Runtime fp32/int8 (OnnxTranslator) and CTranslate2 fp32/int8, fairly.

    nmtserve bench offline bundles/default --report runs/bench/offline.json   # + offline.png

Fair by construction:
- every measurement runs in a process of its own (`python -m nmtserve.loadtests.bench_offline
  worker …`) that imports only its engine; the report lists the engines' modules each worker had
  loaded, and an ONNX Runtime worker never has torch or ctranslate2 beside it;
- a run starts one worker per engine and thread count, in an order rotated from run to run, and
  each worker translates the sentences `repeats` times at every batch size after a warm-up (on a GPU,
  a whole pass at each batch size; the median pass counts); `runs` runs, so the engines interleave and
  drift of the machine hits them alike;
- thread counts are swept (half the usable cores and all of them, by default), each in two layouts
  where the engine has both (ONNX Runtime, CTranslate2): n intra-op threads on one batch at a time
  (1×n), and n batches at a time on one thread each (n×1, CTranslate2's `inter_threads`); each
  engine is reported, per batch size, at its best layout, as the median with min–max over runs;
- CTranslate2 runs its own kernels in AVX2 code on every x86 CPU, Intel's too, unless told otherwise
  (`CT2_FORCE_CPU_ISA=AVX512`; its src/cpu/cpu_isa.cc: "AVX512 can only be enabled with the environment
  variable"): where the CPU has what its AVX-512 code needs, each CTranslate2 layout is measured both ways
  (`1x2` and `1x2+avx512`), and the report keeps what CTranslate2 logged of the code it chose (CT2_VERBOSE);
- the report records the CPU model and flags, cores and the libraries' versions, and how fast the host
  ran before and after each measurement (`host_probe`: one core's vector and L3 speed), so a ratio can
  be read against the spells of a shared machine.
- on a CPU the report also gives the limit of the host (`limit`): ONNX Runtime's MatMul rate there, fp32 and
  int8, on the most threads swept (`product_peak`, in a worker of its own), and what a target token costs in
  products (`mflop_per_token`); each engine's best tokens/s is then a share of what those products alone
  would allow at that rate, so a report says how far each engine is from this host's limit.
Ratios are ours over CTranslate2's of the same precision, each at its best thread layout, and again with
both at one batch on one thread (1×1) where the sweep has it. Each worker's peak resident memory
(ru_maxrss: the model loaded and every batch size run) is reported too.

A bundle imported from a Hugging Face folder (`nmtserve import`: Marian, M2M100, NLLB) is measured against
that folder: CTranslate2 converts it with its own converter (TransformersConverter, as
`ct2-transformers-converter` does) and transformers' `generate` takes PyTorch's place. A multilingual model
translates from and into its default languages (the folder's src_lang and tgt_lang): every engine is given
the target language's token as the forced first one (CTranslate2's target_prefix).

    python -m nmtserve.loadtests.marian_model runs/opus-shaped     # random, OPUS-MT's shapes, eos never wins
    nmtserve import runs/opus-shaped --out runs/opus-shaped.pt && nmtserve export runs/opus-shaped.pt --out bundles/opus-shaped
    nmtserve bench offline bundles/opus-shaped --sentences-file runs/opus-shaped/sentences.txt --max-decoding-length 32 --beam-size 4

On a GPU (`--device cuda`, onnxruntime-gpu): ONNX Runtime's fp16 variant (`ort_fp16`), CTranslate2 in
float16 (`ct2_fp16`), PyTorch under fp16 autocast or transformers in fp16, one host thread each by default;
the report records the GPU (nvidia-smi) beside the CPU.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from nmtserve.console import Progress
from nmtserve.decoding import DecodingOptions
from nmtserve.errors import NmtserveError
from nmtserve.loadtests.charts import host, legend_outside, pyplot, save
from nmtserve.loadtests.machine import (
    PROBES,
    cpu_flags,
    describe,
    host_probe,
    machine_info,
    product_peak,
    usable_cores,
)
from nmtserve.loadtests.measure import CT2_ISA, layout_name, run_measure, run_worker

BATCH_SIZES = (1, 8, 32, 64)
ENGINES = ("pytorch", "transformers", "ort_fp32", "ort_int8", "ort_fp16", "ct2_fp32", "ct2_int8", "ct2_fp16")
# precisions that run on one device only: our fp32/int8 variants are CPU ones, fp16 is for CUDA (PyTorch and
# transformers run on either, in fp16 on CUDA)
ENGINE_DEVICE = {"ort_fp32": "cpu", "ort_int8": "cpu", "ct2_fp32": "cpu", "ct2_int8": "cpu",
                 "ort_fp16": "cuda", "ct2_fp16": "cuda"}
ENGINE_MODULES = ("torch", "transformers", "onnxruntime", "ctranslate2")
OWN_MODULES = {"pytorch": ("torch",), "transformers": ("torch", "transformers"), "ort": ("onnxruntime",),
               "ct2": ("ctranslate2",)}
RATIOS = (("ort_fp32", "ct2_fp32"), ("ort_int8", "ct2_int8"), ("ort_fp16", "ct2_fp16"), ("pytorch", "ct2_fp32"),
          ("ort_fp32", "transformers"), ("ort_fp16", "pytorch"), ("ort_fp16", "transformers"))


INTER_ENGINES = ("ort", "ct2")  # engines that also decode n batches at once (inter_threads)


def default_threads(device: str = "cpu") -> tuple[int, ...]:
    """Half the usable cores and all of them on a CPU; one host thread per engine on a GPU."""
    if device == "cuda":
        return (1,)
    cores = usable_cores()
    return tuple(sorted({max(1, cores // 2), cores}))


CT2_AVX512_FLAGS = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")  # what its AVX512 path asks for


def ct2_isas(device: str = "cpu") -> tuple[str, ...]:
    """CTranslate2's code paths to measure: its own choice ("") and, on a CPU that can run it, AVX512."""
    return ("", "AVX512") if device == "cpu" and set(CT2_AVX512_FLAGS) <= set(cpu_flags()) else ("",)


def layouts(engine: str, threads: tuple[int, ...], device: str = "cpu") -> list[tuple[int, int, str]]:
    """(inter, intra, isa) layouts to measure `engine` at: each thread count n as n intra-op threads on
    one batch, and, for engines that can, as n batches at once on one thread each; CTranslate2's at each
    of its code paths (`ct2_isas`), other engines' at "" (nothing forced)."""
    kind = engine.split("_")[0]
    counts = [(1, n) for n in threads] + [(n, 1) for n in threads if n > 1 and kind in INTER_ENGINES]
    return [(inter, intra, isa) for isa in (ct2_isas(device) if kind == "ct2" else ("",)) for inter, intra in counts]


@dataclass
class BenchConfig:
    bundle: str
    checkpoint: str | None = None  # default: the bundle's source checkpoint (PyTorch and the CTranslate2 conversion)
    sentences: int = 200
    runs: int = 3
    threads: tuple[int, ...] = ()  # () = default_threads()
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    engines: tuple[str, ...] = ENGINES
    sentences_file: str | None = None  # default: the test split of the bundle's training data
    max_decoding_length: int = 256
    beam_size: int = 1
    repeats: int = 3  # passes over the sentences at each batch size within a worker; the median pass counts
    device: str = "cpu"  # cuda: ONNX Runtime's fp16 variant, CTranslate2 float16, PyTorch/transformers in fp16


def imported_directory(bundle: str) -> str | None:
    """The Hugging Face folder an imported bundle came from; None for our own model's."""
    from nmtserve.export.runtime.bundle import load_bundle

    imported = load_bundle(bundle).manifest["source"].get("imported_from")
    return imported["directory"] if imported else None


def runs_on(engine: str, device: str) -> bool:
    return ENGINE_DEVICE.get(engine, device) == device


def default_engines(bundle: str, device: str = "cpu") -> tuple[str, ...]:
    """Every engine of the device but the other reference: PyTorch for our own model's bundle,
    transformers for one imported from a Hugging Face folder."""
    other = "pytorch" if imported_directory(bundle) else "transformers"
    return tuple(e for e in ENGINES if runs_on(e, device) and e != other)


def check_engines(engines: tuple[str, ...], device: str) -> None:
    """Every engine known and able to run on `device`, or one line naming the ones that are not."""
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise NmtserveError(f"--engines: unknown {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    elsewhere = [e for e in engines if not runs_on(e, device)]
    if elsewhere:
        raise NmtserveError(f"--engines: {', '.join(elsewhere)} do not run on --device {device} "
                            f"(on it: {', '.join(e for e in ENGINES if runs_on(e, device))})")


# -- the worker: one engine, one thread count, every batch size

def _load_engine(engine: str, inter: int, threads: int, spec: dict):
    """function(sources as token ids, batch size) -> target token ids, importing only `engine`'s library."""
    if engine == "pytorch":
        import torch

        from nmtserve.decoding import sorted_batches
        from nmtserve.training.checkpoint import load_model
        from nmtserve.training.data import pad
        from nmtserve.training.decode import beam_search, greedy_decode

        torch.set_num_threads(threads)
        device = spec["device"]
        model = load_model(spec["checkpoint"], device=device).model
        search = spec["search"]

        @torch.inference_mode()
        @torch.autocast(device, dtype=torch.float16, enabled=device == "cuda")
        def decode(src, mask):
            if search["beam_size"] == 1:
                return greedy_decode(model, src, mask, search["max_decoding_length"], search["length_rule"])[0]
            return [found[0][0] for found in beam_search(
                model, src, mask, beam_size=search["beam_size"], length_penalty=search["length_penalty"],
                patience=search["patience"], beam_stopping=search["beam_stopping"],
                max_decoding_length=search["max_decoding_length"], length_rule=search["length_rule"])]

        def run(sources, batch_size):
            out = [None] * len(sources)
            for rows in sorted_batches([len(s) for s in sources], batch_size):
                src, mask = pad([sources[i] for i in rows], model.config.pad_id)
                for i, tokens in zip(rows, decode(src.to(device), mask.to(device))):
                    out[i] = tokens
            return out
        return run
    if engine == "transformers":
        import torch
        from transformers import AutoModelForSeq2SeqLM

        from nmtserve.decoding import sorted_batches

        torch.set_num_threads(threads)
        device = spec["device"]
        model = AutoModelForSeq2SeqLM.from_pretrained(
            spec["hf_directory"], dtype=torch.float16 if device == "cuda" else torch.float32).to(device).eval()
        pad_id, eos_id, prefix = model.config.pad_token_id, model.config.eos_token_id, spec["prefix"]
        forced = {"forced_bos_token_id": prefix[0]} if prefix else {}

        def run(sources, batch_size):
            out = [None] * len(sources)
            for rows in sorted_batches([len(s) for s in sources], batch_size):
                width = max(len(sources[i]) for i in rows)
                ids = torch.tensor([sources[i] + [pad_id] * (width - len(sources[i])) for i in rows])
                with torch.inference_mode():
                    ids = ids.to(device)
                    generated = model.generate(input_ids=ids, attention_mask=ids != pad_id, do_sample=False,
                                               num_beams=spec["search"]["beam_size"],
                                               max_new_tokens=spec["search"]["max_decoding_length"],
                                               forced_eos_token_id=None, **forced)
                for i, row in zip(rows, generated[:, 1 + len(prefix):].tolist()):  # after the start and forced ones
                    out[i] = row[:row.index(eos_id)] if eos_id in row else [t for t in row if t != pad_id]
            return out
        return run
    if engine.startswith("ort_"):
        from nmtserve.export.runtime.translator import OnnxTranslator

        tr = OnnxTranslator(spec["bundle"], device=spec["device"], variant=engine[4:], intra_op_threads=threads,
                            inter_threads=inter)
        options, prefix = DecodingOptions(**spec["search"]), spec["prefix"]
        return lambda sources, batch_size: [found[0].tokens for found in tr.search_ids(
            sources, options, max_batch_size=batch_size, scores=False,
            prefixes=[prefix] * len(sources) if prefix else None)]
    if engine.startswith("ct2_"):
        import ctranslate2

        ct = ctranslate2.Translator(spec["ct2_model"], device=spec["device"], intra_threads=threads, inter_threads=inter,
                                    compute_type={"ct2_fp32": "float32", "ct2_int8": "int8", "ct2_fp16": "float16"}[engine])
        vocab, prefix = spec["vocab"], [spec["vocab"][i] for i in spec["prefix"]]
        ids = {piece: i for i, piece in enumerate(vocab)}

        def run(sources, batch_size):
            results = ct.translate_batch([[vocab[i] for i in s] for s in sources], beam_size=spec["search"]["beam_size"],
                                         length_penalty=spec["search"]["length_penalty"],
                                         max_batch_size=batch_size, batch_type="examples",
                                         max_decoding_length=spec["search"]["max_decoding_length"],
                                         min_decoding_length=0,  # as ours: eos may come first (its default is 1)
                                         target_prefix=[prefix] * len(sources) if prefix else None)
            return [[ids[p] for p in r.hypotheses[0][len(prefix):]] for r in results]
        return run
    raise NmtserveError(f"unknown engine {engine!r}")


def _rss_mb(field: str) -> float:
    """This process's resident memory, "VmRSS" (now) or "VmHWM" (its peak, which starts afresh at exec, where
    ru_maxrss would carry the runner's peak over into the worker), Linux; elsewhere ru_maxrss."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def mflop_per_token(model: dict, beam_size: int, source_tokens: int, target_tokens: int) -> dict:
    """What a target token costs in the model's products (multiply-adds × 2; attention's own small products and
    everything else left out), MFLOP: `decoder_step_row`, a decoder step of one row (each layer's self-attention
    projections, its cross-attention's query and output projections, its feed-forward block; the output
    projection over the vocabulary), `encoder_source_token`, one source token through the encoder and the
    decoder's cross K/V projections, and `per_target_token`: beam_size rows a step, and the encoder's share."""
    d, ff, vocab = model["d_model"], model["d_ff"], model["vocab_size"]
    step = model["n_decoder_layers"] * (6 * d * d + 2 * d * ff) + d * vocab
    source = model["n_encoder_layers"] * (4 * d * d + 2 * d * ff) + model["n_decoder_layers"] * 2 * d * d
    step_mflop, source_mflop = 2 * step / 1e6, 2 * source / 1e6
    return {"decoder_step_row": round(step_mflop, 3), "encoder_source_token": round(source_mflop, 3),
            "per_target_token": round(beam_size * step_mflop + source_mflop * source_tokens / target_tokens, 3)}


def measure(engine: str, inter: int, threads: int, spec: dict) -> dict:
    """Warm up, then translate every source `repeats` times at each batch size (in this process), keeping
    the median pass: one pass of 200 short sentences lasts 0.1–0.5 s at the larger batches, where a
    hiccup of the machine or a first call at a new shape shows. On a GPU an untimed pass at each batch size comes
    first (there a first pass took several times a later one). The host probe runs before and after."""
    probe_before = host_probe()
    started = time.perf_counter()
    run = _load_engine(engine, inter, threads, spec)
    load_seconds, loaded_rss = time.perf_counter() - started, _rss_mb("VmRSS")
    sources = spec["sources"]
    run(sources[:16], 8)  # first-call allocations, lazy kernels
    seconds, tokens, outputs = {}, {}, {}
    for batch in spec["batch_sizes"]:
        if spec["device"] == "cuda":  # a GPU's first pass at a batch size allocates and tunes for each new shape
            run(sources, batch)
        passes = []
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            out = run(sources, batch)
            passes.append(time.perf_counter() - t0)
        seconds[str(batch)] = statistics.median(passes)
        tokens[str(batch)] = sum(len(o) for o in out)
        outputs[str(batch)] = out
    first = outputs[str(spec["batch_sizes"][0])]
    return {"seconds": seconds, "tokens": tokens, "outputs": outputs[str(spec["batch_sizes"][-1])],
            "same_output_at_every_batch_size": all(o == first for o in outputs.values()),
            "peak_rss_mb": _rss_mb("VmHWM"), "load_seconds": round(load_seconds, 2), "rss_after_load_mb": loaded_rss,
            "host_probe": [probe_before, host_probe()],
            "modules_loaded": [m for m in ENGINE_MODULES if m in sys.modules]}


# -- the runner

def _spec(cfg: BenchConfig, workdir: Path) -> dict:
    from nmtserve.export.runtime.bundle import load_bundle
    from nmtserve.loadtests.workload import default_sentence_file, read_sentences

    bundle = load_bundle(cfg.bundle)
    tokenizer = bundle.tokenizer()
    texts = read_sentences(cfg.sentences_file or default_sentence_file(cfg.bundle))[: cfg.sentences]
    sources = [tokenizer.encode(t, bundle.limits.max_source_tokens) or [tokenizer.special_ids()["eos"]]
               for t in texts]
    checkpoint = cfg.checkpoint or bundle.manifest["source"]["checkpoint"]
    imported = imported_directory(cfg.bundle)
    if "transformers" in cfg.engines and not imported:
        raise NmtserveError(f"--engines transformers: {cfg.bundle} was not imported from a Hugging Face folder")
    # our engines search as the model's defaults say (an imported Marian model's length penalty and
    # stopping rule: what transformers' generate does with the same directory), at the asked beam and length;
    # our own model's with CTranslate2's length rule, so that a sentence that never says eos costs every engine
    # the same steps (nmtserve's 2 × source + 10 cap would stop ours where CTranslate2 decodes on)
    search = replace(DecodingOptions(**(bundle.manifest.get("decoding_defaults") or {})).override(
        beam_size=cfg.beam_size), max_decoding_length=cfg.max_decoding_length)
    if not imported:
        search = replace(search, length_rule="ctranslate2")
    spec = {"bundle": cfg.bundle, "model": bundle.model, "device": cfg.device, "checkpoint": checkpoint,
            "hf_directory": imported, "sources": sources, "batch_sizes": list(cfg.batch_sizes),
            "repeats": cfg.repeats, "search": asdict(search), "prefix": tokenizer.target_prefix()}
    if any(e.startswith("ct2_") for e in cfg.engines):
        # converted here, once, in the runner (torch), never in a measuring process
        if imported:  # by CTranslate2's own converter, from the directory the bundle was imported from
            from ctranslate2.converters import TransformersConverter

            spec["ct2_model"] = TransformersConverter(imported).convert(str(workdir / "ct2"))
        else:
            from nmtserve.export.build.to_ctranslate2 import convert
            from nmtserve.training.checkpoint import load_model

            spec["ct2_model"] = str(convert(load_model(checkpoint), workdir / "ct2"))
        spec["vocab"] = [tokenizer.piece(i) for i in range(tokenizer.vocab_size)]
    return spec


def run_bench(cfg: BenchConfig, progress: Progress) -> dict:
    check_engines(cfg.engines, cfg.device)
    threads = cfg.threads or default_threads(cfg.device)
    configs = [(engine, *layout) for engine in cfg.engines for layout in layouts(engine, threads, cfg.device)]
    runs: dict[tuple[str, int, int, str], list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="nmtserve-bench-") as tmp:
        spec = _spec(cfg, Path(tmp))
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        # this host's MatMul rate, on the most threads swept, in a process with ONNX Runtime only, before the runs
        progress.expect(cfg.runs * len(configs) + (cfg.device == "cpu"))
        if cfg.device == "cpu":
            progress.stage("the host's MatMul rate")
        peak = run_measure(["nmtserve.loadtests.bench_offline", "peak"], 1, max(threads), spec_path,
                           "the MatMul peak")[0] if cfg.device == "cpu" else None
        for run in range(cfg.runs):
            for engine, inter, t, isa in configs[run % len(configs):] + configs[: run % len(configs)]:
                progress.stage(f"run {run + 1}/{cfg.runs}: {engine}, {inter} batch(es) at once × {t} thread(s)"
                         + (f", {CT2_ISA}={isa}" if isa else ""))
                runs[(engine, inter, t, isa)].append(run_worker(engine, inter, t, spec_path, isa))
    return _report(cfg, threads, runs, spec, peak)


def _stats(values: list[float], digits: int = 1) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def _report(cfg: BenchConfig, threads: tuple[int, ...], runs: dict, spec: dict, peak: dict | None) -> dict:
    n_sentences, checkpoint = len(spec["sources"]), spec["checkpoint"]
    batches = [str(b) for b in cfg.batch_sizes]
    results: dict = {}
    for (engine, *layout), measured in runs.items():
        results.setdefault(engine, {})[layout_name(*layout)] = {
            b: {**_stats([m["tokens"][b] / m["seconds"][b] for m in measured]),
                "runs": [round(m["tokens"][b] / m["seconds"][b], 1) for m in measured]} for b in batches}
    swept = {e: layouts(e, threads, cfg.device) for e in cfg.engines}  # (reads /proc/cpuinfo: once per engine)
    best: dict = {}
    for engine, by_layout in results.items():
        for b in batches:
            inter, t, isa = max(swept[engine],
                                key=lambda layout: by_layout[layout_name(*layout)][b]["median"])
            layout = layout_name(inter, t, isa)
            best.setdefault(engine, {})[b] = {"layout": layout, "inter_threads": inter, "threads": t,
                                              **({"ct2_isa": isa or "default"} if engine.startswith("ct2_") else {}),
                                              **{k: by_layout[layout][b][k] for k in ("median", "min", "max")}}
    pairs = [(ours, theirs) for ours, theirs in RATIOS if ours in best and theirs in best]
    ratios = {f"{ours}/{theirs}": {b: round(best[ours][b]["median"] / best[theirs][b]["median"], 3) for b in batches}
              for ours, theirs in pairs}

    def per_run(engine: str, b: str) -> list[float]:
        return results[engine][best[engine][b]["layout"]][b]["runs"]

    # the same ratio within each run (both engines measured in the same round, minutes apart at most):
    # this host's slow spells last minutes, so the spread of these shows how far the ratio itself moved
    paired_ratios = {f"{ours}/{theirs}": {b: _stats([o / t for o, t in zip(per_run(ours, b), per_run(theirs, b))], 3)
                                          for b in batches} for ours, theirs in pairs}
    # the same ratio with both engines at one batch on one thread (1×1; CTranslate2 at its faster code path there),
    # where both measured it: set beside the best layouts, it shows how much of a ratio comes from what each engine
    # gains from its other threads
    def single(engine: str, b: str) -> float | None:
        cells = [results[engine][name][b]["median"] for name in results[engine] if name.split("+")[0] == "1x1"]
        return max(cells, default=None)

    single_ratios = {f"{ours}/{theirs}": {b: round(single(ours, b) / single(theirs, b), 3) for b in batches}
                     for ours, theirs in pairs if single(ours, batches[0]) and single(theirs, batches[0])}
    reference = next(e for e in ("pytorch", "transformers", "ort_fp32", *cfg.engines) if e in cfg.engines)
    agreement, modules, batch_independent, peak_rss, output_tokens, probe_runs, ct2_logged = {}, {}, {}, {}, {}, {}, {}
    loading: dict = {}  # per engine: load seconds and resident memory once loaded, over every worker
    at_limit = {}  # sentences decoded to --max-decoding-length: a batch holding one runs that many steps
    for (engine, inter, t, isa), measured in runs.items():
        probe_runs.setdefault(engine, {})[layout_name(inter, t, isa)] = [m["host_probe"] for m in measured]  # [before, after]
        if "ct2_logged" in measured[0]:
            ct2_logged.setdefault(engine, {})[layout_name(inter, t, isa)] = measured[0]["ct2_logged"]
        modules.setdefault(engine, set()).update(*(m["modules_loaded"] for m in measured))
        peak_rss[engine] = max(peak_rss.get(engine, 0), *(m["peak_rss_mb"] for m in measured))
        for key in ("load_seconds", "rss_after_load_mb"):
            loading.setdefault(engine, {}).setdefault(key, []).extend(m[key] for m in measured)
        output_tokens[engine] = round(measured[0]["tokens"][batches[-1]] / n_sentences, 2)
        at_limit[engine] = sum(len(o) >= cfg.max_decoding_length for o in measured[0]["outputs"])
        batch_independent[engine] = batch_independent.get(engine, True) and all(
            m["same_output_at_every_batch_size"] for m in measured)
        if (reference, 1, threads[0], "") in runs and engine != reference and (inter, t, isa) == (1, threads[0], ""):
            ref = runs[(reference, 1, threads[0], "")][0]["outputs"]
            agreement[f"{engine}_vs_{reference}_identical"] = round(
                sum(a == b for a, b in zip(measured[0]["outputs"], ref)) / n_sentences, 4)
    return {"machine": machine_info(cfg.device), "device": cfg.device, "checkpoint": checkpoint, "bundle": cfg.bundle,
            "limit": _limit(peak, spec, best, output_tokens, n_sentences, cfg.beam_size) if peak else None,
            "sentences": n_sentences, "runs": cfg.runs, "repeats": cfg.repeats, "threads_swept": list(threads),
            "layouts_swept": {e: [layout_name(*lt) for lt in swept[e]] for e in cfg.engines},
            "ct2_logged": ct2_logged,
            "batch_sizes": list(cfg.batch_sizes),
            "unit": f"target tokens/s (eos excluded), {decoding_name(cfg.beam_size)}",
            "max_decoding_length": cfg.max_decoding_length, "beam_size": cfg.beam_size,
            "length_rule": spec["search"]["length_rule"],
            "results": results, "best": best, "ratios": ratios, "paired_ratios": paired_ratios,
            "single_thread_ratios": single_ratios,
            "token_agreement": agreement,
            "peak_rss_mb": peak_rss, "mean_output_tokens": output_tokens, "at_max_decoding_length": at_limit,
            "loading": {e: {k: _stats(v, 2) for k, v in by.items()} for e, by in loading.items()},
            "same_output_at_every_batch_size": batch_independent,
            "host_probe": {e: {name: _stats([p[name] for runs in by_layout.values() for pair in runs for p in pair])
                               for name in PROBES} for e, by_layout in probe_runs.items()},
            "host_probe_runs": probe_runs,
            "worker_modules_loaded": {e: sorted(m) for e, m in modules.items()}}


def _limit(peak: dict, spec: dict, best: dict, output_tokens: dict, n_sentences: int, beam_size: int) -> dict:
    """The host's MatMul peak, a target token's cost in products (by the first engine's output tokens: the engines
    decode the same counts, or the table says so) and the tokens/s those products alone would allow at the peak of
    each precision (`ceiling`); each engine's best tokens/s as a share of its precision's ceiling."""
    cost = mflop_per_token(spec["model"], beam_size, sum(len(s) for s in spec["sources"]),
                           round(next(iter(output_tokens.values())) * n_sentences))
    ceiling = {precision: round(peak[rate] * 1e3 / cost["per_target_token"])
               for precision, rate in (("fp32", "fp32_gflops"), ("int8", "int8_gops"))}
    precision = {engine: "int8" if engine.endswith("int8") else "fp32" for engine in best}
    return {"peak": peak, "mflop": cost, "ceiling_tokens_per_s": ceiling,
            "share_of_ceiling": {engine: {b: round(cell["median"] / ceiling[precision[engine]], 3)
                                          for b, cell in cells.items()} for engine, cells in best.items()}}


def decoding_name(beam_size: int) -> str:
    return "greedy" if beam_size == 1 else f"beam {beam_size}"


def check_isolation(report: dict) -> list[str]:
    """'engine: module' for each other engine's library a measuring process of `engine` had loaded."""
    return [f"{engine}: {module}" for engine, loaded in report["worker_modules_loaded"].items()
            for module in loaded if module not in OWN_MODULES[engine.split("_")[0]]]


def format_table(report: dict) -> str:
    batches = [str(b) for b in report["batch_sizes"]]
    lines = [describe(report["machine"]),
             f"{report['sentences']} sentences, {report['unit']}; each engine in its own process at its best of "
             f"{', '.join(map(str, report['threads_swept']))} thread(s), as batches at once × threads each (t=); "
             f"median [min–max] of {report['runs']} runs, each the median of {report.get('repeats', 1)} passes",
             f"{'engine':<10}" + "".join(f"{'batch ' + b:>28}" for b in batches)]
    for engine, cells in report["best"].items():
        lines.append(f"{engine:<10}" + "".join(
            f"{c['median']:>9,.0f} [{c['min']:,.0f}–{c['max']:,.0f}] t={c['layout']}".rjust(28)
            for c in (cells[b] for b in batches)))
    for name, row in report["ratios"].items():
        lines.append(f"{name:<18}" + "".join(f"{row[b]:>8.2f}" for b in batches) + "   (of the medians)")
        paired = report["paired_ratios"][name]
        lines.append(f"{'  within each run':<18}" + "".join(
            f"{paired[b]['median']:.2f} [{paired[b]['min']:.2f}–{paired[b]['max']:.2f}]".rjust(20) for b in batches))
        if name in report.get("single_thread_ratios", {}):
            row = report["single_thread_ratios"][name]
            lines.append(f"{'  both at 1x1':<18}" + "".join(f"{row[b]:>8.2f}" for b in batches)
                         + "   (one batch on one thread each)")
    for engine, by_layout in report.get("ct2_logged", {}).items():  # the same at every thread layout of a code path
        by_isa = {name.partition("+")[2] or "its own choice": logged for name, logged in by_layout.items()}
        lines.append(f"{engine}, as CTranslate2 logged its code: " + "; ".join(
            f"{isa}: " + ", ".join(f"{key} {value}" for key, value in logged.items()) for isa, logged in by_isa.items()))
    for name, share in report["token_agreement"].items():
        lines.append(f"{name}: {share:.1%}")
    lines.append("peak RSS (MB): " + ", ".join(f"{e} {mb:,.0f}" for e, mb in report["peak_rss_mb"].items()))
    lines.append("loaded (median s, MB resident): " + ", ".join(
        f"{e} {by['load_seconds']['median']:.2f} s, {by['rss_after_load_mb']['median']:,.0f} MB"
        for e, by in report.get("loading", {}).items()))
    lines.append("output tokens per sentence: " + ", ".join(f"{e} {n:.1f}" for e, n in report["mean_output_tokens"].items()))
    if any(report.get("at_max_decoding_length", {}).values()):  # where a GPU's flat-cost steps go (docs/performance-journal.md)
        lines.append(f"sentences decoded to the length limit ({report['max_decoding_length']} tokens, no eos), of "
                     f"{report['sentences']}: " + ", ".join(f"{e} {n}" for e, n in report["at_max_decoding_length"].items())
                     + "; each keeps its batch stepping to the limit")
    counts = report["mean_output_tokens"].values()
    if max(counts) > 1.01 * min(counts):  # tokens/s then compares unequal work: say so beside the table
        lines.append("NOTE: the engines decoded different numbers of tokens (more than 1% apart), so their tokens/s "
                     "do not measure the same work")
    if report.get("limit"):  # older reports lack it
        limit = report["limit"]
        peak, cost = limit["peak"], limit["mflop"]
        lines.append(f"limit: a target token costs {cost['per_target_token']:.1f} MFLOP of products (a decoder step "
                     f"{cost['decoder_step_row']:.2f} a row, the encoder {cost['encoder_source_token']:.2f} a source "
                     f"token); ONNX Runtime's MatMul on {peak['threads']} thread(s) here: fp32 {peak['fp32_gflops']:,.0f} "
                     f"GFLOP/s, int8 {peak['int8_gops']:,.0f} GOP/s, so at most {limit['ceiling_tokens_per_s']['fp32']:,} "
                     f"and {limit['ceiling_tokens_per_s']['int8']:,} tok/s; each engine's best as a share of its "
                     f"precision's: " + "; ".join(f"{e} " + " / ".join(f"{share[b]:.0%}" for b in batches)
                                                  for e, share in limit["share_of_ceiling"].items()))
    for name, what in PROBES.items():
        lines.append(f"host probe ({what}; one core, before and after each measurement), median [min–max]: " + ", ".join(
            f"{e} {p[name]['median']:,.1f} [{p[name]['min']:,.1f}–{p[name]['max']:,.1f}]"
            for e, p in report["host_probe"].items()))
    return "\n".join(lines)


def figure(report: dict):
    """Tokens/s against batch size, one line per engine and precision at its best thread layout, with the min–max of
    the runs as error bars; the legend outside the axes."""
    batches = report["batch_sizes"]
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    colors = {"pytorch": "tab:gray", "transformers": "tab:green", "ort": "tab:blue", "ct2": "tab:orange"}
    for engine, cells in report["best"].items():
        kind = engine.split("_")[0]
        medians = [cells[str(b)]["median"] for b in batches]
        spread = [[m - cells[str(b)]["min"] for b, m in zip(batches, medians)],
                  [cells[str(b)]["max"] - m for b, m in zip(batches, medians)]]
        ax.errorbar(batches, medians, yerr=spread, label=engine, color=colors[kind], capsize=3, marker="o",
                    linestyle="--" if engine.endswith("int8") else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (sentences)")
    ax.set_ylabel("target tokens/s")
    ax.set_ylim(bottom=0)
    bundle = Path(report.get("bundle") or "?").name
    ax.set_title(f"nmtserve bench offline {bundle}: {decoding_name(report['beam_size'])}, each engine at its best thread "
                 f"layout, median and min–max of {report['runs']} runs\n{host(report['machine'])}", fontsize=9)
    ax.grid(True, alpha=0.3)
    legend_outside(ax)
    fig.tight_layout()
    return fig


def draw_chart(report: dict, path: Path) -> None:
    save(figure(report), path, dpi=110)


if __name__ == "__main__" and sys.argv[1:2] == ["peak"]:  # peak INTER THREADS SPEC (run_measure's arguments)
    print(json.dumps(product_peak(int(sys.argv[3]))))
if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    engine_name, inter_count, thread_count, spec_file = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    print(json.dumps(measure(engine_name, inter_count, thread_count, json.loads(spec_file.read_text(encoding="utf-8")))))
