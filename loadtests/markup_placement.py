"""Where inline tags land (TranslateText's text/html): the test split's sentences that contain one of the corpus's
nouns, each with the noun wrapped in <b>, translated by a `nmtserve serve` process; for the translations that contain
the noun's French (the corpus's own, so that the right place is known), the share whose <b> holds exactly that word,
and the share whose <b> at least touches it; and the time of the HTML call against the same sentences as plain text.

    python -m nmtserve.loadtests.markup_placement bundles/default --data data/default --sentences 400
"""

from __future__ import annotations

import argparse
import html
import json
import re
import tempfile
import time
from pathlib import Path

from nmtserve.loadtests.machine import machine_info
from nmtserve.loadtests.terminology import glossaries, word_pattern
from nmtserve.loadtests.workload import ServerProcess
from nmtserve.training.data import read_tsv

BOLD = re.compile(r"<b>(.*?)</b>")


def main() -> None:
    from nmtserve.client import open_channel
    from nmtserve.v1 import translation_pb2 as pb
    from nmtserve.v1 import translation_pb2_grpc as pb_grpc

    parser = argparse.ArgumentParser(prog="python -m nmtserve.loadtests.markup_placement")
    parser.add_argument("bundle")
    parser.add_argument("--data", default="data/default")
    parser.add_argument("--split", default="test")
    parser.add_argument("--sentences", type=int, default=400, help="the first N sentences with a corpus noun")
    parser.add_argument("--report", help="also write the report here (JSON)")
    args = parser.parse_args()
    nouns = dict(glossaries()["reference"])
    cases = []  # (HTML sentence, the plain sentence, the French of its wrapped noun)
    for source, _ in read_tsv(Path(args.data) / f"{args.split}.tsv").pairs:
        found = next(((en, m) for en in nouns if (m := word_pattern(en).search(source))), None)
        if found:
            en, m = found
            wrapped = html.escape(source[:m.start()]) + f"<b>{html.escape(m.group())}</b>" + html.escape(source[m.end():])
            cases.append((wrapped, source, nouns[en]))
        if len(cases) == args.sentences:
            break
    with tempfile.TemporaryDirectory() as logs, \
            ServerProcess(args.bundle, "--metrics-port", "-1", log=Path(logs) / "server.log") as server, \
            open_channel(server.target) as channel:
        stub = pb_grpc.TranslationServiceStub(channel)
        batch = 64
        seconds = {"html": [], "plain": []}
        for _ in range(3):
            for kind, texts, mime in (("html", [c[0] for c in cases], "text/html"), ("plain", [c[1] for c in cases], "")):
                started, out = time.perf_counter(), []
                for i in range(0, len(texts), batch):
                    out += [t.text for t in stub.TranslateText(pb.TranslateTextRequest(
                        texts=texts[i:i + batch], mime_type=mime), timeout=600).translations]
                seconds[kind].append(time.perf_counter() - started)
                if kind == "html":
                    translated = out
    scored = exact = touching = 0
    for out, (_, _, french) in zip(translated, cases):
        text = html.unescape(re.sub(r"</?b>", "", out))
        word = word_pattern(french).search(text)
        if not word:
            continue
        scored += 1
        bold = BOLD.search(out)
        start = len(html.unescape(re.sub(r"</?b>", "", out[:bold.start()]))) if bold else -1
        end = start + len(html.unescape(bold.group(1))) if bold else -1
        exact += bold is not None and (start, end) == word.span()
        touching += bold is not None and start < word.end() and end > word.start()
    report = {"bundle": args.bundle, "split": args.split, "machine": machine_info(), "sentences": len(cases),
              "with_the_nouns_french": scored, "exact": round(exact / max(1, scored), 4),
              "touching": round(touching / max(1, scored), 4),
              "seconds": {kind: sorted(values) for kind, values in seconds.items()}}
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
