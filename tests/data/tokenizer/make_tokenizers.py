#!/usr/bin/env python3
"""Builds small BPE tokenizer.json files with the Hugging Face `tokenizers` library: byte-level
in the styles of GPT-2, Llama 3, Qwen 2 and Qwen 3.5, SentencePiece-style (byte_fallback) in
the styles of Llama 2 and Mistral, a third with unknown characters, and a Llama 2 one trained
by `sentencepiece` and converted as transformers converts Llama 2's; and the ids that
library gives for a set of hostile texts. The outputs are committed (tests/data/tokenizer/);
the C test test_tokenizer checks am's encoder against them without Python.

    /tmp/goldenv/bin/python tests/data/tokenizer/make_tokenizers.py [OUTDIR]

Also a module: compare.py imports STYLES, SPM_STYLES, build(), build_spm(), hostile_texts() and
spm_texts().
Used for the committed files: tokenizers 0.23.3, sentencepiece 0.2.3 and transformers 5.24.0 (for
llama2_sp), Python 3.11.7.
"""
import json
import os
import random
import sys
import unicodedata

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = """The quick brown fox jumps over the lazy dog. It's 2026; we'll train 1,234,567 models, they've said.
Don't stop: you're 99.5% done, I'm sure. L'été à Paris était très chaud — naïve café, coöperate.
Привет, мир! Как дела? Ελληνικά γράμματα. 中文字符测试，日本語のテキスト、한국어 텍스트입니다.
مرحبا بالعالم. שלום עולם. नमस्ते दुनिया। ภาษาไทย. Tiếng Việt có dấu.
def f(x):\n    return x ** 2  # code\n\tif a != b: print("ok")\r\n
Emoji 👍🏽 👨‍👩‍👧 🇫🇷 ✨ and numbers ١٢٣ ½ ² ⅻ 1234567890.
"""


def corpus():
    rng = random.Random(0)
    words = CORPUS.split(" ")
    out = [CORPUS] * 20
    for _ in range(400):
        out.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))))
    return out


def build(style):
    """A trained tokenizer in one style (vocabulary 1200 + special tokens)."""
    specials = {"gpt2": ["<|endoftext|>"],
                "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
                "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                "qwen35": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}[style]
    tok = Tokenizer(models.BPE(ignore_merges=(style == "llama3")))
    if style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        pat = {"llama3": LLAMA3, "qwen2": QWEN2, "qwen35": QWEN35}[style]
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pat), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()  # as Qwen 2/3's tokenizer.json
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    if style == "llama3":
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, tok.token_to_id(bos))])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # a non-special added token (normalized), split out after the special ones
    tok.add_tokens(["tokenizer"])
    return tok


STYLES = ["gpt2", "llama3", "qwen2", "qwen35"]
SPM_STYLES = ["llama2", "mistral", "spm_unk", "llama2_sp"]


def build_sp():
    """Llama 2's tokenizer.json as it was made: a SentencePiece BPE model trained by the
    `sentencepiece` library with Llama 2's trainer settings (byte_fallback, split_digits,
    whitespace-only pieces, identity normalization, no extra-whitespace removal, dummy
    prefix, <unk> <s> </s> at 0 1 2, then the byte tokens), converted as transformers'
    LlamaConverter (legacy) converts it: vocabulary in piece order, merges generated from the
    pieces' scores (transformers' generate_merges), BPE with unk_token "<unk>", fuse_unk and
    byte_fallback, normalizer Prepend "▁" + Replace " " -> "▁", no pre-tokenizer, "<s> $A"."""
    import tempfile
    import sentencepiece as spm
    from transformers.tokenization_utils_base import generate_merges
    with tempfile.TemporaryDirectory() as d:
        text = os.path.join(d, "corpus.txt")
        with open(text, "w") as f:
            for line in corpus():
                f.write(line.replace("\n", " ") + "\n")
        spm.SentencePieceTrainer.train(
            input=text, model_prefix=os.path.join(d, "m"), model_type="bpe", vocab_size=900, byte_fallback=True,
            split_digits=True, allow_whitespace_only_pieces=True, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=True, character_coverage=0.99, unk_id=0, bos_id=1,
            eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
        sp = spm.SentencePieceProcessor(model_file=os.path.join(d, "m.model"))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=generate_merges(vocab, scores), unk_token="<unk>", fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def build_spm(style):
    """llama2_sp: build_sp(). The others: a SentencePiece-style BPE as transformers' LlamaConverter writes it (model BPE with
    unk_token "<unk>", byte_fallback, <unk> <s> </s> then the 256 byte tokens <0x00>..<0xFF>
    first in the vocabulary, those three as non-normalized special added tokens, "<s> $A"):
    llama2: normalizer Prepend "▁" + Replace " " -> "▁", no pre-tokenizer (legacy, as Llama 2's
    file); mistral: no normalizer, Metaspace prepend_scheme "first", split false (what
    transformers writes with legacy false); spm_unk: NFC then Metaspace "always" with split, only the
    bytes below 0x80 as tokens (the rest fall to <unk>, not fused), no post-processor."""
    if style == "llama2_sp":
        return build_sp()
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    # limit_alphabet: the rarer characters stay out of the vocabulary (byte fallback)
    base.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=1000, limit_alphabet=150, show_progress=False))
    learned = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(128 if style == "spm_unk" else 256):
        vocab["<0x%02X>" % b] = len(vocab)
    for t, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    # merges a trainer that splits at "▁" cannot learn and Llama 2's vocabulary has: runs of
    # "▁" and pieces across words (its whole line is one word), at several ranks
    for at, (a, b) in [(3, ("▁", "▁")), (10, (".", "▁")), (40, ("▁▁", "▁▁")), (80, ("e", "▁")),
                       (120, ("▁▁", "▁")), (200, (",", "▁")), (300, ("▁▁▁▁", "▁▁▁▁")), (500, ("\n", "▁"))]:
        if a in vocab and b in vocab:
            vocab.setdefault(a + b, len(vocab))
            merges.insert(at, (a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=style != "spm_unk",
                               byte_fallback=True))
    if style == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    elif style == "mistral":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    # normalized added tokens: searched for as the normalizer writes them ("▁to▁ken" in llama2)
    tok.add_tokens([AddedToken("tokenizer", normalized=True), AddedToken("to ken", normalized=True)])
    if style != "spm_unk":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    return tok


def spm_texts(seed=3):
    """Texts for the SentencePiece-style tokenizers beyond hostile_texts(): special tokens and
    byte-token lookalikes in the text, spaces and meta spaces, and long lines (one word each
    in llama2)."""
    rng = random.Random(seed)
    words = CORPUS.split(" ")
    pool = [chr(c) for c in range(0x20, 0x250)] + list(" \t\n'0123456789") * 8 + \
        [chr(c) for c in (0x2581, 0x3000, 0x4e2d, 0x1f44d, 0xfffd)]
    t = ["<s>hello</s> <unk> <s> x</s>", "<s>", " <s> ", "<s> ", "hello<s>world", "<0x41><0xFF> <unk>x",
         "▁", "▁▁x ▁ y", "  two  spaces  ", " leading", "trailing ", "a\tb\n c\r\n", " \n ",
         "tokenizer atokenizer tokenizers to ken to  ken", "x to ken", "to ken", " to ken<s>to ken",
         "▁" * 40, " " * 41, "e e e. . , ,\n\n\n ", "中文 emoji 👍 Ω ÿ ĀāĂ 𝔘𝔫𝔦", "\u00e9 e\u0301 \u212b",
         " ".join(rng.choice(words) for _ in range(3000)),
         "".join(rng.choice(pool) for _ in range(20000))]
    return [s.encode() for s in t]


def category_samples(rng, per=40):
    """For every general category, `per` code points of it (all of it when smaller)."""
    cats = {}
    for cp in range(0x110000):
        c = unicodedata.category(chr(cp))
        if c == "Cs" or cp == 0:
            continue
        cats.setdefault(c, []).append(cp)
    out = []
    for c in sorted(cats):
        cps = cats[c] if len(cats[c]) <= per else rng.sample(cats[c], per)
        out.append((c, cps))
    return out


def hostile_texts(seed=1, big=False):
    """Hostile texts as bytes (some not valid UTF-8); big adds a 200000-character one."""
    rng = random.Random(seed)
    t = [
        "", " ", "  ", "\n", "a", "Hello, world!", "I'm you're we'll they've it's 'S 'LL 'Re 'ſ 'K don'T",
        "12 123 1234 1234567 12.5 ١٢٣٤٥ ½² ⅻⅻ 3.14159e-10", "a  b\t\tc\n\n\nd \r\n e\u00a0f\u3000g\u2028h  \n  ",
        "   leading and trailing   ", "\t\ttabs\n", "x \n\n y", "..., !!! ??? ---\n\n",
        "👍🏽 👨‍👩‍👧 🇫🇷 ✨🙂", "中文字符测试，日本語のテキスト、한국어", "e\u0301 a\u0308\u0304 Z̷̢͓a̶l̵g̷o̸ नमस्ते",
        "<|endoftext|>hello<|im_start|>user\nhi<|im_end|><|begin_of_text|>x<|eot_id|>", "<|endoftext|",
        "a tokenizer tokenizers <|endoftext|>tokenizer", "' 'x '", "\u0085\u000b\u000c\u001c\u001f\u180e\u200b",
        # letters and digits new in Unicode 15 and 16 (Python 3.11 knows 14.0 only)
        "\U00031350\U0001e4d0\U00011f04 \U00010d50\U00016d43 x\U00011f50\U0001e4f0",
        # NFC: decomposed letters, marks out of canonical order, Hangul jamo, singletons, exclusions
        "e\u0301 A\u030a\u0301 a\u0323\u0302 a\u0302\u0323 \u1100\u1161\u11a8 \u1100\u1161 \u212b \u2126 \u0958 "
        "\u0b47\u0b3e \u1e9b\u0323 q\u0307\u0323 \u05d0\u05b7\u05bc <|im_start|>\u0301x",
        "a" * 5000, "ab " * 3000, " " * 3000 + "x", "\n" * 100 + "y", "9" * 1000, "x" + "\u0301" * 500,
    ]
    out = [s.encode() for s in t]
    out += [b"\xff\xfeabc", b"\xe0\x80x\xed\xa0\x80y\xf4\x90\x80\x80z\xc3", b"\xc0\xaf\xf8\x88\x80\x80\x80 a",
            b"ok \xe2\x82 ok \xf0\x9f\x91 end", b"\x80\x80\x80", "é".encode()[:1] + b"tail"]
    for cat, cps in category_samples(rng):
        out.append("".join(chr(c) for c in cps).encode())
        out.append(" ".join(chr(c) for c in cps).encode())
        out.append("".join("x" + chr(c) + "1 " for c in cps).encode())
        out.append("".join("\n" + chr(c) + "'s" for c in cps).encode())
    pool = [chr(c) for c in range(0x20, 0x250)] + list(" \t\n\r'0123456789") * 8 + \
        [chr(c) for c in (0x301, 0x85, 0xa0, 0x3000, 0x4e2d, 0x1f44d, 0x17f, 0x10ffff, 0xfffd)]
    for _ in range(200):
        out.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 80))).encode())
    if big:
        out.append("".join(rng.choice(pool) for _ in range(200000)).encode())
    return out


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    texts = hostile_texts()
    # the committed texts: NUL-separated (no text holds a NUL)
    assert not any(b"\0" in t for t in texts)
    with open(os.path.join(outdir, "texts.bin"), "wb") as f:
        f.write(b"\0".join(texts))
    extra = spm_texts()
    assert not any(b"\0" in t for t in extra)
    with open(os.path.join(outdir, "texts_spm.bin"), "wb") as f:
        f.write(b"\0".join(extra))
    for style in STYLES + SPM_STYLES:
        path = os.path.join(outdir, f"{style}.json")
        if style in SPM_STYLES:
            build_spm(style).save(path)
            tok = Tokenizer.from_file(path)  # the ids of the file as saved
            style_texts = texts + extra  # texts.bin, then texts_spm.bin
        else:
            tok = build(style)
            tok.save(path)
            style_texts = texts
        with open(os.path.join(outdir, f"{style}.ids"), "w") as f:
            for special in (True, False):
                for t in style_texts:
                    ids = tok.encode(t.decode("utf-8", "replace"), add_special_tokens=special).ids
                    f.write(" ".join(map(str, ids)) + "\n")


if __name__ == "__main__":
    main()
