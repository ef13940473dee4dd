/* Batched O_DIRECT page reads through io_uring, with raw syscalls.
 *
 * No liburing: the rings are set up with io_uring_setup(2) and mmap(2), reads
 * are queued as IORING_OP_READ entries and io_uring_enter(2) submits them and
 * waits for completions. Only <linux/io_uring.h> (linux-libc-dev) is needed.
 *
 * One ring belongs to one thread, the device's I/O worker, which reads a
 * batch with st_ring_read; every read's result lands in res[i]: bytes read,
 * or -errno.
 *
 * The I/O engine (st_eng_*, below st_ring_read) is that worker: a pthread
 * owns the ring, and a caller hands it a whole batch of reads
 * (region, page, buffer arrays, checked against the region table here) in
 * one call that copies them and returns at once, then waits for the batch
 * with the GIL released. No Python runs per batch on the I/O side (issue 14).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#endif
#ifndef IORING_SETUP_SINGLE_ISSUER
#define IORING_SETUP_SINGLE_ISSUER (1U << 12)
#endif
#ifndef IORING_SETUP_DEFER_TASKRUN
#define IORING_SETUP_DEFER_TASKRUN (1U << 13)
#endif

#define ST_MAX_FILES 64

struct st_ring {
    int fd;
    unsigned entries;       /* submission queue size = most reads in flight */
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    struct io_uring_sqe *sqes;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_map_bytes, cq_map_bytes, sqes_bytes;
    /* Registered files and buffer: the kernel skips a file lookup and a page
     * pinning per read. Optional; reads work without them. */
    int files[ST_MAX_FILES];
    unsigned nfiles;
    uint64_t buf_addr, buf_len;
};

static int sys_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

static int sys_register(int fd, unsigned opcode, const void *arg, unsigned nr_args) {
    return (int)syscall(__NR_io_uring_register, fd, opcode, arg, nr_args);
}

static int try_setup(unsigned entries, unsigned flags, struct io_uring_params *p) {
    memset(p, 0, sizeof(*p));
    p->flags = flags;
    return sys_setup(entries, p);
}

/* Create a ring of `entries` slots. Returns NULL and sets *err to errno on failure. */
struct st_ring *st_ring_create(unsigned entries, int *err) {
    struct io_uring_params p;
    /* Newest flags first: one issuer thread and completions run when we wait
     * cost the least CPU; older kernels reject them with EINVAL. */
    static const unsigned choices[] = {
        IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
        IORING_SETUP_COOP_TASKRUN,
        0,
    };
    int fd = -1;
    for (unsigned i = 0; i < sizeof(choices) / sizeof(choices[0]); i++) {
        fd = try_setup(entries, choices[i], &p);
        if (fd >= 0) break;
        if (errno != EINVAL) break;
    }
    if (fd < 0) { *err = errno; return NULL; }

    struct st_ring *r = calloc(1, sizeof(*r));
    if (!r) { *err = ENOMEM; close(fd); return NULL; }
    r->fd = fd;
    r->entries = p.sq_entries;
    r->sq_map_bytes = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_bytes = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_map_bytes > r->sq_map_bytes) r->sq_map_bytes = r->cq_map_bytes;
        r->cq_map_bytes = r->sq_map_bytes;
    }
    r->sq_map = mmap(NULL, r->sq_map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED) goto fail;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_map = r->sq_map;
    } else {
        r->cq_map = mmap(NULL, r->cq_map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                         IORING_OFF_CQ_RING);
        if (r->cq_map == MAP_FAILED) { r->cq_map = NULL; goto fail; }
    }
    r->sqes_bytes = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) { r->sqes = NULL; goto fail; }

    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return r;

fail:
    *err = errno;
    if (r->sqes) munmap(r->sqes, r->sqes_bytes);
    if (r->cq_map && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_map_bytes);
    if (r->sq_map && r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_map_bytes);
    close(fd);
    free(r);
    return NULL;
}


/* Register up to ST_MAX_FILES open files; reads of them then use IOSQE_FIXED_FILE. 0 or -errno. */
int st_ring_register_files(struct st_ring *r, const int32_t *fds, unsigned n) {
    if (n > ST_MAX_FILES) return -E2BIG;
    if (r->nfiles) {
        sys_register(r->fd, IORING_UNREGISTER_FILES, NULL, 0);
        r->nfiles = 0;
    }
    if (sys_register(r->fd, IORING_REGISTER_FILES, fds, n) < 0) return -errno;
    memcpy(r->files, fds, n * sizeof(int));
    r->nfiles = n;
    return 0;
}

/* Register [addr, addr + len) as fixed buffer 0 (replacing an earlier one); reads landing
 * inside it use IORING_OP_READ_FIXED. 0 or -errno (e.g. -ENOMEM over RLIMIT_MEMLOCK). */
int st_ring_register_buffer(struct st_ring *r, uint64_t addr, uint64_t len) {
    if (r->buf_len) {
        sys_register(r->fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
        r->buf_addr = r->buf_len = 0;
    }
    struct iovec iov = {(void *)(uintptr_t)addr, (size_t)len};
    if (sys_register(r->fd, IORING_REGISTER_BUFFERS, &iov, 1) < 0) return -errno;
    r->buf_addr = addr;
    r->buf_len = len;
    return 0;
}

void st_ring_destroy(struct st_ring *r) {
    if (!r) return;
    munmap(r->sqes, r->sqes_bytes);
    if (r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_map_bytes);
    munmap(r->sq_map, r->sq_map_bytes);
    close(r->fd);
    free(r);
}

/* Read n pages: read i is `len` bytes of fds[i] at offsets[i] into addrs[i].
 * At most `depth` reads are in flight (capped at the ring size). The caller
 * fills res with INT32_MIN. Returns 0 when every read completed (res[i] is the
 * byte count or -errno), or -errno when io_uring_enter itself failed: then
 * reads never submitted get that -errno in res, and the function returns only
 * after every submitted read was reaped, so no buffer is written afterwards.
 * Each io_uring_enter waits for `wait_batch` completions (fewer if fewer are
 * outstanding): fewer syscalls and wake-ups per page, while the queue stays
 * at least depth - wait_batch deep. */
int st_ring_read(struct st_ring *r, int n, const int32_t *fds, const int64_t *offsets, const uint64_t *addrs,
                 unsigned len, unsigned depth, unsigned wait_batch, int32_t *res) {
    if (depth == 0 || depth > r->entries) depth = r->entries;
    if (wait_batch == 0) wait_batch = 1;
    int next = 0, done = 0;
    unsigned inflight = 0, queued = 0; /* queued: in the SQ ring, not yet taken by the kernel */
    int fatal = 0, dead_enters = 0;
    unsigned mask = *r->sq_mask, cmask = *r->cq_mask;
    while (done < n) {
        unsigned tail = *r->sq_tail;
        unsigned added = 0;
        while (!fatal && next < n && inflight + queued + added < depth) {
            unsigned idx = tail & mask;
            struct io_uring_sqe *sqe = &r->sqes[idx];
            memset(sqe, 0, sizeof(*sqe));
            sqe->opcode = IORING_OP_READ;
            sqe->fd = fds[next];
            for (unsigned f = 0; f < r->nfiles; f++) {
                if (r->files[f] == fds[next]) {
                    sqe->fd = (int)f;
                    sqe->flags = IOSQE_FIXED_FILE;
                    break;
                }
            }
            if (addrs[next] >= r->buf_addr && addrs[next] + len <= r->buf_addr + r->buf_len) {
                sqe->opcode = IORING_OP_READ_FIXED;
                sqe->buf_index = 0;
            }
            sqe->off = (uint64_t)offsets[next];
            sqe->addr = addrs[next];
            sqe->len = len;
            sqe->user_data = (uint64_t)next;
            r->sq_array[idx] = idx;
            tail++;
            added++;
            next++;
        }
        if (added) __atomic_store_n(r->sq_tail, tail, __ATOMIC_RELEASE);
        queued += added;

        unsigned cq_ready = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE) - *r->cq_head;
        if (queued || (inflight && !cq_ready)) {
            unsigned want = 0;
            if (!cq_ready) {
                want = wait_batch;
                if (want > inflight + queued) want = inflight + queued;
            }
            /* After a failure nothing more is submitted; we only wait for what is in flight. */
            int ret = sys_enter(r->fd, fatal ? 0 : queued, want, IORING_ENTER_GETEVENTS);
            if (ret < 0) {
                int e = errno;
                /* Transient: nothing was taken; reap what is there and try again. */
                if (e == EINTR || e == EAGAIN || e == EBUSY) goto reap;
                /* The kernel refused work: stop queueing, drain what is in flight. */
                if (!fatal) fatal = -e;
                /* A ring that keeps refusing even waits is dead; its reads are cancelled when it closes. */
                if (++dead_enters > 1000) inflight = 0;
                if (inflight == 0) {
                    /* Entries still queued in the SQ ring were never taken; retract them. */
                    __atomic_store_n(r->sq_tail, *r->sq_tail - queued, __ATOMIC_RELEASE);
                    for (int i = 0; i < n; i++) if (res[i] == INT32_MIN) res[i] = -e;
                    return fatal;
                }
            } else {
                inflight += (unsigned)ret;
                queued -= (unsigned)ret;
            }
        }
    reap:;
        unsigned head = *r->cq_head;
        unsigned ctail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        while (head != ctail) {
            struct io_uring_cqe *cqe = &r->cqes[head & cmask];
            res[cqe->user_data] = cqe->res;
            head++;
            done++;
            inflight--;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
        if (fatal && inflight == 0) {
            __atomic_store_n(r->sq_tail, *r->sq_tail - queued, __ATOMIC_RELEASE);
            for (int i = 0; i < n; i++) if (res[i] == INT32_MIN) res[i] = fatal;
            return fatal;
        }
    }
    return 0;
}


/* ---- the I/O engine: a C worker thread per ring, batches handed over in one call ---------------- */

struct st_job {
    struct st_job *next;                 /* queue link */
    struct st_job *prev_all, *next_all;  /* every job not yet released (destroy frees them) */
    int n;
    int64_t *page;                       /* the batch as given (kept to name a failed read) */
    int32_t *region, *buffer;
    int32_t *fds;                        /* the batch as the ring takes it, made by the engine's thread */
    int64_t *offsets;
    uint64_t *addrs;
    int32_t *res;                        /* the seven arrays share one allocation */
    uint64_t pool_addr, pool_len;
    int done;
    int first_bad;                       /* index of the first read that is not a whole page, -1 none */
    int64_t submit_ns, end_ns, cpu_ns;
};

struct st_eng {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    struct st_job *head, *tail, *all;
    int stop, started, err, held;
    unsigned entries, depth, wait_batch, len;
    int nregions;
    int32_t *region_fd;
    int64_t *region_offset, *region_pages;
    int32_t files[ST_MAX_FILES];
    unsigned nfiles;
    int files_refused, buffers_refused;  /* registrations the kernel refused (reads then run unregistered) */
    uint64_t refused_addr;               /* a pool whose registration was refused: not asked again */
};

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *eng_main(void *arg) {
    struct st_eng *e = arg;
    int err = 0;
    /* A batch-class thread: CFS does not let a woken SCHED_BATCH thread preempt the running one, so the
     * thread that queued a batch (begin_step, inside st_eng_submit) is not descheduled by this worker
     * waking on its core; the worker runs on an idle core, or when the caller's slice ends. Without it,
     * on 2 cores, a third of begin_steps ran 300-600 us longer in wall time than in CPU time
     * (bench_step_wall.py, BENCHMARKS.md, issue 14). Best effort: a refusal leaves the thread as it was. */
    struct sched_param batch = {0};
    pthread_setschedparam(pthread_self(), SCHED_BATCH, &batch);
    pthread_setname_np(pthread_self(), "st-uring");
    /* Created here: with IORING_SETUP_SINGLE_ISSUER only this thread may submit or register. */
    struct st_ring *r = st_ring_create(e->entries, &err);
    if (r && e->nfiles && st_ring_register_files(r, e->files, e->nfiles) != 0) e->files_refused = 1;
    pthread_mutex_lock(&e->mu);
    e->started = 1;
    e->err = r ? 0 : err;
    pthread_cond_broadcast(&e->done);
    pthread_mutex_unlock(&e->mu);
    if (!r) return NULL;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while ((!e->head || e->held) && !e->stop) pthread_cond_wait(&e->work, &e->mu);
        struct st_job *j = e->head;
        if (!j) { pthread_mutex_unlock(&e->mu); break; }   /* stopping, and every queued batch is done */
        e->head = j->next;
        if (!e->head) e->tail = NULL;
        pthread_mutex_unlock(&e->mu);
        /* The caller keeps every pool that may be registered mapped (disk.py), so an address seen
         * again is the same pool, never a new mapping at a reused address. */
        if (j->pool_addr != r->buf_addr && j->pool_addr != e->refused_addr) {
            if (st_ring_register_buffer(r, j->pool_addr, j->pool_len) != 0) {
                e->refused_addr = j->pool_addr;
                e->buffers_refused++;
            }
        }
        int64_t c0 = thread_cpu_ns();
        for (int i = 0; i < j->n; i++) {
            int32_t g = j->region[i];
            j->fds[i] = e->region_fd[g];
            j->offsets[i] = e->region_offset[g] + j->page[i] * (int64_t)e->len;
            j->addrs[i] = j->pool_addr + (uint64_t)j->buffer[i] * e->len;
        }
        st_ring_read(r, j->n, j->fds, j->offsets, j->addrs, e->len, e->depth, e->wait_batch, j->res);
        int64_t c1 = thread_cpu_ns();
        int bad = -1;
        for (int i = 0; i < j->n; i++) if (j->res[i] != (int32_t)e->len) { bad = i; break; }
        pthread_mutex_lock(&e->mu);
        j->first_bad = bad;
        j->cpu_ns = c1 - c0;
        j->end_ns = mono_ns();
        j->done = 1;
        pthread_cond_broadcast(&e->done);
        pthread_mutex_unlock(&e->mu);
    }
    st_ring_destroy(r);
    return NULL;
}

/* Start an engine: a thread with a ring of `entries` slots reading `len` bytes per read, at most
 * `depth` in flight, each wait asking for `wait_batch` completions. Region i is `region_pages[i]`
 * pages at byte `region_offset[i]` of file `region_fd[i]`; `files` (n <= 64, else none) are
 * registered. NULL and *err = errno on failure. */
struct st_eng *st_eng_create(unsigned entries, unsigned depth, unsigned wait_batch, unsigned len, int nregions,
                             const int32_t *region_fd, const int64_t *region_offset, const int64_t *region_pages,
                             const int32_t *files, unsigned nfiles, int *err) {
    struct st_eng *e = calloc(1, sizeof(*e));
    if (!e) { *err = ENOMEM; return NULL; }
    e->entries = entries;
    e->depth = depth;
    e->wait_batch = wait_batch ? wait_batch : 1;
    e->len = len;
    e->nregions = nregions;
    e->region_fd = malloc(sizeof(int32_t) * (nregions ? nregions : 1));
    e->region_offset = malloc(sizeof(int64_t) * (nregions ? nregions : 1));
    e->region_pages = malloc(sizeof(int64_t) * (nregions ? nregions : 1));
    if (!e->region_fd || !e->region_offset || !e->region_pages) { *err = ENOMEM; goto fail; }
    memcpy(e->region_fd, region_fd, sizeof(int32_t) * nregions);
    memcpy(e->region_offset, region_offset, sizeof(int64_t) * nregions);
    memcpy(e->region_pages, region_pages, sizeof(int64_t) * nregions);
    if (nfiles <= ST_MAX_FILES) {
        memcpy(e->files, files, sizeof(int32_t) * nfiles);
        e->nfiles = nfiles;
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->done, &ca);
    pthread_condattr_destroy(&ca);
    int rc = pthread_create(&e->thread, NULL, eng_main, e);
    if (rc != 0) { *err = rc; goto fail; }
    pthread_mutex_lock(&e->mu);
    while (!e->started) pthread_cond_wait(&e->done, &e->mu);
    pthread_mutex_unlock(&e->mu);
    if (e->err) {
        *err = e->err;
        pthread_join(e->thread, NULL);
        goto fail;
    }
    return e;
fail:
    free(e->region_fd);
    free(e->region_offset);
    free(e->region_pages);
    free(e);
    return NULL;
}


/* Hold (1) or release (0) the queue: a held engine starts no batch, so a test can make a batch land late
 * for real. Stopping the engine releases it. */
void st_eng_hold(struct st_eng *e, int on) {
    pthread_mutex_lock(&e->mu);
    e->held = on;
    pthread_cond_signal(&e->work);
    pthread_mutex_unlock(&e->mu);
}

/* Queue reads i < n: page page[i] of region region[i] into buffer buffer[i] of the pool of
 * `pool_buffers` buffers of `len` bytes at `pool_addr`. The arrays are copied; returns the job,
 * or NULL with *err = i + 1 for the first read naming a region, page or buffer out of range
 * (nothing queued), -ENOMEM, or -ESHUTDOWN once the engine is stopping. */
struct st_job *st_eng_submit(struct st_eng *e, int n, const int32_t *region, const int64_t *page,
                             const int32_t *buffer, uint64_t pool_addr, int64_t pool_buffers, int64_t *err) {
    for (int i = 0; i < n; i++) {
        int32_t g = region[i];
        if (g < 0 || g >= e->nregions || page[i] < 0 || page[i] >= e->region_pages[g] || buffer[i] < 0 ||
            buffer[i] >= pool_buffers) {
            *err = (int64_t)i + 1;
            return NULL;
        }
    }
    size_t each = 3 * sizeof(int64_t) + 4 * sizeof(int32_t);
    struct st_job *j = malloc(sizeof(*j) + each * (size_t)(n ? n : 1));
    if (!j) { *err = -ENOMEM; return NULL; }
    int64_t *w = (int64_t *)(j + 1);   /* 8-byte arrays first, then the 4-byte ones */
    j->page = w;
    j->offsets = w + n;
    j->addrs = (uint64_t *)(w + 2 * n);
    j->region = (int32_t *)(w + 3 * n);
    j->buffer = j->region + n;
    j->fds = j->buffer + n;
    j->res = j->fds + n;
    memcpy(j->page, page, sizeof(int64_t) * n);
    memcpy(j->region, region, sizeof(int32_t) * n);
    memcpy(j->buffer, buffer, sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) j->res[i] = INT32_MIN;
    j->n = n;
    j->next = NULL;
    j->pool_addr = pool_addr;
    j->pool_len = (uint64_t)pool_buffers * e->len;
    j->done = 0;
    j->first_bad = -1;
    j->end_ns = j->cpu_ns = 0;
    j->submit_ns = mono_ns();
    pthread_mutex_lock(&e->mu);
    if (e->stop) {
        pthread_mutex_unlock(&e->mu);
        free(j);
        *err = -ESHUTDOWN;
        return NULL;
    }
    j->prev_all = NULL;
    j->next_all = e->all;
    if (e->all) e->all->prev_all = j;
    e->all = j;
    if (n == 0) {
        j->done = 1;
        j->end_ns = j->submit_ns;
    } else {
        if (e->tail) e->tail->next = j; else e->head = j;
        e->tail = j;
        pthread_cond_signal(&e->work);
    }
    pthread_mutex_unlock(&e->mu);
    *err = 0;
    return j;
}

/* Block until job j is done, at most timeout_ns (< 0: no limit). 0 done, ETIMEDOUT not yet.
 * On done, info = [first bad read or -1, submit_ns, end_ns, cpu_ns, buffer registrations refused,
 * file registration refused (0/1)]. */
int st_eng_wait(struct st_eng *e, struct st_job *j, int64_t timeout_ns, int64_t *info) {
    pthread_mutex_lock(&e->mu);
    if (!j->done && timeout_ns != 0) {
        if (timeout_ns < 0) {
            while (!j->done) pthread_cond_wait(&e->done, &e->mu);
        } else {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            int64_t at = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec + timeout_ns;
            ts.tv_sec = at / 1000000000;
            ts.tv_nsec = at % 1000000000;
            while (!j->done && pthread_cond_timedwait(&e->done, &e->mu, &ts) != ETIMEDOUT) {}
        }
    }
    int done = j->done;
    if (done) {
        info[0] = j->first_bad;
        info[1] = j->submit_ns;
        info[2] = j->end_ns;
        info[3] = j->cpu_ns;
        info[4] = e->buffers_refused;
        info[5] = e->files_refused;
    }
    pthread_mutex_unlock(&e->mu);
    return done ? 0 : ETIMEDOUT;
}

/* Copy a job's reads as submitted into region[n], page[n], buffer[n], and, once it is done, its
 * results (bytes read or -errno per read) into res[n]. */
void st_eng_reads(struct st_job *j, int32_t *region, int64_t *page, int32_t *buffer, int32_t *res) {
    memcpy(region, j->region, sizeof(int32_t) * j->n);
    memcpy(page, j->page, sizeof(int64_t) * j->n);
    memcpy(buffer, j->buffer, sizeof(int32_t) * j->n);
    memcpy(res, j->res, sizeof(int32_t) * j->n);
}

/* Forget a done job (its memory is freed). */
void st_eng_release(struct st_eng *e, struct st_job *j) {
    pthread_mutex_lock(&e->mu);
    if (j->prev_all) j->prev_all->next_all = j->next_all; else e->all = j->next_all;
    if (j->next_all) j->next_all->prev_all = j->prev_all;
    pthread_mutex_unlock(&e->mu);
    free(j);
}

/* Finish every queued batch, stop the thread, free the ring and every job not released. */
void st_eng_destroy(struct st_eng *e) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_signal(&e->work);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    while (e->all) {
        struct st_job *j = e->all;
        e->all = j->next_all;
        free(j);
    }
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->work);
    pthread_cond_destroy(&e->done);
    free(e->region_fd);
    free(e->region_offset);
    free(e->region_pages);
    free(e);
}
