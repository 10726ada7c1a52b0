#!/usr/bin/env python3
"""am's tokenizer against the Hugging Face `tokenizers` library, live: trains the tokenizers
of make_tokenizers.py afresh (byte-level and SentencePiece-style, and three more Metaspace
settings), encodes new hostile texts (another seed, a 200000-character text, which is one
word for the Llama 2 style, invalid UTF-8) with `am-data encode` and with the library, builds
a JSONL dataset with `am-data build --tokenizer` and instruction datasets, and compares every
id (and every loss-mask value against AutoModel's format_prompt_completion rule, computed
here with transformers' PreTrainedTokenizerFast as AutoModel calls it).

    python compare.py AM_DATA WORKDIR      (tests/data/test-tokenizer-golden.sh runs it)
"""
import json
import os
import struct
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tokenizers as mk  # noqa: E402


def read_indexed(prefix):
    """Megatron MMIDIDX: the documents' token lists."""
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == b"MMIDIDX\0\0"
    code = idx[17]
    n = struct.unpack_from("<Q", idx, 18)[0]
    lens = struct.unpack_from("<%di" % n, idx, 34)
    fmt, size = {1: ("B", 1), 8: ("H", 2), 4: ("i", 4)}[code]
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    out, at = [], 0
    for ln in lens:
        out.append(list(struct.unpack_from("<%d%s" % (ln, fmt), data, at)))
        at += ln * size
    return out


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def check_nfc(am_data, work):
    """Qwen 2's NFC normalizer: every code point (in blocks of 500), every decomposable one
    decomposed and followed by marks, random bases with up to 5 random combining marks
    (Hangul jamo, marks new since Unicode 9.0 included)."""
    import random
    import unicodedata
    tok = mk.build("qwen2")
    path = os.path.join(work, "qwen2_nfc.json")
    tok.save(path)
    rng = random.Random(5)
    cps = [c for c in range(1, 0x110000) if not 0xD800 <= c <= 0xDFFF]
    marks = [c for c in cps if unicodedata.combining(chr(c))] + [0x1DF6, 0x1E4EC, 0x1161, 0x11A8, 0x0B3E, 0x0CD5]
    texts = ["".join(chr(c) for c in cps[i:i + 500]) for i in range(0, len(cps), 500)]
    bases = cps[:0x3000] + list(range(0xAC00, 0xD7A4, 97)) + list(range(0x1100, 0x1113))
    for _ in range(3000):
        texts.append(chr(rng.choice(bases)) + "".join(chr(rng.choice(marks)) for _ in range(rng.randint(0, 5))) + " x")
    for c in cps:
        d = unicodedata.normalize("NFD", chr(c))
        if d != chr(c):
            texts.append(d + "\u0301" + d + "\u0334")
    nul = os.path.join(work, "nfc.bin")
    with open(nul, "wb") as f:
        f.write(b"\0".join(t.encode() for t in texts))
    got = subprocess.run([am_data, "encode", "--tokenizer", path, "--nul", nul], check=True,
                         capture_output=True).stdout.decode().split("\n")[:-1]
    want = [e.ids for e in tok.encode_batch(texts)]
    for i, w in enumerate(want):
        if [int(x) for x in got[i].split()] != w:
            fail(f"NFC: text {i} {[hex(ord(c)) for c in texts[i][:8]]}: am {got[i][:40]}, tokenizers {w[:8]}")
    return sum(map(len, want))


# Metaspace settings beyond the committed fixtures' (the mistral tokenizer with another
# pre_tokenizer; the last is the older files' spelling: add_prefix_space, no split key)
METASPACE = {
    "ms_never_split": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "never", "split": True},
    "ms_first_split": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True},
    "ms_old": {"type": "Metaspace", "replacement": "\u2581", "add_prefix_space": True},
}


def tokenizer(style, path):
    """Trains STYLE, saves it at PATH and returns the library's Tokenizer of that file."""
    from tokenizers import Tokenizer
    if style in mk.STYLES:
        tok = mk.build(style)
        tok.save(path)
        return tok
    spec = json.loads(mk.build_spm(style if style in mk.SPM_STYLES else "mistral").to_str())
    if style in METASPACE:
        spec["pre_tokenizer"] = METASPACE[style]
    with open(path, "w") as f:
        json.dump(spec, f)
    return Tokenizer.from_file(path)


def main():
    am_data, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    hostile = mk.hostile_texts(seed=2, big=True)
    spm = hostile + mk.spm_texts(seed=4)
    total = check_nfc(am_data, work)
    styles = mk.STYLES + mk.SPM_STYLES + list(METASPACE)
    try:
        import sentencepiece  # noqa: F401  (llama2_sp is trained by it)
    except ImportError:
        styles.remove("llama2_sp")
        print("compare.py: no sentencepiece module: the llama2_sp tokenizer is left out (pip install -r "
              "tests/golden/requirements.txt)")
    for style in styles:
        texts = hostile if style in mk.STYLES else spm
        nul = os.path.join(work, style + ".bin")
        with open(nul, "wb") as f:
            f.write(b"\0".join(texts))
        path = os.path.join(work, style + ".json")
        tok = tokenizer(style, path)
        strs = [t.decode("utf-8", "replace") for t in texts]
        for special in (True, False):
            args = [am_data, "encode", "--tokenizer", path, "--nul", nul] + ([] if special else ["--no-special-tokens"])
            got = subprocess.run(args, check=True, capture_output=True).stdout.decode().split("\n")[:-1]
            want = [e.ids for e in tok.encode_batch(strs, add_special_tokens=special)]
            if len(got) != len(want):
                fail(f"{style}: {len(got)} texts from am-data encode, {len(want)} expected")
            for i, (g, w) in enumerate(zip(got, want)):
                g = [int(x) for x in g.split()]
                if g != w:
                    k = next((j for j in range(min(len(g), len(w))) if g[j] != w[j]), min(len(g), len(w)))
                    fail(f"{style}: text {i} {texts[i][:60]!r}: id {k}: am {g[k:k+5]}, tokenizers {w[k:k+5]}")
                total += len(w)
        # a JSONL dataset through am-data build (valid UTF-8 texts; the JSON of the rest would not load)
        rows = [s for s, t in zip(strs, texts) if t.decode("utf-8", "replace").encode() == t]
        jl = os.path.join(work, style + ".jsonl")
        with open(jl, "w") as f:
            for i, s in enumerate(rows * 3):
                f.write(json.dumps({"text": s, "i": i}, ensure_ascii=bool(i % 2)) + "\n")
        prefix = os.path.join(work, style + "_ds")
        subprocess.run([am_data, "build", "--tokenizer", path, "--out", prefix, "--threads", "3", jl], check=True,
                       capture_output=True)
        want = [e.ids for e in tok.encode_batch(rows * 3)]
        if read_indexed(prefix) != want:
            fail(f"{style}: am-data build's documents differ from tokenizers'")
        total += sum(map(len, want))
    for style, eos_token in (("llama3", "<|end_of_text|>"), ("llama2", "</s>")):
        total += check_instruction(am_data, work, style, eos_token, hostile)
    print(f"compare.py: {total} ids (and the mask values) equal to tokenizers' / AutoModel's rule")


def check_instruction(am_data, work, style, eos_token, texts):
    """Instruction data, as AutoModel's ColumnMappedTextInstructionDataset (no chat template)."""
    from transformers import PreTrainedTokenizerFast
    total = 0
    path = os.path.join(work, style + ".json")
    hf = PreTrainedTokenizerFast(tokenizer_file=path, eos_token=eos_token)
    eos = hf.eos_token_id
    rows = []
    for i, t in enumerate(texts[:120]):
        s = t.decode("utf-8", "replace")
        if s.encode() != t:
            continue
        r = {"answers": s[: len(s) // 2] + " ok"}
        if i % 3:
            r["context"] = s[len(s) // 2:]
        if i % 3 != 1:
            r["question"] = "What is it? " + s[:10]
        rows.append(r)
    jl = os.path.join(work, style + "_sft.jsonl")
    with open(jl, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    prefix = os.path.join(work, style + "_sft")
    subprocess.run([am_data, "build", "--tokenizer", path, "--out", prefix, "--instruction", "--context-key", "context",
                    "--question-key", "question", "--answer-key", "answers", "--eos", eos_token, jl],
                   check=True, capture_output=True)
    toks, masks = read_indexed(prefix), read_indexed(prefix + ".mask")
    for k, r in enumerate(rows):
        prompt = " ".join(filter(lambda x: x is not None, (r.get("context"), r.get("question"), "")))
        full = prompt + r["answers"]
        n_prompt = len(hf(prompt)["input_ids"])
        ids = hf(full)["input_ids"]
        mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
        if eos != ids[-1]:
            ids += [eos]
            mask += [1]
        if toks[k] != ids or masks[k] != mask[: len(ids)]:
            fail(f"{style} instruction row {k}: am {toks[k][:8]}.. mask {masks[k][:8]}.., AutoModel's {ids[:8]}.. "
                 f"{mask[:8]}..")
        total += len(ids)
    return total


if __name__ == "__main__":
    main()
