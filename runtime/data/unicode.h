/* unicode.h - what byte-level BPE pre-tokenizers need of Unicode: UTF-8 decoding that
 * repairs invalid input exactly as Python's bytes.decode("utf-8", "replace") does, and the
 * classes their split patterns name (\p{L}, \p{N}, \p{M}, \s).
 *
 * The classes come from the Unicode Character Database 16.0.0, the version of the regex
 * engine (Oniguruma) inside the Hugging Face `tokenizers` library 0.23; unicode_table.c is
 * generated from it by unicode_table.py (which says how).
 */
#ifndef AM_UNICODE_H
#define AM_UNICODE_H

#include <stddef.h>
#include <stdint.h>

enum { AM_UNI_L = 1, AM_UNI_N = 2, AM_UNI_WS = 4, AM_UNI_M = 8 };

extern const uint16_t am_uni_stage1[0x110000 >> 8];
extern const uint8_t am_uni_stage2[][256];

/* The class flags of code point cp (0 for anything past U+10FFFF). */
static inline unsigned am_uni_flags(uint32_t cp)
{
    return cp < 0x110000 ? am_uni_stage2[am_uni_stage1[cp >> 8]][cp & 0xff] : 0;
}

/* Decodes one code point of s[0, n) (n > 0) into *cp and returns the bytes it took. An
 * invalid sequence gives U+FFFD for its maximal valid prefix (at least one byte), as
 * Unicode's "maximal subpart" practice and Python's decoder do. */
size_t am_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp);

/* Writes cp as UTF-8 into out (4 bytes at most) and returns the length. */
size_t am_utf8_encode(uint32_t cp, unsigned char *out);

/* True when s[0, n) is valid UTF-8 (no surrogates, nothing past U+10FFFF, no overlongs). */
int am_utf8_valid(const unsigned char *s, size_t n);

/* NFC (Unicode normalisation form C) as the `tokenizers` library computes it: with the
 * characters of Unicode 9.0 (unicode_nfc.c says why and how it is generated).
 * am_nfc_needed: whether valid UTF-8 s[0, n) holds a character NFC may change (when not, its
 * NFC is itself). am_nfc: the NFC of valid UTF-8 s[0, n), malloc'ed (NULL when memory runs
 * out), its length in *len. */
int am_nfc_needed(const unsigned char *s, size_t n);
unsigned char *am_nfc(const unsigned char *s, size_t n, size_t *len);

#endif
