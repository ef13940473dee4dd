/* The C device queue's boundary: every entry point Python or compiled code calls, and the one record that
 * crosses it (what st_eng_wait reports of a done job).
 *
 * This header is the single statement of that boundary on the C side; uring_read.c includes it, so the
 * compiler refuses a definition that drifts from it. On the Python side `slacktier.tables.native` mirrors it (ctypes
 * prototypes, the record's structured layout, and the submit signature compiled code calls by address), and
 * tests/test_native_abi.py checks the mirror against this file. Change both together.
 *
 * Handles are opaque: Python holds them as integers.
 */
#ifndef SLACKTIER_ST_IO_H
#define SLACKTIER_ST_IO_H

#include <stdint.h>

struct st_ring;
struct st_eng;
struct st_client;
struct st_job;

/* What st_eng_wait reports of a done job. */
struct st_wait_info {
    int64_t first_bad;          /* index of the first read that failed, or -1 */
    int64_t submit_ns;          /* CLOCK_MONOTONIC when the batch was submitted */
    int64_t end_ns;             /* when its last read landed */
    int64_t cpu_ns;             /* worker CPU time spent on its reads */
    int64_t buffers_refused;    /* pool registrations the kernel refused so far (the queue's count) */
    int64_t files_refused;      /* 1 once the kernel refused to register the files */
    int64_t first_ns;           /* when its first read was handed to the kernel */
};

/* One io_uring ring, for a probe that io_uring works here. */
struct st_ring *st_ring_create(unsigned entries, int *err);
void st_ring_destroy(struct st_ring *r);

/* The device queue: worker threads owning one ring each, taking reads in (priority, arrival) order.
 * With entries 0 the workers own no ring and read `depth` reads at a time each with pread, where io_uring
 * cannot be set up (a container's seccomp profile, a kernel that disables it) or is not needed.
 * A region attached with a negative fd is host memory whose page 0 sits at the address given as its
 * offset: the worker copies its pages into the pool itself (the DRAM tier), in the same order. */
struct st_eng *st_eng_create(unsigned entries, unsigned depth, unsigned wait_batch, unsigned len, int nthreads,
                             int *err);
struct st_client *st_eng_attach(struct st_eng *e, int nregions, const int32_t *region_fd,
                                const int64_t *region_offset, const int64_t *region_pages,
                                const int32_t *region_prio, const int32_t *region_ioprio, int *err);
int st_eng_detach(struct st_eng *e, struct st_client *c);
void st_eng_strict(struct st_eng *e, int on);
int st_eng_batch(struct st_eng *e, int on);
void st_eng_hold(struct st_eng *e, int on);
void st_eng_defer(struct st_eng *e, int on);

/* The submit compiled code calls by address, per layer: a C engine client's (this one) or any lane of the
 * same signature and error word. Returns the job, or NULL with *err = i + 1 for read i out of range
 * (nothing queued), or a negative errno. */
struct st_job *st_eng_submit(struct st_client *c, int n, const int32_t *region, const int64_t *page,
                             const int32_t *buffer, uint64_t pool_addr, int64_t pool_buffers, int64_t *err);
typedef struct st_job *(*st_submit_fn)(struct st_client *c, int n, const int32_t *region, const int64_t *page,
                                       const int32_t *buffer, uint64_t pool_addr, int64_t pool_buffers,
                                       int64_t *err);

int st_eng_cancel(struct st_eng *e, struct st_job *j);
int st_eng_wait(struct st_eng *e, struct st_job *j, int64_t timeout_ns, struct st_wait_info *info);
void st_eng_reads(struct st_job *j, int32_t *region, int64_t *page, int32_t *buffer, int32_t *res);
void st_eng_release(struct st_eng *e, struct st_job *j);
int st_eng_registered(struct st_eng *e, uint64_t *out);
int st_eng_trace(struct st_eng *e, int64_t cap);
int64_t st_eng_trace_read(struct st_eng *e, int32_t *client, int32_t *region, int64_t *page, int64_t cap);
void st_eng_destroy(struct st_eng *e);

#endif
