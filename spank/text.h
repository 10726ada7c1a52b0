/* text.h - the plugin's helpers for text a user or an admin typed: strict parsers for
 * counts and sizes, and a safe, short rendering of any value for messages.
 *
 * Everything here is pure (no Slurm, no I/O) so that config.c and options.c stay testable
 * and so that no value, however long or binary, can make a message unbounded: am_shown()
 * keeps at most AM_SHOWN_MAX visible characters, escapes control bytes and invalid UTF-8
 * as \xNN, and says how long the value really was.
 */
#ifndef AM_SPANK_TEXT_H
#define AM_SPANK_TEXT_H

#include <stdbool.h>
#include <stddef.h>

#define AM_SHOWN_MAX 40   /* visible characters of a value shown in a message */
#define AM_SHOWN_LEN 200  /* a buffer that always holds am_shown()'s result */

/* Writes a printable rendering of s into buf (len >= AM_SHOWN_LEN keeps it whole):
 * valid UTF-8 and printable ASCII as is, anything else as \xNN, and when s is longer than
 * AM_SHOWN_MAX characters the first ones followed by "...(N bytes)". Returns buf. */
const char *am_shown(const char *s, char *buf, size_t len);

/* A whole number written in decimal digits only (no sign, no spaces, no suffix) within
 * [min, max]. Returns 0, or -1 leaving *out alone. */
int am_parse_count(const char *s, long min, long max, long *out);

/* A memory size: a positive decimal number with an optional K, M, G or T (powers of
 * 1024) and an optional B or iB: "80G", "141GiB", "0.5T", "1048576". Returns 0, or -1. */
int am_parse_size(const char *s, double *out);

/* True when s holds an ASCII control character (tab and newline included). */
bool am_has_control(const char *s);

/* What is wrong with a path the plugin hands over to the tasks, as the end of a sentence
 * that names it: "contains a newline", "contains a tab", "contains a carriage return",
 * "contains a control character (\xNN)" (the first one found), or "is not an absolute
 * path"; NULL when the path is absolute and made of printable characters. buf (at least 64
 * bytes) holds the text when it names the character. */
const char *am_path_problem(const char *p, char *buf, size_t len);

/* Greatest common divisor of two positive numbers (0 when either is not positive). */
int am_gcd(int a, int b);

#endif
