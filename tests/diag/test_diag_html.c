/* test_diag_html.c - am-diag's page (diag.h: am_diag_html) on hand-written rank logs: it holds
 * the text report's sentences exactly (the first failure, its cause, the victims), a lane per
 * rank and its end, the call each rank was in and whom it waited for, memory against the plan;
 * hostile text from a log (markup, a script, a forged closing tag, quotes) is escaped, in the
 * page's text and in its JSON; past AM_DIAG_HTML_LANES ranks it draws a lane per node. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "diag.h"

#define T0 1767000000.0

struct log {
    char text[65536];
    size_t len;
};

static void line(struct log *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void line(struct log *l, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    l->len += (size_t)vsnprintf(l->text + l->len, sizeof(l->text) - l->len, fmt, ap);
    va_end(ap);
    l->len += (size_t)snprintf(l->text + l->len, sizeof(l->text) - l->len, "\n");
}

/* A rank of a dp group of `world` ranks, 8 to a node (host "n<rank / 8>", or `host`): start,
 * groups (dp pairs), memory, 3 steps of 1 s (rank `slow` spends 4 s at step 2), then its end: the
 * culprit segfaults at step 4 with `message` in its cause record (an error cause when given),
 * the others wait in allreduce #4 for the culprit and are stopped. */
static void rank_log(struct log *l, int rank, int world, int culprit, const char *host, const char *message, int slow)
{
    char h[64];
    snprintf(h, sizeof(h), "n%d", rank / 8);
    l->len = 0;
    line(l, "{\"type\":\"start\",\"host\":\"%s\",\"pid\":%d,\"rank\":%d,\"world\":%d,\"job\":\"42.0\",\"local_rank\":%d,"
            "\"coords\":{\"pp\":0,\"dp_replicate\":0,\"dp_shard\":%d,\"cp\":0,\"tp\":0,\"ep\":0},\"device\":\"cpu\","
            "\"time\":%.6f,\"max_steps\":%d,\"plan_bytes\":1073741824}", host ? host : h, 100 + rank, rank, world,
         rank % 8, rank, T0, slow >= 0 ? 3 : 6);
    line(l, "{\"type\":\"groups\",\"rank\":%d,\"groups\":[{\"name\":\"dp\",\"gid\":%d,\"ranks\":[%d,%d]}]}", rank,
         rank / 2, rank / 2 * 2, rank / 2 * 2 + 1);
    line(l, "{\"type\":\"memory\",\"param_bytes\":1,\"weights_bytes\":536870912,\"grads_bytes\":268435456,"
            "\"optimizer_bytes\":%d,\"act_bytes\":0,\"pipe_bytes\":0,\"gathered_bytes\":0,\"grad_buffers_bytes\":0}",
         rank == culprit ? 536870912 : 134217728);
    double t = T0 + 1;
    for (int s = 1; s <= 3; s++) {
        double step_s = slow >= 0 && s == 2 ? 5.0 : 1.0; /* the others wait 4 s for the slow rank */
        t += step_s;
        line(l, "{\"type\":\"step\",\"step\":%d,\"loss\":5.0,\"step_s\":%.1f,\"comm_s\":%.3f,\"time\":%.6f}", s, step_s,
             rank != slow && slow >= 0 && s == 2 ? 4.01 : 0.01, t);
    }
    for (int c = 1; c <= 3; c++)
        line(l, "{\"type\":\"flight\",\"id\":%d,\"group\":\"dp\",\"gid\":%d,\"seq\":%d,\"op\":\"allreduce\","
                "\"dtype\":\"fp32\",\"count\":100,\"bytes\":400,\"redop\":\"sum\",\"peer\":null,\"state\":\"completed\","
                "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":%.6f,\"waiting_for\":null}", c, rank / 2, c, T0 + 1 + c, T0 + 1 + c,
             T0 + 1.5 + c);
    if (rank == culprit) {
        if (message)
            line(l, "{\"type\":\"cause\",\"cause\":\"error\",\"message\":\"%s\",\"rank\":%d,\"step\":4,\"time\":%.6f}",
                 message, rank, T0 + 10.5);
        else
            line(l, "{\"type\":\"cause\",\"cause\":\"signal\",\"signal\":11,\"signal_name\":\"SIGSEGV\",\"code\":1,"
                    "\"code_name\":\"SEGV_MAPERR\",\"addr\":\"0x10\",\"sender_pid\":null,\"from\":\"kernel\",\"rank\":%d,"
                    "\"step\":4,\"time\":%.6f,\"backtrace\":[\"am-train(am_fault_segv+0x12) [0x1]\"]}", rank, T0 + 10.5);
        line(l, "{\"type\":\"exit\",\"rank\":%d,\"status\":%d,\"signal\":%s,\"stop_signal\":null,\"time\":%.6f}", rank,
             message ? 1 : 139, message ? "null" : "11", T0 + 10.51);
        return;
    }
    int partner = rank / 2 * 2 + (rank % 2 ? 0 : 1);
    line(l, "{\"type\":\"flight\",\"id\":4,\"group\":\"dp\",\"gid\":%d,\"seq\":4,\"op\":\"allreduce\",\"dtype\":\"fp32\","
            "\"count\":100,\"bytes\":400,\"redop\":\"sum\",\"peer\":null,\"state\":\"started\",\"enqueued\":%.6f,"
            "\"started\":%.6f,\"ended\":null,\"waiting_for\":%d}", rank / 2, T0 + 10.2, T0 + 10.2, partner);
    line(l, "{\"type\":\"stop\",\"rank\":%d,\"signal\":\"SIGTERM\",\"by\":\"am-launch\",\"because_rank\":%d,"
            "\"because\":\"x\",\"time\":%.6f}", rank, culprit, T0 + 10.52);
    line(l, "{\"type\":\"cause\",\"cause\":\"signal\",\"signal\":15,\"signal_name\":\"SIGTERM\",\"code\":0,"
            "\"code_name\":\"SI_USER\",\"addr\":null,\"sender_pid\":99,\"from\":\"supervisor\",\"rank\":%d,\"step\":4,"
            "\"time\":%.6f,\"backtrace\":[]}", rank, T0 + 10.53);
    line(l, "{\"type\":\"exit\",\"rank\":%d,\"status\":143,\"signal\":15,\"stop_signal\":\"SIGTERM\",\"time\":%.6f}", rank,
         T0 + 10.54);
}

static char *page(const struct am_diag *d, size_t *len)
{
    char *buf = NULL;
    FILE *f = open_memstream(&buf, len);
    assert_non_null(f);
    assert_int_equal(am_diag_html(d, f), 0);
    fclose(f);
    return buf;
}

static void expect(const char *page, const char *part)
{
    if (!strstr(page, part))
        fail_msg("the page lacks: %s", part);
}

static int count(const char *s, const char *part)
{
    int n = 0;
    for (const char *p = strstr(s, part); p; p = strstr(p + 1, part))
        n++;
    return n;
}

/* The page's JSON: what is between <script type="application/json" id="am-data"> and </script>. */
static char *data_of(const char *page)
{
    const char *open = "<script type=\"application/json\" id=\"am-data\">", *a = strstr(page, open);
    assert_non_null(a);
    a += strlen(open);
    const char *b = strstr(a, "</script>");
    assert_non_null(b);
    return strndup(a, (size_t)(b - a));
}

/* rank 2 of 4 segfaults at step 4, rank 1 straggles at step 2: the report's sentences, lanes */
static void test_crash_page(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 4; r++) {
        rank_log(&l, r, 4, 2, NULL, NULL, -1);
        assert_int_equal(am_diag_add_log(&d, r, l.text, l.len), 0);
    }
    am_diag_analyze(&d);
    size_t len;
    char *p = page(&d, &len);
    expect(p, "<!DOCTYPE html>");
    expect(p, "<div class=\"ff\">first failure: rank 2 on n0 (local rank 2; pp 0, dp_replicate 0, dp_shard 2, cp 0, "
              "tp 0, ep 0) at step 4, 2025-12-29 09:20:10.500 UTC</div>");
    expect(p, "<div class=\"cause\">  cause: signal: SIGSEGV (SEGV_MAPERR) at address 0x10</div>");
    expect(p, "<div class=\"l\">  at:   am-train(am_fault_segv+0x12) [0x1]</div>");
    expect(p, "<div class=\"others\">others: 3 victims (ranks 0-1, 3)</div>");
    /* each rank's lane, titled with its report line; rank 3 waited for rank 2 */
    expect(p, "<g data-r=\"3\"><title>rank 3 on n0: victim: waited in allreduce #4 of group dp for 0.34 s (waiting "
              "for rank 2), whose missing member is rank 2; stopped by SIGTERM from am-launch because rank 2 failed");
    expect(p, "<path class=\"vf\""); /* the first failure's marker */
    expect(p, "<path class=\"wf\" marker-end=\"url(#ah0)\"");
    expect(p, "<td>allreduce #4 of group dp</td><td>3</td><td>0-1, 3</td><td>rank 0 (1), rank 1 (1), rank 2 (1)</td>");
    /* memory: the culprit allocated 1.25 GiB against a plan of 1 GiB */
    expect(p, "1 rank above its plan. The fullest: rank 2, 1.25 GiB of 1.00 GiB (125%).");
    expect(p, "<title>rank 2: allocated 1.25 GiB; plan 1.00 GiB (125%)</title>");
    /* nothing fetched */
    assert_null(strstr(p, "http://"));
    assert_null(strstr(p, "https://"));
    assert_null(strstr(p, " src="));
    assert_null(strstr(p, "<link"));
    free(p);
    am_diag_free(&d);
}

/* a straggler's slow step is marked; a clean job's page says so */
static void test_straggler_page(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 4; r++) {
        rank_log(&l, r, 4, -1, NULL, NULL, 1); /* its end cut off: a clean exit after the steps instead */
        char *cut = strstr(l.text, "{\"type\":\"flight\",\"id\":4");
        l.len = (size_t)(cut - l.text);
        line(&l, "{\"type\":\"exit\",\"rank\":%d,\"status\":0,\"signal\":null,\"stop_signal\":null,\"time\":%.6f}", r,
             T0 + 9);
        assert_int_equal(am_diag_add_log(&d, r, l.text, l.len), 0);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.ranks[1].verdict, AM_VERDICT_STRAGGLER);
    size_t len;
    char *p = page(&d, &len);
    expect(p, "<div id=\"verdict\" class=\"clean\">");
    expect(p, "no failure: every rank with a log finished cleanly");
    expect(p, "rank 1 on n0: straggler: finished cleanly, but held the others back: at step 2");
    assert_int_equal(count(p, "<rect class=\"sl\""), 1);
    free(p);
    am_diag_free(&d);
}

/* hostile text: a host and a message with markup, a script, a forged end of the JSON element
 * and an HTML comment opening; none reaches the page as markup */
static void test_hostile_text(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    const char *evil = "<script>alert(1)</script></script><!--<script> x=\\\"1\\\" & 'q' <img src=x onerror=alert(2)>";
    am_diag_init(&d);
    for (int r = 0; r < 2; r++) {
        rank_log(&l, r, 2, 0, r == 0 ? "<b>n0</b>&amp;\\u001b[2J" : "n1", evil, -1);
        assert_int_equal(am_diag_add_log(&d, r, l.text, l.len), 0);
    }
    am_diag_analyze(&d);
    size_t len;
    char *p = page(&d, &len);
    /* the report's sentence, terminal escapes and all, then HTML entities */
    expect(p, "<div class=\"ff\">first failure: rank 0 on &lt;b&gt;n0&lt;/b&gt;&amp;amp;\\x1b[2J (local rank 0;");
    expect(p, "<div class=\"cause\">  cause: error: &lt;script&gt;alert(1)&lt;/script&gt;&lt;/script&gt;&lt;!--&lt;script&gt; "
              "x=&quot;1&quot; &amp; &#39;q&#39; &lt;img src=x onerror=alert(2)&gt;</div>");
    /* markup: only the page's own two scripts, no image, no element from the log */
    assert_int_equal(count(p, "<script"), 2);
    assert_int_equal(count(p, "</script>"), 2);
    assert_null(strstr(p, "<img"));
    assert_null(strstr(p, "<b>"));
    assert_null(strstr(p, "<!--"));
    assert_null(strchr(p, '\x1b'));
    /* the JSON: no <, > or & at all (written \u003c, \u003e, \u0026), the message kept */
    char *j = data_of(p);
    assert_null(strchr(j, '<'));
    assert_null(strchr(j, '>'));
    assert_null(strchr(j, '&'));
    expect(j, "\\u003cscript\\u003ealert(1)\\u003c/script\\u003e\\u003c/script\\u003e\\u003c!--\\u003cscript\\u003e");
    json_error_t err;
    json_t *o = json_loads(j, 0, &err);
    assert_non_null(o);
    const char *msg = json_string_value(json_object_get(json_object_get(json_object_get(o, "causes"), "0"), "message"));
    assert_non_null(msg);
    assert_string_equal(msg, "<script>alert(1)</script></script><!--<script> x=\"1\" & 'q' <img src=x onerror=alert(2)>");
    json_decref(o);
    free(j);
    free(p);
    am_diag_free(&d);
}

/* 400 ranks on 50 nodes: a lane per node, lanes of their own for the ranks that matter */
static void test_large_job_by_node(void **state)
{
    (void)state;
    enum { N = 400 };
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < N; r++) {
        rank_log(&l, r, N, 203, NULL, NULL, -1);
        assert_int_equal(am_diag_add_log(&d, r, l.text, l.len), 0);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 203);
    size_t len;
    char *p = page(&d, &len);
    expect(p, "This job is large");
    expect(p, "nodes (50):");
    assert_int_equal(count(p, "<title>node n"), 50 * 2); /* a timeline lane and a memory column per node */
    expect(p, "<title>node n25: 8 ranks (200 to 207): 1 first_failure 7 victim; its worst: rank 203 on n25: "
              "first_failure: SIGSEGV (SEGV_MAPERR) at address 0x10</title>");
    /* lanes of their own: rank 203 and its dp partner, 202 */
    expect(p, "<g data-r=\"203\"><title>rank 203 on n25: first_failure");
    expect(p, "<g data-r=\"202\"><title>rank 202 on n25: victim");
    assert_null(strstr(p, "<g data-r=\"5\"><title>rank 5 on"));
    /* every rank's line is in the data */
    char *j = data_of(p);
    expect(j, "\"5\":\"rank 5 on n0: victim: waited in allreduce #4 of group dp");
    free(j);
    assert_true(len < 1000000);
    free(p);
    am_diag_free(&d);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crash_page),
        cmocka_unit_test(test_straggler_page),
        cmocka_unit_test(test_hostile_text),
        cmocka_unit_test(test_large_job_by_node),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
