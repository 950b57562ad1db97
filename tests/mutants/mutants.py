"""Deliberately broken variants of the code that the suite's comparisons guard, each with the tests that must catch
it (tests/mutants/run.py runs them and fails if one still passes). A patch takes the freshly imported module."""

from __future__ import annotations

from types import SimpleNamespace


def _bleu_by_characters(module) -> None:
    """evaluate's BLEU computed on characters: sacrebleu's own score of the same hypotheses differs."""
    sacrebleu, original = module.sacrebleu, module.score

    def score(hypotheses, references):
        scores = original(hypotheses, references)
        scores.bleu = sacrebleu.corpus_bleu(hypotheses, [references], tokenize="char").score
        return scores
    module.score = score


def _stream_holds_back_more(module) -> None:
    """The stream decoder keeps the last 40 characters back until the end: a delta no longer follows its token."""
    add = module.StreamDecoder.add

    def held(self, ids):
        self.pending = getattr(self, "pending", "") + add(self, ids)
        out, self.pending = self.pending[:-40], self.pending[-40:]
        return out
    module.StreamDecoder.add = held


def _never_dropped(module) -> None:
    """The engine never drops a request past its deadline or cancelled."""
    module.Engine._dropped = staticmethod(lambda request, now: None)


def _one_token_short(module) -> None:
    """The served text leaves out each sentence's last token."""
    translation = module.translation

    def short(request, tokenizer, *rest):
        return translation(request, SimpleNamespace(decode=lambda ids: tokenizer.decode(ids[:-1]), piece=tokenizer.piece),
                           *rest)
    module.translation = short


def _model_defaults_ignored(module) -> None:
    """The server decodes an imported model with CTranslate2's defaults, not the model's generation config."""
    bundle_defaults = module.bundle_defaults
    module.bundle_defaults = lambda manifest, limit: bundle_defaults({**manifest, "decoding_defaults": {}}, limit)


def _native_errors_ignored(module) -> None:
    """The library's errors are not raised: a failed step looks like a good one."""
    module._checked = lambda returned, error: max(returned, 0)


def _tls_dropped(module) -> None:
    """The server listens in plaintext whatever --tls-* say."""
    module.server_credentials = lambda config: None


def _ranked_without_the_beam(module) -> None:
    """Beam search ranks a step's extensions by the candidates' own log-probs, forgetting each row's beam score."""
    rank = module.Ranker.rank
    module.Ranker.rank = lambda self, beam, ids, scores: rank(self, module.np.zeros_like(beam), ids, scores)


def _greedy_stops_a_step_late(module) -> None:
    """Greedy's stopping rule (exported into the bundle) compares a row's position with its last one by >, not >=:
    a row that never says eos runs one token past its budget."""
    rule = module.with_stop_rule

    def late(model, eos):
        model = rule(model, eos)
        for node in model.graph.node:
            if node.output[0] == "at_budget":
                node.op_type = "Greater"
        return model
    module.with_stop_rule = late


MUTANTS = {
    "bleu-by-characters": {"module": "nmtserve.training.evaluate", "patch": _bleu_by_characters,
                           "tests": ["tests/training/test_train.py::test_cli_evaluate_json_and_translate"]},
    "stream-holds-back": {"module": "nmtserve.tokenizer", "patch": _stream_holds_back_more,
                          "tests": ["tests/training/test_marian.py::"
                                    "test_stream_text_of_a_marian_target_is_always_a_prefix_of_the_whole"]},
    "never-dropped": {"module": "nmtserve.export.runtime.engine", "patch": _never_dropped,
                      "tests": ["tests/server/test_service.py::test_deadline_exceeded_frees_the_rows"]},
    "one-token-short": {"module": "nmtserve.server.convert", "patch": _one_token_short,
                        "tests": ["tests/server/test_service.py::"
                                  "test_a_server_with_or_without_the_kernels_serves_the_translator_output",
                                  "tests/server/test_marian_served.py::test_target_language_must_be_the_models"]},
    "model-defaults-ignored": {"module": "nmtserve.server.models", "patch": _model_defaults_ignored,
                               "tests": ["tests/server/test_marian_served.py::test_target_language_must_be_the_models"]},
    "native-errors-ignored": {"module": "nmtserve.export.runtime.native", "patch": _native_errors_ignored,
                              "tests": ["tests/export/test_native.py::"
                                        "test_a_native_error_carries_onnx_runtimes_message_and_the_session_goes_on"]},
    "tls-dropped": {"module": "nmtserve.server.app", "patch": _tls_dropped,
                    "tests": ["tests/server/test_tls.py::test_tls_serves_clients_that_trust_the_ca_and_refuses_plaintext",
                              "tests/server/test_tls.py::"
                              "test_mutual_tls_requires_a_client_certificate_signed_by_the_client_ca"]},
    "ranked-without-the-beam": {"module": "nmtserve.export.runtime.ranker", "patch": _ranked_without_the_beam,
                                "tests": ["tests/export/test_ranker.py",
                                          "tests/test_search.py::test_the_first_step_extends_beam_0_only_and_an_eos_candidate_finishes_and_is_replaced",
                                          "tests/export/test_native.py::"
                                          "test_native_beam_search_gives_the_n_best_lists_of_the_search_in_python"]},
    "greedy-stops-a-step-late": {"module": "nmtserve.export.build.step_graphs", "patch": _greedy_stops_a_step_late,
                                 "tests": ["tests/export/test_parity.py::test_a_steps_finish_code_says_eos_then_budget",
                                           "tests/export/test_native.py::"
                                           "test_native_greedy_steps_give_the_tokens_and_scores_of_onnx_runtimes_session"]},
}
