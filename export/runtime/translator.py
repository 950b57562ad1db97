"""OnnxTranslator: offline translation over a bundle with ONNX Runtime, greedy, beam search or sampling, with
CTranslate2's translate_batch. Torch-free and onnx-free.

    from nmtserve.export.runtime.translator import OnnxTranslator
    tr = OnnxTranslator("bundles/default", device="cpu", variant="int8")
    for t in tr.translate_batch(["The cat sleeps."], beam_size=4, num_hypotheses=2, return_scores=True):
        print(t.text, t.score, [(a.text, a.score) for a in t.alternatives])

Inputs are sorted by length and cut into batches of at most `max_batch_size` to cut padding. Greedy search runs
on the server's Engine (export/runtime/engine.py) with static batching, in the caller's thread: each batch is run
to its end in nmtserve's library where it runs, its finished rows leaving a quarter at a time. Beam search and
sampling run here (`search`): within a batch, a finished search's rows decode on, ignored, until such searches are
a quarter of the batch, then leave together. Small batches are encoded ahead, up to ENCODE_AHEAD sources in one
encoder call on the host, then decoded one after another: each graph's weights stay in the CPU cache between its
runs, and a call's fixed cost is paid once (a batch's result is the same either way). With inter_threads > 1
(CTranslate2's name) that many batches, or groups of them, decode at once on threads of their own, each with its
own binding over the same two sessions: on a CPU this uses the cores better than one batch on more intra-op
threads (docs/performance-journal.md, "Batches at once"). The sessions and steps are the Decoder's (decoder.py);
the searches' rules are nmtserve/search.py's.
"""

from __future__ import annotations

import math
import queue
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nmtserve.decoding import by_length, guided_groups, sorted_batches
from nmtserve.errors import ConfigError, NmtserveError
from nmtserve.export.runtime.batch import BatchState
from nmtserve.export.runtime.bundle import Bundle
from nmtserve.export.runtime.decoder import CUDA_INTER_THREADS, Decoder
from nmtserve.export.runtime.engine import Engine, EngineConfig
from nmtserve.export.runtime.request import FinishReason, Request
from nmtserve.search import BeamSearch, DecodingOptions, Hypothesis, beam_steps, make_search

ENCODE_AHEAD = 64  # search_ids encodes batches of up to this many sources in all before decoding them


@dataclass
class Translation:
    text: str
    tokens: list[int]  # target ids, eos excluded
    score: float | None = None  # sum of the chosen tokens' log-probabilities (eos included; beam search:
    # divided by length ** length_penalty), if asked
    alternatives: list[Translation] = field(default_factory=list)  # the rest of the n-best list, best first

    @property
    def hypotheses(self) -> list[Translation]:
        """The n-best list, best first."""
        return [self, *self.alternatives]


class OnnxTranslator(Decoder):
    """Offline translation over a Decoder: batches sorted by length, greedy search and beam search or sampling."""

    def __init__(self, bundle: str | Path | Bundle, device: str = "cpu", variant: str | None = None,
                 intra_op_threads: int = 0, io_binding: bool | None = None, shared_cross: bool = True,
                 inter_threads: int = 1, attention_kernel: bool | None = None, native_steps: bool | None = None,
                 keep_freed_memory: bool = True):
        if inter_threads < 1:
            raise ConfigError(f"inter_threads {inter_threads}: must be at least 1")
        if inter_threads > 1 and device == "cuda":
            raise ConfigError(CUDA_INTER_THREADS.format(n=inter_threads))
        self.inter_threads = inter_threads  # batches decoded at once (search_ids), each on a thread of its own
        super().__init__(bundle, device, variant, intra_op_threads, io_binding, shared_cross, attention_kernel,
                         native_steps, keep_freed_memory)

    def search(self, state: BatchState, sources: list[list[int]], options: DecodingOptions,
               prefixes: list[list[int]] | None = None, favoured: list[list[int]] | None = None) \
            -> list[list[Hypothesis]]:
        """Beam search or sampling for one batch of token-id sources, encoded in `state` (`prefill`;
        nmtserve/search.py: one search per source, over its own rows). A finished source's rows decode
        on, ignored, until finished sources are a quarter of the batch; then their rows leave together
        (as greedy's). With native_steps the library takes beam search's ordinary steps after the first
        (`_native_beam_steps`), and every other step comes back here."""
        # each source's forced prefix (`prefill`), counted in the budget and in lengths
        forced, favoured = prefixes or [[]] * len(sources), favoured or [[]] * len(sources)
        searches = [make_search(options, self.limits.output_budget(len(s), options.max_decoding_length,
                                                                   options.length_rule) - len(f), self.eos_id, f,
                                self.unk_id, b) for s, f, b in zip(sources, forced, favoured)]
        width, k = searches[0].rows, searches[0].candidates
        beams = isinstance(searches[0], BeamSearch)
        # ordinary beam steps in the library, after the first (on the step that shares each source's cross K/V)
        native = beams and k > 0 and self.native_steps and self.cache_origin and self.shared_cross
        slots = list(range(len(sources)))  # the source each `width` rows search for, in row order
        while state is not None:
            live = [None if searches[r].done else searches[r] for r in slots]  # each slot's search, None once done
            if native and state.size == width * len(slots):  # after the first step
                state, slots = self._native_beam_steps(state, searches, slots, width)
                continue
            else:
                ids, scores = self.decode_candidates(state, k)
                if state.size < width * len(slots):  # the first step, one row per source (a beam's rows all start
                    # alike and its search reads row 0 only): then each row becomes its beam's rows
                    ids = None if ids is None else np.repeat(ids, width, axis=0)
                    scores = np.repeat(scores, width, axis=0)
                    # with shared_cross the rows share their source's cross K/V; else each gets a copy
                    state = state.widen(width) if self.shared_cross \
                        else state.gather(np.repeat(np.arange(len(sources)), width))
                if beams:  # ranked once for all sources (nmtserve/search.py: beam_steps)
                    parents, tokens = beam_steps(live, ids, scores)
                else:
                    # a finished source's rows decode on (on eos when the step ranked nothing: k = 0)
                    tokens = np.full(state.size, self.eos_id) if ids is None else ids[:, 0].copy()
                    parents = np.arange(state.size)
                    for j, search in enumerate(live):
                        if search is not None:
                            rows = slice(j * width, (j + 1) * width)
                            chosen_parents, tokens[rows] = search.step(None if ids is None else ids[rows],
                                                                       scores[rows])
                            parents[rows] = chosen_parents + j * width
                state.choose(tokens, parents)
            done = np.array([searches[r].done for r in slots])
            if done.sum() * 4 >= len(slots):  # compact, as greedy does
                state, order = state.compact(np.repeat(~done, width))
                slots = [slots[j] for j in order[::width] // width]
        return [search.results() for search in searches]

    def _native_beam_steps(self, state: BatchState, searches: list[BeamSearch], slots: list[int], k: int) \
            -> tuple[BatchState | None, list[int]]:
        """Beam search's steps in the library (NativeBinding.beam_steps) until every search is over or the cache is
        full: it takes each search's ordinary steps (`BeamSearch.ordinary`: its k best extensions simply continue) and
        calls `rules` for any other, which brings the search up to date (`BeamSearch.advance`) and lets it take that
        step (`BeamSearch.select`, on the library's ranking); the searches that are over leave the batch there. At the
        end each search takes the ordinary steps it ran since -> the state of the searches left (None: none) and the
        search of each, in row order."""
        state.open_slot()
        self._with_scores[...] = True
        binding = self._binding_for(state, 2 * k)
        n, steps = len(searches), state.capacity - state.length
        ordinary = np.array([-1 if s.done else s.ordinary_steps() for s in searches], np.int64)
        beam = np.concatenate([searches[r].scores for r in slots])
        search_of = np.array(slots, np.int64)
        out = (np.empty((steps, n, k), np.int64), np.empty((steps, n, k), np.int64), np.empty(n, np.int64),
               np.empty((n, 2 * k), np.int64), np.empty((n, 2 * k), np.int64), np.empty((n, 2 * k)),
               np.empty((n, k), np.int64), np.empty((n, k), np.int64))
        out_parents, out_tokens, advanced, cand_rows, cand_ids, cand_scores, chosen_parents, chosen_tokens = out
        synced = np.zeros(n, np.int64)  # the ordinary steps each search has taken (advance)

        def catch_up(r: int, rows: slice) -> None:  # search r, in the group of `rows`
            if advanced[r] > synced[r]:
                taken = slice(synced[r], advanced[r])
                searches[r].advance(out_parents[taken, r].tolist(), out_tokens[taken, r].tolist(), beam[rows].copy())
                synced[r] = advanced[r]

        def rules(r: int, g: int) -> None:  # search r, now group g of the batch
            rows = slice(g * k, (g + 1) * k)
            catch_up(r, rows)
            search = searches[r]
            chosen_parents[r], chosen_tokens[r] = search.select(cand_rows[r], cand_ids[r], cand_scores[r])
            beam[rows] = search.scores
            ordinary[r] = -1 if search.done else search.ordinary_steps()
        _, groups = binding.beam_steps(len(slots), self._ids, self._scores, state.tokens, state.positions, state.origin,
                                       beam, search_of, ordinary, self.eos_id, self._row_names, out, rules)
        for g, r in enumerate(search_of[:groups].tolist()):  # the live ones
            catch_up(r, slice(g * k, (g + 1) * k))
        left = search_of[:groups].tolist()
        if groups == len(slots):
            return state, left
        self._bound.clear()  # the library bound the fewer rows itself: what _bound holds is stale
        if groups == 0:
            return None, []
        place = {r: j for j, r in enumerate(slots)}  # the library moved the searches left into the first places
        return state.moved_in_place(np.array([place[r] for r in left]), cross_eos_moved=False), left

    def search_ids(self, sources: list[list[int]], options: DecodingOptions = DecodingOptions(), *,
                   max_batch_size: int = 32, scores: bool = True,
                   prefixes: list[list[int]] | None = None, favoured: list[list[int]] | None = None) \
            -> list[list[Hypothesis]]:
        """The n-best hypotheses of each token-id source, best first; sources are batched by sorted length,
        at most max_batch_size sources (each with its beam's rows) per batch. scores=False: greedy search
        skips the log-softmax and scores nothing (each score nan); beam search and sampling always score.
        `prefixes`: each source's forced target tokens (not in the hypotheses, counted in their budgets and
        lengths, as transformers' forced_bos_token_id). `favoured`: each source's target_prefix that
        prefix_bias_beta favours."""
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size {max_batch_size}: must be at least 1")
        options.check(self.vocab_size)
        results: list = [None] * len(sources)
        groups = by_length(prefixes or [])
        if len(groups) > 1:  # the native greedy loop runs rows at one position: batches of one prefix length each
            for rows in groups:
                found = self.search_ids([sources[i] for i in rows], options, max_batch_size=max_batch_size,
                                        scores=scores, prefixes=[prefixes[i] for i in rows] if prefixes[rows[0]] else None,
                                        favoured=[favoured[i] for i in rows] if favoured else None)
                for i, hypotheses in zip(rows, found):
                    results[i] = hypotheses
            return results
        batches = list(sorted_batches([len(s) for s in sources], max_batch_size, self.inter_threads))
        # a group encoded (in one call: _prefill_group), then decoded batch after batch: each graph's weights stay
        # in the CPU cache from one run to the next (both graphs' may not fit in a small host's last-level cache);
        # on threads, the groups shrink towards the end so that the threads finish about together
        groups = guided_groups(batches, max(1, ENCODE_AHEAD // max_batch_size), self.inter_threads)
        if self.inter_threads == 1 or len(groups) == 1:
            for group in groups:
                self._decode_group(group, sources, options, results, scores, prefixes, favoured)
            return results
        replicas = queue.SimpleQueue()  # one decoding context per thread; a thread takes the next group
        for _ in range(self.inter_threads):
            replicas.put(self.replica())

        def decode(group):
            replica = replicas.get()
            try:
                replica._decode_group(group, sources, options, results, scores, prefixes, favoured)
            finally:
                replicas.put(replica)
        with ThreadPoolExecutor(min(self.inter_threads, len(groups)), thread_name_prefix="nmtserve-batch") as pool:
            list(pool.map(decode, groups))  # raises the first error of any group
        return results

    def _decode_group(self, group: list[list[int]], sources: list[list[int]], options: DecodingOptions,
                      results: list, scores: bool, prefixes: list[list[int]] | None = None,
                      favoured: list[list[int]] | None = None) -> None:
        """Encode a group of batches (each a list of source indices), then decode them one after another into
        results."""
        if options.greedy:  # on the server's engine: static batches, in the group's order
            self._greedy_group([i for rows in group for i in rows], sources, options, results, scores, prefixes,
                               max(len(rows) for rows in group))
            return
        group_sources = [[sources[i] for i in rows] for rows in group]
        if prefixes:  # each batch its own prefill, which feeds the forced tokens
            states = [self.prefill(batch, prefixes=[prefixes[i] for i in rows]) for rows, batch in zip(group, group_sources)]
        else:
            states = self._prefill_group(group_sources)
        for rows, batch in zip(group, group_sources):
            state = states.pop(0)  # the list lets go of it: its caches are freed once decoded
            for i, hypotheses in zip(rows, self.search(state, batch, options,
                                                       [prefixes[i] for i in rows] if prefixes else None,
                                                       [favoured[i] for i in rows] if favoured else None)):
                results[i] = hypotheses

    def _greedy_group(self, order: list[int], sources: list[list[int]], options: DecodingOptions, results: list,
                      scores: bool, prefixes: list[list[int]] | None, batch_size: int) -> None:
        """Greedy search of the sources in `order` on an Engine of this translator's own (export/runtime/engine.py,
        as the server's, in this thread): static batches of batch_size, admitted in that order, each run in
        nmtserve's library until its rows finish where it runs, else step by step. Raises NmtserveError naming
        the first sentence that failed."""
        requests = [Request(sources[i], options.max_decoding_length, options, scored=scores,
                            prefix=prefixes[i] if prefixes else []) for i in order]
        config = EngineConfig(max_running_rows=batch_size, max_batch_tokens=sys.maxsize, batching="static",
                              max_burst_steps=sys.maxsize, encode_ahead=ENCODE_AHEAD)
        Engine(self, config).run(requests)
        for i, request in zip(order, requests):
            if request.finish not in (FinishReason.EOS, FinishReason.LENGTH):
                raise NmtserveError(f"sentence {i}: {request.finish.value} ({request.error})")
            results[i] = [Hypothesis(request.tokens, request.score if scores else math.nan, request.finish.value)]

    def _prefill_group(self, batches: list[list[list[int]]]) -> list[BatchState]:
        """Fresh states for several batches of token-id sources. On the host one encoder call for all of them
        (the graph runs on their real tokens only), each batch's cross K/V a view of its rows of the group's:
        a call's fixed cost, a sizeable share of a sentence at batch 1, is paid once rather than per batch. On a
        device (an OrtValue is not a view) one call per batch."""
        if len(batches) == 1 or not self.ops.views:
            return [self.prefill(batch) for batch in batches]
        whole = self.prefill([source for batch in batches for source in batch], caches=False)
        states, start = [], 0
        for batch in batches:
            rows = slice(start, start + len(batch))
            start = rows.stop
            states.append(BatchState.from_encoded(whole.cross_k[:, rows], whole.cross_v[:, rows],
                                                  whole.cross_eos[:, rows], whole.src_mask[rows], self.bos_id,
                                                  origin=self.cache_origin))
        return states

    def translate_ids(self, sources: list[list[int]], *, max_batch_size: int = 32,
                      max_decoding_length: int = 256) -> list[tuple[list[int], float]]:
        """Greedy (tokens, score) for token-id sources, batched by sorted length."""
        found = self.search_ids(sources, DecodingOptions(max_decoding_length=max_decoding_length),
                                max_batch_size=max_batch_size)
        return [(best.tokens, best.score) for best, in found]

    def translate_batch(self, texts: list[str], *, max_batch_size: int = 32, beam_size: int = 1,
                        num_hypotheses: int = 1, length_penalty: float = 0.0, patience: float = 1.0,
                        sampling_topk: int = 1, sampling_topp: float = 1.0, sampling_temperature: float = 1.0,
                        seed: int = 0, max_decoding_length: int = 256, beam_stopping: str = "ctranslate2",
                        length_rule: str = "nmtserve", return_scores: bool = False, source_language: str = "",
                        target_language: str = "", target_prefix: list[str | None] | None = None,
                        min_decoding_length: int = 0, disable_unk: bool = False, no_repeat_ngram_size: int = 0,
                        suppress_sequences: list[str] | None = None, prefix_bias_beta: float = 0.0) -> list[Translation]:
        """Translate texts, with CTranslate2's decoding options (nmtserve/search.py says what each does):
        greedy by default, beam search with beam_size > 1, random sampling with sampling_topk != 1. Each
        Translation is the best hypothesis, with the rest of the n-best list in `alternatives`. Inputs are
        sorted by length so that each batch has little padding. A multilingual model takes the languages (its
        defaults where not given; a ValueError names one it does not know). `target_prefix` (CTranslate2's, as text):
        for each text the start its translation is forced to (None or "": none); each hypothesis begins with it.
        min_decoding_length, disable_unk, no_repeat_ngram_size and suppress_sequences (target texts) are
        CTranslate2's disabled tokens (nmtserve/search.py: TokenMasks). With prefix_bias_beta (CTranslate2's) the
        target_prefix is favoured, not forced, and a translation begins with what was decoded."""
        suppressed = tuple(tuple(self.tokenizer.encode_target(text)) for text in suppress_sequences or ())
        options = DecodingOptions(beam_size, num_hypotheses, length_penalty, patience, sampling_topk, sampling_topp,
                                  sampling_temperature, seed, max_decoding_length, beam_stopping, length_rule,
                                  min_decoding_length, disable_unk, no_repeat_ngram_size, suppressed, prefix_bias_beta)
        encode = self.tokenizer.encode
        ids = [encode(t, self.limits.max_source_tokens, target_language, source_language) or [self.eos_id]
               for t in texts]
        found = self.search_prefixed(ids, options, target_prefix, self.tokenizer.target_prefix(target_language),
                                     max_batch_size=max_batch_size, scores=return_scores)
        return [self._translation(hypotheses, return_scores, shown) for hypotheses, shown in found]

    def search_prefixed(self, sources: list[list[int]], options: DecodingOptions, target_prefix: list | None,
                        language: list[int], *, max_batch_size: int = 32, scores: bool = True) \
            -> list[tuple[list[Hypothesis], list[int]]]:
        """`search_ids` after a target language's tokens and each source's target_prefix (a text, or None): each
        source's hypotheses and the prefix tokens they begin with (forced; none when prefix_bias_beta favours the
        prefix instead). ValueError naming target_prefix or the entry that does not fit."""
        given = self.target_prefix_ids(sources, target_prefix, options.max_decoding_length, options.length_rule,
                                       language)
        favoured, shown = (given, [[] for _ in given]) if options.prefix_bias_beta else (None, given)
        prefixes = [[*language, *s] for s in shown]
        found = self.search_ids(sources, options, max_batch_size=max_batch_size, scores=scores,
                                prefixes=prefixes if any(prefixes) else None, favoured=favoured)
        return list(zip(found, shown))

    def target_prefix_ids(self, sources: list[list[int]], texts, max_decoding_length: int, length_rule: str,
                          language: list[int] = ()) -> list[list[int]]:
        """Each source's target_prefix (a text; None or "" for none; no texts: none for any) as target ids ->
        ValueError naming target_prefix for a count other than the sources' or a prefix that, after the target
        language's tokens, leaves its sentence no room in its output budget."""
        if not texts:
            return [[] for _ in sources]
        if len(texts) != len(sources):
            raise ValueError(f"target_prefix: {len(texts)} given for {len(sources)} sentences; one each, or none")
        given = []
        for i, (source, text) in enumerate(zip(sources, texts)):
            ids = self.tokenizer.encode_target(text) if text else []
            budget = self.limits.output_budget(len(source), max_decoding_length, length_rule)
            if len(language) + len(ids) >= budget:
                raise ValueError(f"target_prefix[{i}]: {len(ids)} tokens, which leave no room in the sentence's "
                                 f"output budget of {budget} tokens")
            given.append(ids)
        return given

    def _translation(self, hypotheses: list[Hypothesis], return_scores: bool, prefix: list[int] = ()) -> Translation:
        """A hypothesis as text; a forced target_prefix's tokens come first (its tokens' scores are not counted)."""
        best, *rest = [Translation(self.tokenizer.decode([*prefix, *h.tokens]), [*prefix, *h.tokens],
                                   h.score if return_scores else None)
                       for h in hypotheses]
        best.alternatives = rest
        return best
