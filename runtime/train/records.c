/* records.c - the rank log's records, the device's fault hook, the step line and its MFU
 * (trainer.h; the first records and the setup's failure: train.h). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "crash.h"
#include "moe.h"
#include "ring.h"
#include "train.h"
#include "trainer.h"
#include "util.h"

extern char **environ;

/* ---- the rank program's start: the log before anything that can fail ------------------- */

/* The host as the launcher names it: Slurm's node name under srun, else the host name. */
static void host_name(char *out, size_t len)
{
    const char *node = getenv("SLURMD_NODENAME");
    if (node && *node)
        snprintf(out, len, "%s", node);
    else if (gethostname(out, len - 1) < 0)
        snprintf(out, len, "localhost");
    out[len - 1] = '\0';
}

/* A whole number from the environment, or -1. */
static long env_number(const char *name)
{
    const char *v = getenv(name);
    char *end;
    if (!v || !*v)
        return -1;
    errno = 0;
    long n = strtol(v, &end, 10);
    return *end || errno || n < 0 || n > (1L << 30) ? -1 : n;
}

int am_train_log_begin(struct am_log *log, int *rank, char *err, size_t err_len)
{
    const char *job = getenv("AM_JOB_ID"), *recipe = getenv("AM_RECIPE");
    long r = env_number("AM_RANK"), world = env_number("AM_WORLD_SIZE"), local = env_number("AM_LOCAL_RANK");
    char host[256];
    log->fd = -1;
    *rank = (int)r;
    if (!job || !*job || r < 0) {
        snprintf(err, err_len, "no log: AM_JOB_ID and AM_RANK are not set (am-launch sets them: start rank programs "
                 "with am-launch)");
        return -1;
    }
    if (am_log_open(log, NULL, job, (int)r, err, err_len) < 0)
        return -1;
    host_name(host, sizeof(host));
    json_t *o = json_pack("{s:s,s:i,s:i,s:s,s:s,s:f}", "host", host, "pid", (int)getpid(), "rank", (int)r, "job", job,
                          "version", PACKAGE_VERSION, "time", am_wall_time());
    if (world > 0)
        json_object_set_new(o, "world", json_integer(world));
    if (local >= 0)
        json_object_set_new(o, "local_rank", json_integer(local));
    if (recipe && *recipe)
        json_object_set_new(o, "recipe", json_string(recipe));
    am_log_record(log, "start", o);
    return am_crash_install(log->fd, (int)r, NULL, err, err_len);
}

void am_train_log_failure(struct am_log *log, int rank, const char *stage, const struct am_errors *err)
{
    if (log->fd < 0 || err->n == 0 || !am_crash_report_begin())
        return;
    json_t *o = json_pack("{s:s,s:s,s:s,s:i,s:f}", "cause", "error", "stage", stage, "message", err->msg[0], "rank",
                          rank, "time", am_wall_time());
    if (err->n > 1) {
        json_t *all = json_array();
        for (size_t i = 0; i < err->n; i++)
            json_array_append_new(all, json_string(err->msg[i]));
        json_object_set_new(o, "messages", all);
    }
    am_log_record(log, "cause", o);
    am_crash_report_end();
}

void am_train_log_end(struct am_log *log)
{
    am_crash_uninstall();
    am_log_close(log);
}

/* ---- the trainer's records ------------------------------------------------------------- */

/* am-plan's memory estimate for this rank: its pipeline rank's. */
double am_train_plan_bytes(const struct trainer *t)
{
    const struct am_plan *p = t->p;
    int k = t->s->coords.pp;
    return p->mem_pp && k >= 0 && k < p->pp ? p->mem_pp[k].total : p->mem.total;
}

/* FNV-1a (64 bits) of the recipe file, in hex: tells whether ranks ran the same recipe. */
static void recipe_hash(const char *path, char out[17])
{
    char *buf = NULL;
    size_t len = 0;
    uint64_t h = 1469598103934665603ull;
    if (!path || am_read_file(path, 16u << 20, &buf, &len) != NULL) {
        snprintf(out, 17, "unknown");
        return;
    }
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)buf[i]) * 1099511628211ull;
    free(buf);
    snprintf(out, 17, "%016llx", (unsigned long long)h);
}

/* The AM_* variables of the environment (the bootstrap's socket number left out). */
static json_t *am_settings(void)
{
    json_t *o = json_object();
    for (char **e = environ; *e; e++) {
        const char *eq = strchr(*e, '=');
        if (strncmp(*e, "AM_", 3) != 0 || !eq || strncmp(*e, "AM_BOOTSTRAP_FD=", 16) == 0)
            continue;
        char key[128];
        snprintf(key, sizeof(key), "%.*s", (int)(eq - *e) < 127 ? (int)(eq - *e) : 127, *e);
        json_object_set_new(o, key, json_string(eq + 1));
    }
    return o;
}

/* Rank 0's TensorBoard file: in AM_TENSORBOARD_DIR/<job id> when set (none: no file), else
 * in the job's log directory, <log dir>/<job id>/tensorboard. A file that cannot be made is
 * a note: the run goes on without curves (its log has every value). */
static void tensorboard_open(struct trainer *t)
{
    const char *env = getenv("AM_TENSORBOARD_DIR");
    char dir[4096], msg[4200];
    if (env && strcmp(env, "none") == 0)
        return;
    if (env && *env)
        snprintf(dir, sizeof dir, "%s/%s", env, t->s->info.job_id);
    else {
        const char *slash = strrchr(t->log->path, '/');
        if (t->log->fd < 0 || !slash)
            return;
        snprintf(dir, sizeof dir, "%.*s/tensorboard", (int)(slash - t->log->path), t->log->path);
    }
    if (am_tfevents_open(&t->tb, dir, t->s->info.host, am_wall_time(), msg, sizeof msg) == 0)
        return;
    am_log_record(t->log, "note", json_pack("{s:s,s:s,s:f}", "where", "tensorboard", "message", msg, "time",
                                            am_wall_time()));
    fprintf(stderr, "am-train: rank 0: note: TensorBoard: %s (no curves for this run: set AM_TENSORBOARD_DIR to a "
            "writable directory, or to none)\n", msg);
}

/* The step record's numbers as TensorBoard scalars "train/<key>" at the step (its time as
 * the wall time), and the tokens per second. A write that fails is noted once and ends the
 * file. */
static void tensorboard_step(struct trainer *t, json_t *rec)
{
    struct am_tfscalar v[64];
    char tags[64][64], msg[4200];
    size_t n = 0;
    const char *key;
    json_t *val;
    json_object_foreach(rec, key, val) {
        if (!json_is_number(val) || strcmp(key, "step") == 0 || strcmp(key, "time") == 0 || n == 63)
            continue;
        snprintf(tags[n], sizeof tags[n], "train/%s", key);
        v[n] = (struct am_tfscalar){tags[n], json_number_value(val)};
        n++;
    }
    double dt = json_number_value(json_object_get(rec, "step_s"));
    if (dt > 0)
        v[n++] = (struct am_tfscalar){"train/tokens_per_s", json_number_value(json_object_get(rec, "tokens")) / dt};
    if (am_tfevents_scalars(&t->tb, json_integer_value(json_object_get(rec, "step")),
                            json_number_value(json_object_get(rec, "time")), v, n, msg, sizeof msg) == 0)
        return;
    fprintf(stderr, "am-train: rank 0: note: TensorBoard: %s (no more curves for this run)\n", msg);
    am_tfevents_close(&t->tb);
}

/* The rank's second start record, once it is placed: coordinates, device, recipe, settings. */
void am_train_log_start(struct trainer *t)
{
    const struct am_coords *c = &t->s->coords;
    char hash[17];
    recipe_hash(t->r->file, hash);
    json_t *o = json_pack("{s:s,s:i,s:i,s:i,s:s,s:s,s:i,s:{s:i,s:i,s:i,s:i,s:i,s:i},s:s,s:f}", "host",
                          t->s->info.host, "pid", (int)getpid(), "rank", t->s->info.rank, "world", t->s->info.size,
                          "job", t->s->info.job_id, "recipe", t->r->file, "local_rank", t->s->info.local_rank, "coords",
                          "pp", c->pp, "dp_replicate", c->dp_replicate, "dp_shard", c->dp_shard, "cp", c->cp, "tp",
                          c->tp, "ep", c->ep, "device", t->K->name, "time", t->flight.anchor_wall);
    json_object_set_new(o, "version", json_string(PACKAGE_VERSION));
    json_object_set_new(o, "mono", json_real(t->flight.anchor_mono));
    json_object_set_new(o, "node_id", json_integer(t->s->info.node_id));
    json_object_set_new(o, "mesh_rank", json_integer(t->s->place.mesh_of ? t->s->place.mesh_of[t->s->info.rank] : -1));
    json_object_set_new(o, "recipe_hash", json_string(hash));
    json_object_set_new(o, "max_steps", json_integer(t->r->steps.max_steps));
    json_object_set_new(o, "timeout_s", json_real(t->wd.timeout_s));
    json_object_set_new(o, "timeout_from", json_string(t->wd.timeout_from));
    json_object_set_new(o, "flight_size", json_integer((json_int_t)t->flight.cap));
    json_object_set_new(o, "device_name", json_string(t->dev.name));
    json_object_set_new(o, "plan_bytes", json_integer((json_int_t)am_train_plan_bytes(t)));
    if (t->peak_flops > 0) {
        json_object_set_new(o, "peak_flops", json_real(t->peak_flops));
        json_object_set_new(o, "peak_from", json_string(t->peak_from));
    }
    json_object_set_new(o, "settings", am_settings());
    am_log_record(t->log, "start", o);
    if (t->s->info.rank == 0)
        tensorboard_open(t);
}

/* This rank's groups, for am-diag: {"type":"groups","groups":[{"name":"dp","gid":0,"ranks":[0,1]},...]}. */
void am_train_log_groups(struct trainer *t)
{
    json_t *a = json_array();
    for (int g = 0; g < t->g.set.n; g++) {
        if (!t->g.comms[g])
            continue;
        json_t *ranks = json_array();
        for (int i = 0; i < t->g.set.sizes[g]; i++)
            json_array_append_new(ranks, json_integer(t->g.set.groups[g][i]));
        json_array_append_new(a, json_pack("{s:s,s:i,s:o}", "name", t->g.names[g], "gid", g, "ranks", ranks));
    }
    am_log_record(t->log, "groups", json_pack("{s:i,s:o}", "rank", t->s->info.rank, "groups", a));
}

/* What the rank allocated, as am-plan counts it: weights (the masters in the storage dtype and
 * their copy in another compute dtype), gradients (fp32, and their copy in a narrower
 * reduce_dtype), Adam's moments (the storage dtype),
 * activations and the pipeline's buffers; with expert parallelism the buffers sized to the
 * loads apart (expert_rows_bytes: at the start, the plan's balanced load). */
void am_train_log_memory(struct trainer *t)
{
    const struct am_model *m = &t->model;
    struct am_dp_bytes b;
    am_dp_bytes(&t->dp, &b);
    json_t *o = json_pack("{s:I,s:I,s:I,s:I,s:I,s:I,s:i,s:i,s:b}", "param_bytes",
                          (json_int_t)(m->n_elems * am_dtype_size(m->store_dt)), "weights_bytes", (json_int_t)b.weights,
                          "grads_bytes", (json_int_t)b.grads, "optimizer_bytes", (json_int_t)b.optimizer,
                          "act_bytes", (json_int_t)m->act_bytes, "pipe_bytes", (json_int_t)am_pipe_bytes(&t->pipe),
                          "slots", m->n_slots, "peak_micro", am_pipe_peak(t->pipe.actions, t->pipe.n_actions),
                          "recompute", m->sh.recompute);
    json_object_set_new(o, "compute_dtype", json_string(am_dtype_torch_name(m->act_dt)));
    json_object_set_new(o, "storage_dtype", json_string(am_dtype_torch_name(m->store_dt)));
    json_object_set_new(o, "gathered_bytes", json_integer((json_int_t)b.gathered));
    json_object_set_new(o, "grad_buffers_bytes", json_integer((json_int_t)b.grad_buffers));
    json_object_set_new(o, "sharded", json_boolean(am_dp_sharded(&t->dp)));
    if (m->sh.lora_r > 0)
        json_object_set_new(o, "adapter_params", json_integer((json_int_t)m->grad_elems));
    json_object_set_new(o, "alltoall_bytes", json_integer((json_int_t)am_moe_alltoall_bytes(m)));
    /* expert parallelism: the buffers sized to the loads, at the plan's balanced load at the start
     * (they grow past it with the loads: the step records' expert_rows_bytes) */
    json_object_set_new(o, "expert_rows_bytes", json_integer((json_int_t)am_moe_rows_bytes(m)));
    am_log_record(t->log, "memory", o);
}

/* ---- the step: its record, its line, the device's peak for the MFU ---------------------- */

/* The device's dense bf16 peak, FLOP/s, for the step's MFU: AM_PEAK_TFLOPS when set, else
 * the table below by the GPU's name; 0 (no MFU) for the CPU and unknown GPUs. Figures are
 * NVIDIA's datasheets' dense BF16 Tensor Core numbers (the sparse figure halved): H100 SXM
 * 989.4 TFLOP/s (H100 Tensor Core GPU datasheet), H200 the same (H200 datasheet, same
 * Hopper SXM5 compute), H100 NVL 835, H100 PCIe 756, A100 312 (A100 datasheet). */
int am_train_device_peak(struct trainer *t, char *err, size_t err_len)
{
    static const struct {
        const char *has, *also;
        double tflops;
    } table[] = {{"H100", "NVL", 835}, {"H100", "PCIe", 756}, {"H200", NULL, 989.4}, {"H100", NULL, 989.4},
                 {"A100", NULL, 312}};
    const char *env = getenv("AM_PEAK_TFLOPS");
    t->peak_flops = 0;
    t->peak_from = NULL;
    if (env && *env) {
        char *end;
        double v = strtod(env, &end);
        if (*end || !(v > 0) || !isfinite(v))
            return am_fail(err, err_len, "AM_PEAK_TFLOPS=%s: not a number of TFLOP/s above 0 (the device's dense peak "
                           "for the step line's MFU, e.g. AM_PEAK_TFLOPS=989)", env);
        t->peak_flops = v * 1e12;
        t->peak_from = "AM_PEAK_TFLOPS";
        return 0;
    }
    if (t->dev.device != AM_DEV_CUDA)
        return 0;
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (strstr(t->dev.name, table[i].has) && (!table[i].also || strstr(t->dev.name, table[i].also))) {
            t->peak_flops = table[i].tflops * 1e12;
            t->peak_from = "table";
            return 0;
        }
    return 0;
}

/* This rank's share of the model FLOPs of a step (am-plan's count for the job / world). */
static double rank_flops(const struct trainer *t) { return t->p->flops_per_step / (double)t->p->world; }

/* The step's record: its values, times, memory and, where they apply, its label tokens, the
 * data parallelism's (dp.h), the ring's, the MFU and the experts' routing. */
void am_train_log_step(struct trainer *t, long step, double loss, double lr, double norm, double dt, int64_t labels)
{
    const struct am_recipe *r = t->r;
    const struct am_plan *p = t->p;
    struct am_model *m = &t->model;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    json_t *rec = json_pack("{s:i,s:f,s:f,s:f,s:I,s:f,s:f,s:f,s:I}", "step", (int)step + 1, "loss", loss, "lr", lr,
                            "grad_norm", norm, "tokens", (json_int_t)p->tokens_per_step, "step_s", dt, "time",
                            am_wall_time(), "comm_s", t->comm_s, "max_rss_kib", (json_int_t)ru.ru_maxrss);
    json_object_set_new(rec, "grad_wait_s", json_real(t->dp.sync.wait_s));
    json_object_set_new(rec, "cpu_s", json_real(t->cpu_s));
    json_object_set_new(rec, "step_s_max", json_real(t->job_max.step_s));
    json_object_set_new(rec, "work_s_max", json_real(t->job_max.work_s));
    json_object_set_new(rec, "work_s_max_rank", json_integer(t->job_max.work_rank));
    if (t->mask || t->packs)
        json_object_set_new(rec, "label_tokens", json_integer((json_int_t)labels));
    am_dp_record(&t->dp, rec);
    if (m->cp) { /* context parallelism: waiting for the ring, and the block kernels (ring.h) */
        json_object_set_new(rec, "ring_wait_s", json_real(m->cp->wait_s));
        json_object_set_new(rec, "ring_block_s", json_real(m->cp->block_s));
        m->cp->wait_s = m->cp->block_s = 0;
    }
    if (t->peak_flops > 0) { /* mfu = flops / step_s / peak_flops, all three here */
        json_object_set_new(rec, "flops", json_real(rank_flops(t)));
        json_object_set_new(rec, "peak_flops", json_real(t->peak_flops));
        json_object_set_new(rec, "mfu", json_real(rank_flops(t) / dt / t->peak_flops));
    }
    if (t->K->mem_stats) {
        struct am_dev_mem dm;
        t->K->mem_stats(&t->dev, &dm);
        json_object_set_new(rec, "dev_mem_in_use", json_integer((json_int_t)dm.in_use));
        json_object_set_new(rec, "dev_mem_peak", json_integer((json_int_t)dm.peak));
        json_object_set_new(rec, "dev_mem_held", json_integer((json_int_t)dm.held));
    }
    if (m->moe) { /* tokens routed to each expert over the step on this rank (moe.h) */
        struct am_moe_stats ms;
        am_moe_stats(m, &ms);
        json_object_set_new(rec, "expert_tokens_min", json_integer((json_int_t)ms.min));
        json_object_set_new(rec, "expert_tokens_max", json_integer((json_int_t)ms.max));
        json_object_set_new(rec, "expert_imbalance", json_real(ms.imbalance));
        json_object_set_new(rec, "moe_experts_s", json_real(ms.experts_s));
        json_object_set_new(rec, "moe_dispatch_s", json_real(ms.dispatch_s));
        if ((am_model_hf_aux(&r->model) && m->sh.last_stage) || /* computed by the last pipeline stage, */
            r->model.aux_loss_coeff > 0) /* or AutoModel's: over the rank's own MoE layers */
            json_object_set_new(rec, "aux_loss", json_real(ms.aux));
        if (p->ep > 1) {
            json_object_set_new(rec, "alltoall_s", json_real(ms.alltoall_s));
            json_object_set_new(rec, "ep_tokens_in", json_integer((json_int_t)ms.tokens_in));
            json_object_set_new(rec, "ep_rows_max", json_integer((json_int_t)ms.rows_max));
            json_object_set_new(rec, "ep_layer_rows_max", json_integer((json_int_t)ms.layer_rows_max));
            json_object_set_new(rec, "expert_rows_bytes", json_integer((json_int_t)ms.rows_bytes));
        }
    }
    if (t->tb.fd >= 0)
        tensorboard_step(t, rec);
    am_log_record(t->log, "step", rec);
}

/* The step's line on rank 0. */
void am_train_print_step(const struct trainer *t, long step, double loss, double lr, double norm, double dt,
                         double elapsed)
{
    double tok_s = t->p->tokens_per_step / dt;
    double eta = elapsed / (double)(step + 1) * (double)(t->r->steps.max_steps - step - 1);
    char mfu[32] = "";
    if (t->peak_flops > 0)
        snprintf(mfu, sizeof mfu, " | MFU %.1f%%", 100.0 * rank_flops(t) / dt / t->peak_flops);
    printf("step %4ld/%ld | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | %.2f GFLOP/s%s | ETA %d:%02d\n",
           step + 1, t->r->steps.max_steps, loss, lr, norm, tok_s, t->p->flops_per_step / dt / 1e9, mfu,
           (int)eta / 60, (int)eta % 60);
    fflush(stdout);
}

/* ---- the cause of a failure ------------------------------------------------------------- */

/* The one cause record of this rank (crash.h: the first one wins), then the flight recorder. */
static void report(struct trainer *t, json_t *cause)
{
    if (!am_crash_report_begin() || t->log->fd < 0) {
        json_decref(cause);
        return;
    }
    json_object_set_new(cause, "rank", json_integer(t->s->info.rank));
    if (!json_object_get(cause, "time"))
        json_object_set_new(cause, "time", json_real(am_wall_time()));
    am_log_record(t->log, "cause", cause);
    am_crash_report_end();
}

/* The model's place in the step, into a cause record: "phase" and "layer" (a number, or null
 * with "part": "embedding" / "head"). */
static void add_where(json_t *o, const struct am_model_where *w)
{
    json_object_set_new(o, "phase", json_string(am_model_phase_name(w->phase)));
    json_object_set_new(o, "layer", w->layer >= 0 ? json_integer(w->layer) : json_null());
    const char *part = w->layer >= 0 ? "layer" : w->layer == AM_WHERE_EMBEDDING ? "embedding"
                       : w->layer == AM_WHERE_HEAD ? "head" : NULL;
    json_object_set_new(o, "part", part ? json_string(part) : json_null());
}

/* The device's fault hook (kernels.h): an allocation that failed is the rank's "oom" cause,
 * with what was asked, what the allocator holds and uses, the plan's estimate for the rank
 * (am-plan's for its pipeline rank) and where the step was; a CUDA error before the
 * backend aborts is "cuda" with the runtime's text; a kernel called wrongly is an "error"; a
 * note (another path taken, nothing failed) is a "note" record and a line on stderr. */
void am_train_device_fault(void *arg, const struct am_dev_fault *f)
{
    struct trainer *t = arg;
    json_t *o;
    if (f->kind == AM_DEV_FAULT_NOTE) { /* nothing failed: a line in the log and on stderr */
        am_log_record(t->log, "note", json_pack("{s:s,s:s,s:f}", "where", f->where ? f->where : "", "message",
                                                f->message ? f->message : "", "time", am_wall_time()));
        fprintf(stderr, "am-train: rank %d: note: %s: %s\n", t->s->info.rank, f->where ? f->where : "device",
                f->message ? f->message : "");
        return;
    }
    if (f->kind == AM_DEV_FAULT_OOM) {
        o = json_pack("{s:s,s:s,s:i,s:s}", "cause", "oom", "device", f->backend, "ordinal", f->ordinal, "where",
                      f->where ? f->where : "");
        json_object_set_new(o, "bytes_asked", json_integer((json_int_t)f->bytes_asked));
        json_object_set_new(o, "bytes_held", json_integer((json_int_t)f->bytes_held));
        json_object_set_new(o, "bytes_in_use", json_integer((json_int_t)f->bytes_in_use));
        json_object_set_new(o, "bytes_total", json_integer((json_int_t)f->bytes_total));
        json_object_set_new(o, "plan_bytes", json_integer((json_int_t)am_train_plan_bytes(t)));
    } else {
        o = json_pack("{s:s,s:s,s:i,s:s,s:s}", "cause", f->kind == AM_DEV_FAULT_ERROR ? "cuda" : "error", "device",
                      f->backend, "ordinal", f->ordinal, "where", f->where ? f->where : "", "error",
                      f->error ? f->error : "");
    }
    add_where(o, &t->model.where);
    json_object_set_new(o, "step", json_integer(am_crash_step()));
    char msg[1200];
    snprintf(msg, sizeof msg, "%s: %s", f->where ? f->where : "device", f->message ? f->message : "");
    json_object_set_new(o, "message", json_string(msg));
    report(t, o);
}

/* The rank fails with `message`. When its last communication call failed (any group: the
 * data-parallel all-reduce, or a tensor-parallel collective inside the model), the cause is
 * that call: "timeout" (the backend's wait expired) or "comm" (an error, naming the peer and
 * its host); otherwise "error" with the message. */
void am_train_report_error(struct trainer *t, const char *message)
{
    struct am_flight_view v;
    uint64_t newest = atomic_load(&t->flight.newest);
    if (!am_flight_get(&t->flight, newest, &v) ||
        (v.state != AM_FLIGHT_FAILED && v.state != AM_FLIGHT_TIMED_OUT && v.state != AM_FLIGHT_ABORTED)) {
        /* NCCL's communicators could not be made (ncclCommInitRankConfig's error in the message) */
        int nccl = t->comm_init_failed && t->dev.device == AM_DEV_CUDA;
        report(t, json_pack("{s:s,s:s}", "cause", nccl ? "nccl" : "error", "message", message));
        return;
    }
    int timed_out = v.state == AM_FLIGHT_TIMED_OUT;
    double waited = (v.ended > 0 ? v.ended : am_flight_now()) - (v.started > 0 ? v.started : v.enqueued);
    /* NCCL's own errors (ncclGetErrorString and ncclGetLastError's text in the message,
     * asynchronous ones from ncclCommGetAsyncError included) are "nccl" */
    int nccl = am_comm_ctx_backend(t->g.ctx) == AM_COMM_NCCL && v.state == AM_FLIGHT_FAILED;
    report(t, am_watchdog_comm_cause(&t->flight, &v, timed_out ? "timeout" : nccl ? "nccl" : "comm", "backend", waited,
                                     timed_out ? t->s->timeout_s : 0, t->s->info.rank, t->hosts, t->s->info.size,
                                     message));
}

/* The first parameter whose gradient is not finite, for the log (after a failure: a read of
 * the device per parameter). */
static const char *first_nonfinite(struct am_gsync *s, struct am_model *m)
{
    int sharded = am_gsync_first_nonfinite(s); /* sharded gradients: flagged as the backward went */
    if (sharded != -2)
        return sharded >= 0 ? m->params[sharded].name : "(none)";
    for (int i = 0; i < m->n_params; i++) {
        int32_t ok = 1;
        if (!m->params[i].g.data)
            continue; /* LoRA's frozen base */
        m->K->upload(m->dev, m->scalars.flag.data, &ok, sizeof(ok));
        m->K->all_finite(m->dev, &m->scalars.flag, &m->params[i].g);
        m->K->download(m->dev, &ok, m->scalars.flag.data, sizeof(ok));
        if (!ok)
            return m->params[i].name;
    }
    return "(none)";
}

/* A number, or "nan" / "inf" / "-inf" (JSON has no such numbers). */
static json_t *number(double v)
{
    if (isfinite(v))
        return json_real(v);
    return json_string(isnan(v) ? "nan" : v > 0 ? "inf" : "-inf");
}

/* A non-finite loss or gradient norm: origin "local" (this rank's own, before any reduction:
 * this rank is where it came from) or "reduced" (after the data-parallel all-reduce). */
int am_train_nonfinite(struct trainer *t, long step, double loss, double norm, const char *origin,
                       struct am_errors *err)
{
    const char *bad = first_nonfinite(&t->dp.sync, &t->model);
    json_t *o = json_pack("{s:s,s:i,s:s,s:s}", "cause", "nonfinite", "step", (int)step, "tensor", bad, "origin", origin);
    json_object_set_new(o, "loss", number(loss));
    json_object_set_new(o, "grad_norm", number(norm));
    report(t, o);
    return am_errors_fail(err, "step %ld: the %s loss or gradient norm is not finite (loss %g, grad norm %g; first non-finite "
                "gradient: %s)", step, origin, loss, norm, bad);
}
