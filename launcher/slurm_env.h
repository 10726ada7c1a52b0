/* slurm_env.h - what a Slurm task learns from its environment when the step has no PMIx
 * (`srun --mpi=none am-launch`, or MpiDefault=none): its place in the step, the first node
 * of the step (which serves the bootstrap over TCP) and the port it serves at.
 *
 * Read: SLURM_PROCID, SLURM_NTASKS (or SLURM_STEP_NUM_TASKS), SLURM_LOCALID, SLURM_NODEID,
 * SLURM_STEP_NUM_NODES (or SLURM_NNODES), SLURM_STEP_TASKS_PER_NODE (or
 * SLURM_TASKS_PER_NODE), SLURM_STEP_NODELIST (or SLURM_NODELIST), SLURM_JOB_ID,
 * SLURM_STEP_ID (or SLURM_STEPID), SLURMD_NODENAME. Overrides: AM_BOOT_HOST (the address the
 * other nodes reach the first node at, when its Slurm name does not resolve to it) and
 * AM_BOOT_PORT (am-launch --boot-port sets it).
 * Errors name the variable, its value and what was expected.
 */
#ifndef AM_SLURM_ENV_H
#define AM_SLURM_ENV_H

#include <stddef.h>

#include "bootstrap.h"

/* The derived port: AM_BOOT_PORT_BASE + (job * 64 + step) mod AM_BOOT_PORT_SPAN, below the
 * kernel's ephemeral range (32768-60999): the steps 0..63 of a job get distinct ports, and so
 * do the steps of jobs whose ids are less than AM_BOOT_PORT_SPAN / 64 apart. */
#define AM_BOOT_PORT_BASE 20000
#define AM_BOOT_PORT_SPAN 12288
int am_boot_port_derive(unsigned long long job, unsigned long long step);

/* The first host of a Slurm hostlist ("n[1-4],gpu07", "rack[2-3]-n[08-10]": every bracket
 * group's first number, zero padding kept) into out. 0, or -1 with a message naming list. */
int am_hostlist_first(const char *list, char *out, size_t out_len, char *err, size_t err_len);
/* How many hosts the hostlist names (the product of its bracket groups' sizes, summed over
 * its comma-separated names); -1 with a message when it is malformed. */
long am_hostlist_count(const char *list, char *err, size_t err_len);

/* Slurm's tasks per node ("2(x3),1": 2 tasks on each of nodes 0-2, 1 on node 3): the count of
 * node `node`; -1 with a message when malformed or node is past its end. */
int am_tasks_on_node(const char *spec, int node, char *err, size_t err_len);

/* munged's socket as Slurm is told it: the socket= option of AuthInfo in slurm.conf's text
 * ("AuthInfo=socket=/run/munge2/munge.sock,ttl=60"; keys case-insensitive, # comments).
 * 1 with the path in out, 0 when the text names none. */
int am_slurm_auth_socket_parse(const char *text, char *out, size_t out_len);
/* The same from the file $SLURM_CONF (slurmd exports it to the tasks; configless clusters
 * point it at slurmd's copy), else /etc/slurm/slurm.conf: 0 when neither names one. */
int am_slurm_auth_socket(char *out, size_t out_len);

/* This task in the step. */
struct am_slurm_step {
    struct am_boot_info info;    /* rank, size, local, node, host, job id "JOB.STEP" */
    unsigned long long job, step;
    char first_host[256];        /* the first node of SLURM_STEP_NODELIST */
    char server_host[256];       /* where the others connect: AM_BOOT_HOST, else first_host */
    int port;                    /* AM_BOOT_PORT, else am_boot_port_derive(job, step) */
    int serves;                  /* this task runs the boot server: node 0, local rank 0 */
};

/* 0, or -1 with a message naming the variable: a Slurm step's environment is incomplete or
 * inconsistent. getenv_fn reads the environment (getenv; the unit test passes its own). */
int am_slurm_step_read(struct am_slurm_step *s, const char *(*getenv_fn)(const char *name), char *err,
                       size_t err_len);

#endif
