"""OnnxTranslator: offline translation over a bundle with ONNX Runtime, greedy, beam search or sampling, with
CTranslate2's translate_batch. Torch-free and onnx-free.

    from nmtserve.export.runtime.translator import OnnxTranslator
    tr = OnnxTranslator("bundles/default", device="cpu", variant="int8")
    for t in tr.translate_batch(["The cat sleeps."], beam_size=4, num_hypotheses=2, return_scores=True):
        print(t.text, t.score, [(a.text, a.score) for a in t.alternatives])

Inputs are sorted by length and cut into batches of at most `max_batch_size` to cut padding, and decoded on the
server's Engine (export/runtime/engine.py) with static batching, in the caller's thread: each batch is run to its
end at once, greedy in nmtserve's library where it runs, beam search and sampling by `Decoder.decode_search_run`;
its finished rows leave a quarter at a time. Small batches are encoded ahead, up to ENCODE_AHEAD sources in one
encoder call on the host, then decoded one after another: each graph's weights stay in the CPU cache between its
runs, and a call's fixed cost is paid once (a batch's result is the same either way). With inter_threads > 1
(CTranslate2's name) that many batches, or groups of them, decode at once on threads of their own, each with its
own engine and binding over the same two sessions: on a CPU this uses the cores better than one batch on more
intra-op threads (docs/performance-journal.md, "Batches at once"). The sessions and steps are the Decoder's
(decoder.py); the searches' rules are nmtserve/search.py's.
"""

from __future__ import annotations

import queue
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from nmtserve.decoding import DecodingOptions, Hypothesis, by_length, guided_groups, sorted_batches
from nmtserve.errors import ConfigError, NmtserveError
from nmtserve.export.runtime.bundle import Bundle
from nmtserve.export.runtime.decoder import CUDA_INTER_THREADS, Decoder
from nmtserve.export.runtime.engine import Engine, EngineConfig
from nmtserve.export.runtime.request import FinishReason, Request
from nmtserve.glossary import Glossary
from nmtserve.search import constrained_beam

ENCODE_AHEAD = 64  # search_ids encodes batches of up to this many sources in all before decoding them


@dataclass
class Translation:
    text: str
    tokens: list[int]  # target ids, eos excluded
    score: float | None = None  # sum of the chosen tokens' log-probabilities (eos included; beam search:
    # divided by length ** length_penalty), if asked
    alternatives: list[Translation] = field(default_factory=list)  # the rest of the n-best list, best first
    confidence: float | None = None  # if asked: exp of its decoded tokens' mean log-prob (search.Hypothesis.confidence)
    # if asked (return_attention, CTranslate2's): for each of its tokens, its weights over the source's tokens
    attention: list[list[float]] | None = None

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

    def search_ids(self, sources: list[list[int]], options: DecodingOptions = DecodingOptions(), *,
                   max_batch_size: int = 32, scores: bool = True,
                   prefixes: list[list[int]] | None = None, favoured: list[list[int]] | None = None,
                   constraints: list[tuple[tuple[int, ...], ...]] | None = None,
                   attention: bool = False) -> list[list[Hypothesis]]:
        """The n-best hypotheses of each token-id source, best first; sources are batched by sorted length,
        at most max_batch_size sources (each with its beam's rows) per batch. scores=False: greedy search
        skips the log-softmax and scores nothing (each score nan); beam search and sampling always score.
        `prefixes`: each source's forced target tokens (not in the hypotheses, counted in their budgets and
        lengths, as transformers' forced_bos_token_id). `favoured`: each source's target_prefix that
        prefix_bias_beta favours. `constraints`: each source's token sequences that its hypotheses must contain (a
        glossary's target terms; search.constrained_beam says how it is then decoded). `attention`: each hypothesis
        with its attention (Hypothesis.attention)."""
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size {max_batch_size}: must be at least 1")
        options.check(self.vocab_size)
        if attention:
            self.require_aligner()
        for c in set(constraints or ()):
            constrained_beam(options, c).check(self.vocab_size)
        results: list = [None] * len(sources)
        groups = by_length(prefixes or [])
        if len(groups) > 1:  # the native greedy loop runs rows at one position: batches of one prefix length each
            for rows in groups:
                found = self.search_ids([sources[i] for i in rows], options, max_batch_size=max_batch_size,
                                        scores=scores, prefixes=[prefixes[i] for i in rows] if prefixes[rows[0]] else None,
                                        favoured=[favoured[i] for i in rows] if favoured else None,
                                        constraints=[constraints[i] for i in rows] if constraints else None,
                                        attention=attention)
                for i, hypotheses in zip(rows, found):
                    results[i] = hypotheses
            return results
        batches = list(sorted_batches([len(s) for s in sources], max_batch_size, self.inter_threads))
        # a group encoded (in one call: EngineConfig.encode_ahead), then decoded batch after batch: each graph's weights stay
        # in the CPU cache from one run to the next (both graphs' may not fit in a small host's last-level cache);
        # on threads, the groups shrink towards the end so that the threads finish about together
        groups = guided_groups(batches, max(1, ENCODE_AHEAD // max_batch_size), self.inter_threads)
        if self.inter_threads == 1 or len(groups) == 1:
            for group in groups:
                self._decode_group(group, sources, options, results, scores, prefixes, favoured, constraints, attention)
            return results
        replicas = queue.SimpleQueue()  # one decoding context per thread; a thread takes the next group
        for _ in range(self.inter_threads):
            replicas.put(self.replica())

        def decode(group):
            replica = replicas.get()
            try:
                replica._decode_group(group, sources, options, results, scores, prefixes, favoured, constraints,
                                      attention)
            finally:
                replicas.put(replica)
        with ThreadPoolExecutor(min(self.inter_threads, len(groups)), thread_name_prefix="nmtserve-batch") as pool:
            list(pool.map(decode, groups))  # raises the first error of any group
        return results

    def _decode_group(self, group: list[list[int]], sources: list[list[int]], options: DecodingOptions,
                      results: list, scores: bool, prefixes: list[list[int]] | None = None,
                      favoured: list[list[int]] | None = None,
                      constraints: list[tuple[tuple[int, ...], ...]] | None = None, attention: bool = False) -> None:
        """A group of batches (each a list of source indices) decoded into results on an Engine of this translator's
        own (export/runtime/engine.py, the server's, in this thread): static batches admitted in the group's order,
        the next ones encoded ahead with the first, each run to its end (greedy: in nmtserve's library where it
        runs; beam search and sampling: `Decoder.decode_search_run`). Raises NmtserveError naming the first sentence
        that failed."""
        order = [i for rows in group for i in rows]
        requests = [Request(sources[i], options.max_decoding_length,
                            constrained_beam(options, constraints[i]) if constraints else options, scored=scores,
                            prefix=prefixes[i] if prefixes else [], favoured=favoured[i] if favoured else [],
                            attention=attention)
                    for i in order]
        config = EngineConfig(max_running_rows=max(len(rows) for rows in group) * max(r.width for r in requests),
                              max_batch_tokens=sys.maxsize, batching="static", max_burst_steps=sys.maxsize,
                              encode_ahead=ENCODE_AHEAD, whole_searches=True)
        Engine(self, config).run(requests)
        for i, request in zip(order, requests):
            if request.finish not in (FinishReason.EOS, FinishReason.LENGTH):
                raise NmtserveError(f"sentence {i}: {request.finish.value} ({request.error})")
            results[i] = request.results()

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
                        suppress_sequences: list[str] | None = None, prefix_bias_beta: float = 0.0,
                        repetition_penalty: float = 1.0, glossary: Glossary | list[tuple[str, str]] | None = None,
                        return_attention: bool = False) -> list[Translation]:
        """Translate texts, with CTranslate2's decoding options (nmtserve/search.py says what each does):
        greedy by default, beam search with beam_size > 1, random sampling with sampling_topk != 1. Each
        Translation is the best hypothesis, with the rest of the n-best list in `alternatives`. Inputs are
        sorted by length so that each batch has little padding. A multilingual model takes the languages (its
        defaults where not given; a ValueError names one it does not know). `target_prefix` (CTranslate2's, as text):
        for each text the start its translation is forced to (None or "": none); each hypothesis begins with it.
        min_decoding_length, disable_unk, no_repeat_ngram_size and suppress_sequences (target texts) are
        CTranslate2's disabled tokens (nmtserve/search.py: TokenMasks). With prefix_bias_beta (CTranslate2's) the
        target_prefix is favoured, not forced, and a translation begins with what was decoded. repetition_penalty
        (CTranslate2's) divides the logits of tokens already decoded before each step's softmax. `glossary` (nmtserve's:
        (source term, target term) pairs, nmtserve/glossary.py): a text containing a source term is translated with
        its target term, by constrained beam search. return_attention (CTranslate2's): each Translation's `attention`,
        the last decoder layer's first head's weights over the source tokens at each of its tokens (the bundle's
        aligner graph, in fp32, run once decoding is done)."""
        suppressed = tuple(tuple(self.tokenizer.encode_target(text)) for text in suppress_sequences or ())
        options = DecodingOptions(beam_size, num_hypotheses, length_penalty, patience, sampling_topk, sampling_topp,
                                  sampling_temperature, seed, max_decoding_length, beam_stopping, length_rule,
                                  min_decoding_length, disable_unk, no_repeat_ngram_size, suppressed, prefix_bias_beta,
                                  repetition_penalty)
        encode = self.tokenizer.encode
        ids = [encode(t, self.limits.max_source_tokens, target_language, source_language) or [self.eos_id]
               for t in texts]
        if glossary is not None and not isinstance(glossary, Glossary):
            glossary = Glossary(list(glossary))
        constraints = [glossary.constraints_for(t, self.tokenizer.encode_target) for t in texts] if glossary else None
        found = self.search_prefixed(ids, options, target_prefix, self.tokenizer.target_prefix(target_language),
                                     max_batch_size=max_batch_size, scores=return_scores, constraints=constraints,
                                     attention=return_attention)
        return [self._translation(hypotheses, return_scores, shown) for hypotheses, shown in found]

    def search_prefixed(self, sources: list[list[int]], options: DecodingOptions, target_prefix: list | None,
                        language: list[int], *, max_batch_size: int = 32, scores: bool = True,
                        constraints: list[tuple[tuple[int, ...], ...]] | None = None, attention: bool = False) \
            -> list[tuple[list[Hypothesis], list[int]]]:
        """`search_ids` after a target language's tokens and each source's target_prefix (a text, or None): each
        source's hypotheses and the prefix tokens they begin with (forced; none when prefix_bias_beta favours the
        prefix instead). ValueError naming target_prefix or the entry that does not fit."""
        given = self.target_prefix_ids(sources, target_prefix, options.max_decoding_length, options.length_rule,
                                       language)
        favoured, shown = (given, [[] for _ in given]) if options.prefix_bias_beta else (None, given)
        prefixes = [[*language, *s] for s in shown]
        found = self.search_ids(sources, options, max_batch_size=max_batch_size, scores=scores,
                                prefixes=prefixes if any(prefixes) else None, favoured=favoured, constraints=constraints,
                                attention=attention)
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
                                   h.score if return_scores else None,
                                   confidence=h.confidence if return_scores else None,
                                   attention=None if h.attention is None else h.shown_attention(len(prefix)).tolist())
                       for h in hypotheses]
        best.alternatives = rest
        return best

