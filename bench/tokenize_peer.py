#!/usr/bin/env python3
"""The peer of bench/tokenize.sh: the Hugging Face `tokenizers` library on the same corpus.

    tokenize_peer.py prepare WORK         corpus.jsonl (text of this machine) and tok.json (a
                                          Llama 3-style byte-level BPE, 16384 ids, trained on it)
    tokenize_peer.py run WORK THREADS     encode_batch over every document, all THREADS cores
                                          (RAYON_NUM_THREADS), timed alone: prints tokens/s
    tokenize_peer.py check WORK PREFIX    the ids am-data wrote equal the library's
"""
import glob
import json
import os
import struct
import sys
import time


def prepare(work):
    docs = []
    paths = sorted(glob.glob("/usr/share/common-licenses/*") + glob.glob("/usr/share/doc/*/copyright") +
                   glob.glob("/usr/lib/python3*/**/*.py", recursive=True))
    for p in paths:
        try:
            with open(p, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError, IsADirectoryError):
            continue
        for i in range(0, len(text), 8000):
            docs.append(text[i:i + 8000])
        if sum(map(len, docs)) > 60_000_000:
            break
    with open(os.path.join(work, "corpus.jsonl"), "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "tokenizer"))
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    import make_tokenizers as mk
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(mk.LLAMA3), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=16384, special_tokens=["<|end_of_text|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs[::4], trainer)
    tok.save(os.path.join(work, "tok.json"))
    print(f"{len(docs)} documents, {sum(len(d.encode()) for d in docs) / 1e6:.1f} MB")


def texts(work):
    with open(os.path.join(work, "corpus.jsonl")) as f:
        return [json.loads(line)["text"] for line in f]


def run(work):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(work, "tok.json"))
    docs = texts(work)
    t0 = time.perf_counter()
    enc = tok.encode_batch_fast(docs) if hasattr(tok, "encode_batch_fast") else tok.encode_batch(docs)
    dt = time.perf_counter() - t0
    print(f"{sum(len(e.ids) for e in enc) / dt:.0f}")


def check(work, prefix):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(work, "tok.json"))
    want = [e.ids for e in tok.encode_batch(texts(work))]
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    n = struct.unpack_from("<Q", idx, 18)[0]
    lens = struct.unpack_from("<%di" % n, idx, 34)
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    at = 0
    for k, ln in enumerate(lens):
        if list(struct.unpack_from("<%dH" % ln, data, at)) != want[k]:
            sys.exit(f"document {k}: am-data's ids differ from tokenizers'")
        at += 2 * ln
    print(f"ids equal: {n} documents, {sum(lens)} tokens")


if __name__ == "__main__":
    {"prepare": lambda: prepare(sys.argv[2]), "run": lambda: run(sys.argv[2]),
     "check": lambda: check(sys.argv[2], sys.argv[3])}[sys.argv[1]]()
