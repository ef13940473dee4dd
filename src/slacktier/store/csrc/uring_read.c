/* Batched O_DIRECT page reads through io_uring, with raw syscalls.
 *
 * No liburing: the rings are set up with io_uring_setup(2) and mmap(2), reads
 * are queued as IORING_OP_READ entries and io_uring_enter(2) submits them and
 * waits for completions. Only <linux/io_uring.h> (linux-libc-dev) is needed.
 *
 * The device queue (st_eng_*) serves one physical device for every table of
 * the process that reads from it. Each table attaches its regions
 * as a client; a caller hands a whole batch of one client's reads (region,
 * page, buffer arrays, checked against the client's region table here) in one
 * call that copies them and returns at once, then waits for the batch with
 * the GIL released. No Python runs per batch on the I/O side.
 *
 * Admission order is the point: queued batches are kept in (priority,
 * arrival) order, a batch's priority being the lowest of its regions' (the
 * layer's window rank: layer 1 before layer 14). Each worker thread owns one
 * ring and keeps it `depth` deep, taking reads from the head of that order,
 * so a later layer's reads only fill the depth an earlier layer's leave, and a
 * short-window batch that arrives later still goes ahead of every read of a
 * longer-window batch not yet handed to the kernel.
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

#include "st_io.h"

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

/* ---- the device queue: worker threads with a ring each, batches admitted in priority order ---------- */

#define ST_MAX_THREADS 64

struct st_eng;

/* One table's regions on this device (a DiskSource attaches one client per device it reads from). */
struct st_client {
    struct st_eng *eng;
    struct st_client *prev, *next;
    int id;                              /* attach order, for the admission trace */
    int nregions;
    int live;                            /* jobs not yet released: detach refuses while any is */
    int32_t *region_fd;                  /* < 0: the region is host memory, at address region_offset */
    int host_only;                       /* every region is host memory: its pools are never registered */
    int64_t *region_offset, *region_pages;
    int32_t *region_prio;                /* admission order of its reads: lower first */
    int32_t *region_ioprio;              /* the sqe's ioprio for its reads (0: the thread's own) */
};

struct st_job {
    struct st_job *next;                 /* admission queue link, ordered by (prio, seq) */
    struct st_job *prev_all, *next_all;  /* every job not yet released (destroy frees them) */
    struct st_client *client;
    int n, admitted, landed;
    int prio;
    uint64_t seq;
    int64_t *page;                       /* the batch as given (kept to name a failed read) */
    int32_t *region, *buffer;
    int32_t *res;                        /* bytes read or -errno per read; the four arrays share one allocation */
    uint64_t pool_addr, pool_len;
    int done;
    int first_bad;                       /* index of the first read that is not a whole page, -1 none */
    int64_t submit_ns, first_ns, end_ns, cpu_ns;
};

struct st_worker {
    struct st_eng *e;
    pthread_t thread;
    int started, err;
    uint64_t registered_addr;            /* the pool its ring has registered (read under e->mu) */
};

struct st_eng {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    struct st_job *queue;                /* jobs with reads not yet admitted, in (prio, seq) order */
    struct st_job *all;
    struct st_client *clients;
    int next_client;
    int stop, held, nthreads;
    int deferred;                        /* open st_eng_defer calls: admit nothing until they close */
    int strict;                          /* admit a batch only once no earlier-priority read is in flight */
    unsigned entries, depth, wait_batch, len;
    uint64_t seq;
    int32_t files[ST_MAX_FILES];         /* attached clients' files, registered with each ring when idle */
    int file_refs[ST_MAX_FILES];
    unsigned nfiles, files_gen;
    int files_refused, buffers_refused;  /* registrations the kernel refused (reads then run unregistered) */
    int64_t trace_cap, trace_len;        /* admission trace (tests, benchmarks): client, region, page */
    int32_t *trace_client, *trace_region;
    int64_t *trace_page;
    struct st_worker workers[ST_MAX_THREADS];
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

/* A job whose every read landed (e->mu held). */
static void finish_job(struct st_job *j) {
    int bad = -1;
    for (int i = 0; i < j->n; i++) if (j->res[i] != (int32_t)j->client->eng->len) { bad = i; break; }
    j->first_bad = bad;
    j->end_ns = mono_ns();
    j->done = 1;
}

/* Take up to `room` reads from the head of the queue into `slots` (e->mu held); how many. */
/* Strict order: the lowest priority value among jobs with reads in flight (INT32_MAX: none) (e->mu held). */
static int inflight_prio(struct st_eng *e) {
    int p = INT32_MAX;
    for (struct st_job *j = e->all; j; j = j->next_all)
        if (j->admitted > j->landed && j->prio < p) p = j->prio;
    return p;
}

/* Wake the workers for newly queued reads (e->mu held). A ring's workers are few and all of them look. A
 * queue without rings has many workers reading one chunk each: the caller wakes one, and each worker that
 * takes a chunk with more left wakes two more (spread_wake), so the wake-ups fan out on the workers' cores
 * instead of costing the caller (begin_step) a system call per worker. Busy workers go on to the next chunk
 * without a wake-up. */
static void wake_workers(struct st_eng *e) {
    if (e->entries) pthread_cond_broadcast(&e->work);
    else pthread_cond_signal(&e->work);
}

/* A ringless worker took a chunk: if reads are left to take, two more workers look (e->mu held). */
static void spread_wake(struct st_eng *e) {
    if (e->queue && !e->held && !e->deferred) {
        pthread_cond_signal(&e->work);
        pthread_cond_signal(&e->work);
    }
}

static unsigned admit(struct st_eng *e, struct st_job **slot_job, int *slot_read, unsigned *free_slots,
                      unsigned *nfree, unsigned room, unsigned *taken) {
    unsigned k = 0;
    while (room && e->queue && !e->held && !e->deferred) {
        struct st_job *j = e->queue;
        if (e->strict && j->admitted == 0 && j->prio > inflight_prio(e)) break;
        if (j->admitted == 0) j->first_ns = mono_ns();
        while (room && j->admitted < j->n) {
            unsigned s = free_slots[--*nfree];
            slot_job[s] = j;
            slot_read[s] = j->admitted;
            if (e->trace_len < e->trace_cap) {
                e->trace_client[e->trace_len] = j->client->id;
                e->trace_region[e->trace_len] = j->region[j->admitted];
                e->trace_page[e->trace_len] = j->page[j->admitted];
                e->trace_len++;
            }
            j->admitted++;
            taken[k++] = s;
            room--;
        }
        if (j->admitted == j->n) e->queue = j->next;
    }
    return k;
}

/* Read i of job j: returns its file and sets the pool address it lands at and its byte offset in the file;
 * a host-memory read (fd < 0, its page at address *off) is copied here and has landed when this returns. */
static int take_read(const struct st_eng *e, struct st_job *j, int i, uint64_t *addr, int64_t *off) {
    const struct st_client *c = j->client;
    int32_t g = j->region[i];
    *addr = j->pool_addr + (uint64_t)j->buffer[i] * e->len;
    *off = c->region_offset[g] + j->page[i] * (int64_t)e->len;
    if (c->region_fd[g] < 0) {
        memcpy((void *)(uintptr_t)*addr, (const void *)(uintptr_t)*off, e->len);
        j->res[i] = (int32_t)e->len;
    }
    return c->region_fd[g];
}

/* A worker of a queue without rings (created with entries 0, where io_uring cannot be set up): it takes up
 * to `depth` reads at a time, in the queue's order, and reads them one after another with pread (or copies
 * host memory), with no lock held; the queue's reads in flight are its workers' chunks. The same admission,
 * jobs and waits as a ring's worker, so compiled code submits to it the same way. */
static void *sync_main(struct st_worker *w) {
    struct st_eng *e = w->e;
    unsigned chunk = e->depth ? e->depth : 1;
    struct st_job **slot_job = calloc(chunk, sizeof(*slot_job));
    int *slot_read = calloc(chunk, sizeof(*slot_read));
    unsigned *free_slots = calloc(chunk, sizeof(*free_slots)), *taken = calloc(chunk, sizeof(*taken));
    int ok = slot_job && slot_read && free_slots && taken;
    pthread_mutex_lock(&e->mu);
    w->started = 1;
    w->err = ok ? 0 : ENOMEM;
    pthread_cond_broadcast(&e->done);
    pthread_mutex_unlock(&e->mu);
    for (;;) {
        if (!ok) break;
        pthread_mutex_lock(&e->mu);
        while (!e->stop && (!e->queue || e->held || e->deferred
                            || (e->strict && e->queue->admitted == 0 && e->queue->prio > inflight_prio(e))))
            pthread_cond_wait(&e->work, &e->mu);
        if (!e->queue) { pthread_mutex_unlock(&e->mu); break; }   /* stopping, and nothing left to read */
        unsigned nfree = chunk;
        for (unsigned q = 0; q < chunk; q++) free_slots[q] = chunk - 1 - q;
        unsigned k = admit(e, slot_job, slot_read, free_slots, &nfree, chunk, taken);
        if (k) spread_wake(e);
        pthread_mutex_unlock(&e->mu);
        if (!k) continue;
        int64_t c0 = thread_cpu_ns();
        for (unsigned q = 0; q < k; q++) {
            struct st_job *j = slot_job[taken[q]];
            int i = slot_read[taken[q]];
            uint64_t addr;
            int64_t off;
            int fd = take_read(e, j, i, &addr, &off);
            if (fd < 0) continue;
            ssize_t got;
            do got = pread(fd, (void *)(uintptr_t)addr, e->len, off); while (got < 0 && errno == EINTR);
            j->res[i] = got < 0 ? -errno : (int32_t)got;
        }
        int64_t each = (thread_cpu_ns() - c0) / k;
        int finished = 0;
        pthread_mutex_lock(&e->mu);
        for (unsigned q = 0; q < k; q++) {
            struct st_job *j = slot_job[taken[q]];
            j->cpu_ns += each;
            if (++j->landed == j->n) { finish_job(j); finished = 1; }
        }
        if (finished) {
            pthread_cond_broadcast(&e->done);
            if (e->strict) spread_wake(e);   /* a blocked batch may go now: this worker looks, and two more */
        }
        pthread_mutex_unlock(&e->mu);
    }
    free(slot_job); free(slot_read); free(free_slots); free(taken);
    return NULL;
}

static void *eng_main(void *arg) {
    struct st_worker *w = arg;
    struct st_eng *e = w->e;
    int err = 0;
    /* A batch-class thread: CFS does not let a woken SCHED_BATCH thread preempt the running one, so the
     * thread that queued a batch (begin_step, inside st_eng_submit) is not descheduled by this worker
     * waking on its core; the worker runs on an idle core, or when the caller's slice ends. Without it,
     * on a machine with few cores, many begin_steps ran far longer in wall time than in CPU time.
     * Best effort: a refusal leaves the thread as it was. A queue of host-memory copies turns it off
     * (st_eng_batch). */
    struct sched_param batch = {0};
    pthread_setschedparam(pthread_self(), SCHED_BATCH, &batch);
    if (!e->entries) {
        pthread_setname_np(pthread_self(), "st-pread");
        return sync_main(w);
    }
    pthread_setname_np(pthread_self(), "st-uring");
    /* Created here: with IORING_SETUP_SINGLE_ISSUER only this thread may submit or register. */
    struct st_ring *r = st_ring_create(e->entries, &err);
    unsigned depth = e->depth;
    if (r && (depth == 0 || depth > r->entries)) depth = r->entries;
    struct st_job **slot_job = NULL;
    int *slot_read = NULL;
    unsigned *free_slots = NULL, *taken = NULL, *copied = NULL;
    if (r) {
        slot_job = calloc(depth, sizeof(*slot_job));
        slot_read = calloc(depth, sizeof(*slot_read));
        free_slots = calloc(depth, sizeof(*free_slots));
        taken = calloc(depth, sizeof(*taken));
        copied = calloc(depth, sizeof(*copied));
        if (!slot_job || !slot_read || !free_slots || !taken || !copied) {
            err = ENOMEM; st_ring_destroy(r); r = NULL;
        }
    }
    pthread_mutex_lock(&e->mu);
    w->started = 1;
    w->err = r ? 0 : err;
    pthread_cond_broadcast(&e->done);
    pthread_mutex_unlock(&e->mu);
    if (!r) {
        free(slot_job); free(slot_read); free(free_slots); free(taken); free(copied);
        return NULL;
    }
    unsigned nfree = depth;
    for (unsigned s = 0; s < depth; s++) free_slots[s] = depth - 1 - s;
    unsigned inflight = 0, queued = 0;   /* queued: in the SQ ring, not yet taken by the kernel */
    unsigned files_gen = (unsigned)-1;   /* the attached set this ring has registered; -1: none yet */
    int dead_enters = 0;
    uint64_t refused_addr = 0;           /* a pool whose registration was refused: not asked again */
    unsigned mask = *r->sq_mask, cmask = *r->cq_mask;
    int32_t files[ST_MAX_FILES];
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->stop && inflight + queued == 0 && files_gen == e->files_gen
               && (!e->queue || e->held || e->deferred || (e->strict && e->queue->admitted == 0
                                            && e->queue->prio > inflight_prio(e))))
            pthread_cond_wait(&e->work, &e->mu);
        if (inflight + queued == 0 && e->stop && !e->queue) { pthread_mutex_unlock(&e->mu); break; }
        /* Registrations change only while the ring is idle: no read of ours is then in flight. */
        if (inflight + queued == 0 && files_gen != e->files_gen) {
            unsigned n = e->nfiles;
            memcpy(files, e->files, n * sizeof(int32_t));
            files_gen = e->files_gen;
            if (n) {
                if (st_ring_register_files(r, files, n) != 0) { e->files_refused = 1; r->nfiles = 0; }
            } else if (r->nfiles) {
                sys_register(r->fd, IORING_UNREGISTER_FILES, NULL, 0);
                r->nfiles = 0;
            }
        }
        if (inflight + queued == 0 && e->queue && !e->held && !e->deferred) {
            /* The caller keeps every pool that may be registered mapped (disk.py, st_eng_registered), so an
             * address seen again is the same pool, never a new mapping at a reused address. */
            struct st_job *h = e->queue;
            if (!h->client->host_only && h->pool_addr != r->buf_addr && h->pool_addr != refused_addr
                && h->pool_len) {
                if (st_ring_register_buffer(r, h->pool_addr, h->pool_len) != 0) {
                    refused_addr = h->pool_addr;
                    e->buffers_refused++;
                }
                w->registered_addr = r->buf_addr;
            }
        }
        /* A file set that changed while reads were in flight is not ours yet: no fixed file until it is. */
        int fixed_files = files_gen == e->files_gen;
        unsigned k = admit(e, slot_job, slot_read, free_slots, &nfree, depth - inflight - queued, taken);
        pthread_mutex_unlock(&e->mu);

        int64_t c0 = thread_cpu_ns();
        unsigned tail = *r->sq_tail, ncopied = 0;
        for (unsigned q = 0; q < k; q++) {
            unsigned s = taken[q];
            struct st_job *j = slot_job[s];
            int i = slot_read[s];
            uint64_t addr;
            int64_t off;
            int fd = take_read(e, j, i, &addr, &off);
            if (fd < 0) {   /* host memory: copied, landed, no ring entry */
                copied[ncopied++] = s;
                continue;
            }
            struct io_uring_sqe *sqe = &r->sqes[tail & mask];
            memset(sqe, 0, sizeof(*sqe));
            sqe->opcode = IORING_OP_READ;
            sqe->fd = fd;
            if (fixed_files) {
                for (unsigned f = 0; f < r->nfiles; f++) {
                    if (r->files[f] == fd) { sqe->fd = (int)f; sqe->flags = IOSQE_FIXED_FILE; break; }
                }
            }
            if (r->buf_len && addr >= r->buf_addr && addr + e->len <= r->buf_addr + r->buf_len) {
                sqe->opcode = IORING_OP_READ_FIXED;
                sqe->buf_index = 0;
            }
            sqe->ioprio = (uint16_t)j->client->region_ioprio[j->region[i]];
            sqe->off = (uint64_t)off;
            sqe->addr = addr;
            sqe->len = e->len;
            sqe->user_data = s;
            r->sq_array[tail & mask] = tail & mask;
            tail++;
        }
        if (k > ncopied) __atomic_store_n(r->sq_tail, tail, __ATOMIC_RELEASE);
        queued += k - ncopied;

        unsigned nreaped = 0;
        for (unsigned q = 0; q < ncopied; q++) taken[nreaped++] = copied[q];
        int fatal = 0;
        unsigned cq_ready = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE) - *r->cq_head;
        if (queued || (inflight && !cq_ready)) {
            unsigned want = 0;
            if (!cq_ready) {
                want = e->wait_batch;
                if (want > inflight + queued) want = inflight + queued;
            }
            int ret = sys_enter(r->fd, queued, want, IORING_ENTER_GETEVENTS);
            if (ret < 0) {
                int en = errno;
                if (en != EINTR && en != EAGAIN && en != EBUSY) {
                    fatal = -en;
                    dead_enters++;
                }
            } else {
                inflight += (unsigned)ret;
                queued -= (unsigned)ret;
                dead_enters = 0;
            }
        }
        /* Reap: each completion lands one read of its job. */
        unsigned head = *r->cq_head;
        unsigned ctail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        while (head != ctail) {
            struct io_uring_cqe *cqe = &r->cqes[head & cmask];
            unsigned s = (unsigned)cqe->user_data;
            slot_job[s]->res[slot_read[s]] = cqe->res;
            taken[nreaped++] = s;
            head++;
            inflight--;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
        if (fatal && queued) {
            /* The kernel refused the entries still in the SQ ring: take them back, failing their reads. */
            unsigned t = *r->sq_tail;
            for (unsigned q = 0; q < queued; q++) {
                unsigned s = (unsigned)r->sqes[(t - 1 - q) & mask].user_data;
                slot_job[s]->res[slot_read[s]] = fatal;
                taken[nreaped++] = s;
            }
            __atomic_store_n(r->sq_tail, t - queued, __ATOMIC_RELEASE);
            queued = 0;
        }
        if (fatal && dead_enters > 1000 && inflight) {
            /* A ring that keeps refusing even waits is dead; its reads are cancelled when it closes. */
            for (unsigned s = 0; s < depth; s++) {
                int used = 1;
                for (unsigned f = 0; f < nfree; f++) if (free_slots[f] == s) { used = 0; break; }
                int listed = 0;
                for (unsigned q = 0; q < nreaped; q++) if (taken[q] == s) { listed = 1; break; }
                if (used && !listed) { slot_job[s]->res[slot_read[s]] = fatal; taken[nreaped++] = s; }
            }
            inflight = 0;
        }
        int64_t spent = thread_cpu_ns() - c0;
        if (nreaped) {
            int64_t each = spent / nreaped;
            int finished = 0;
            pthread_mutex_lock(&e->mu);
            for (unsigned q = 0; q < nreaped; q++) {
                unsigned s = taken[q];
                struct st_job *j = slot_job[s];
                j->cpu_ns += each;
                if (++j->landed == j->n) { finish_job(j); finished = 1; }
                slot_job[s] = NULL;
                free_slots[nfree++] = s;
            }
            if (finished) {
                pthread_cond_broadcast(&e->done);
                if (e->strict) pthread_cond_broadcast(&e->work);   /* a blocked batch may go now */
            }
            pthread_mutex_unlock(&e->mu);
        }
    }
    free(slot_job); free(slot_read); free(free_slots); free(taken); free(copied);
    st_ring_destroy(r);
    return NULL;
}

/* Start a device queue: `nthreads` workers, each owning a ring of `entries` slots, reading `len` bytes per
 * read, at most `depth` in flight per ring, each wait asking for `wait_batch` completions. With `entries` 0
 * the workers own no ring: each reads `depth` reads at a time with pread (sync_main). NULL and *err = errno
 * on failure. */
struct st_eng *st_eng_create(unsigned entries, unsigned depth, unsigned wait_batch, unsigned len, int nthreads,
                             int *err) {
    if (nthreads < 1 || nthreads > ST_MAX_THREADS) { *err = EINVAL; return NULL; }
    struct st_eng *e = calloc(1, sizeof(*e));
    if (!e) { *err = ENOMEM; return NULL; }
    e->entries = entries;
    e->depth = depth;
    e->wait_batch = wait_batch ? wait_batch : 1;
    e->len = len;
    e->files_gen = 0;
    /* Strict by measurement: in strict order layer 1's pages beside layer 14's read in their time alone,
     * while letting layer 14's reads fill the depth layer 1's tail leaves slowed layer 1, and layer 14
     * finished no later either way. */
    e->strict = 1;
    pthread_mutex_init(&e->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->done, &ca);
    pthread_condattr_destroy(&ca);
    int failed = 0;
    for (int t = 0; t < nthreads; t++) {
        struct st_worker *w = &e->workers[t];
        w->e = e;
        int rc = pthread_create(&w->thread, NULL, eng_main, w);
        if (rc != 0) { failed = rc; break; }
        e->nthreads++;
        pthread_mutex_lock(&e->mu);
        while (!w->started) pthread_cond_wait(&e->done, &e->mu);
        pthread_mutex_unlock(&e->mu);
        if (w->err) { failed = w->err; pthread_join(w->thread, NULL); e->nthreads--; break; }
    }
    if (failed) {
        pthread_mutex_lock(&e->mu);
        e->stop = 1;
        pthread_cond_broadcast(&e->work);
        pthread_mutex_unlock(&e->mu);
        for (int t = 0; t < e->nthreads; t++) pthread_join(e->workers[t].thread, NULL);
        pthread_mutex_destroy(&e->mu);
        pthread_cond_destroy(&e->work);
        pthread_cond_destroy(&e->done);
        free(e);
        *err = failed;
        return NULL;
    }
    return e;
}

/* Attach a client: region i is region_pages[i] pages of `len` bytes at byte region_offset[i] of file
 * region_fd[i], admitted in region_prio[i] order, read with sqe ioprio region_ioprio[i]. Its files join
 * the set each ring registers when idle (the first ST_MAX_FILES distinct files of all clients). A region
 * with region_fd[i] < 0 is host memory at address region_offset[i]: the worker copies its pages itself.
 * NULL and *err = errno on failure. */
struct st_client *st_eng_attach(struct st_eng *e, int nregions, const int32_t *region_fd,
                                const int64_t *region_offset, const int64_t *region_pages,
                                const int32_t *region_prio, const int32_t *region_ioprio, int *err) {
    struct st_client *c = calloc(1, sizeof(*c));
    size_t n = nregions ? (size_t)nregions : 1;
    if (c) {
        c->region_fd = malloc(sizeof(int32_t) * n);
        c->region_offset = malloc(sizeof(int64_t) * n);
        c->region_pages = malloc(sizeof(int64_t) * n);
        c->region_prio = malloc(sizeof(int32_t) * n);
        c->region_ioprio = malloc(sizeof(int32_t) * n);
    }
    if (!c || !c->region_fd || !c->region_offset || !c->region_pages || !c->region_prio || !c->region_ioprio) {
        if (c) { free(c->region_fd); free(c->region_offset); free(c->region_pages); free(c->region_prio);
                 free(c->region_ioprio); free(c); }
        *err = ENOMEM;
        return NULL;
    }
    c->eng = e;
    c->nregions = nregions;
    c->host_only = 1;
    for (int i = 0; i < nregions; i++) if (region_fd[i] >= 0) c->host_only = 0;
    memcpy(c->region_fd, region_fd, sizeof(int32_t) * nregions);
    memcpy(c->region_offset, region_offset, sizeof(int64_t) * nregions);
    memcpy(c->region_pages, region_pages, sizeof(int64_t) * nregions);
    memcpy(c->region_prio, region_prio, sizeof(int32_t) * nregions);
    memcpy(c->region_ioprio, region_ioprio, sizeof(int32_t) * nregions);
    pthread_mutex_lock(&e->mu);
    c->id = e->next_client++;
    c->next = e->clients;
    if (e->clients) e->clients->prev = c;
    e->clients = c;
    int changed = 0;
    for (int i = 0; i < nregions; i++) {
        if (region_fd[i] < 0) continue;   /* host memory: no file to register */
        unsigned f = 0;
        while (f < e->nfiles && e->files[f] != region_fd[i]) f++;
        if (f < e->nfiles) { e->file_refs[f]++; continue; }
        if (e->nfiles < ST_MAX_FILES) {
            e->files[e->nfiles] = region_fd[i];
            e->file_refs[e->nfiles++] = 1;
            changed = 1;
        }
    }
    if (changed) {
        e->files_gen++;
        pthread_cond_broadcast(&e->work);
    }
    pthread_mutex_unlock(&e->mu);
    *err = 0;
    return c;
}

/* Detach a client with no job left (released): 0, or EBUSY while one is. Its files leave the set. */
int st_eng_detach(struct st_eng *e, struct st_client *c) {
    pthread_mutex_lock(&e->mu);
    if (c->live) { pthread_mutex_unlock(&e->mu); return EBUSY; }
    if (c->prev) c->prev->next = c->next; else e->clients = c->next;
    if (c->next) c->next->prev = c->prev;
    int changed = 0;
    for (int i = 0; i < c->nregions; i++) {
        if (c->region_fd[i] < 0) continue;
        for (unsigned f = 0; f < e->nfiles; f++) {
            if (e->files[f] != c->region_fd[i]) continue;
            if (--e->file_refs[f] == 0) {
                e->nfiles--;
                e->files[f] = e->files[e->nfiles];
                e->file_refs[f] = e->file_refs[e->nfiles];
                changed = 1;
            }
            break;
        }
    }
    if (changed) {
        /* The rings drop the closed files when idle; a new file opened under the same number is never
         * read through a stale registration, since no fixed file is used until the set is re-registered. */
        e->files_gen++;
        pthread_cond_broadcast(&e->work);
    }
    pthread_mutex_unlock(&e->mu);
    free(c->region_fd);
    free(c->region_offset);
    free(c->region_pages);
    free(c->region_prio);
    free(c->region_ioprio);
    free(c);
    return 0;
}

/* Strict order on (1, the default) or off (0): with it, a batch's first read waits until no read of an
 * earlier-priority batch is in flight, so a later layer never shares the device with an earlier one's tail;
 * without it, a later layer's reads fill the depth the earlier one's leave. */
void st_eng_strict(struct st_eng *e, int on) {
    pthread_mutex_lock(&e->mu);
    e->strict = on;
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->mu);
}

/* Workers as batch-class threads (1, the default: a woken worker does not preempt the thread that queued
 * the batch) or ordinary ones (0: a worker whose reads are host-memory copies, CPU work that must run
 * while the caller keeps its core busy, is woken as any thread is). 0, or the first errno refused. */
int st_eng_batch(struct st_eng *e, int on) {
    struct sched_param none = {0};
    int rc = 0;
    for (int t = 0; t < e->nthreads; t++) {
        int r = pthread_setschedparam(e->workers[t].thread, on ? SCHED_BATCH : SCHED_OTHER, &none);
        if (r && !rc) rc = r;
    }
    return rc;
}

/* Hold (1) or release (0) the queue: a held queue admits no read, so a test can make a batch land late
 * for real. Stopping the queue releases it. */
void st_eng_hold(struct st_eng *e, int on) {
    pthread_mutex_lock(&e->mu);
    e->held = on;
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->mu);
}

/* Defer (1) the queue's work, or end one deferral (0): while any is open the workers admit no read, and the
 * last one to end wakes them. A step engine defers a host-memory queue around its compiled pass, so the
 * copies of the batches the pass queues start once the pass is done instead of taking the caller's core
 * from it. Counted, so callers that share the queue nest; stopping the queue ends them all. */
void st_eng_defer(struct st_eng *e, int on) {
    pthread_mutex_lock(&e->mu);
    if (on) e->deferred++;
    else if (e->deferred > 0 && --e->deferred == 0) pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->mu);
}

/* Queue reads i < n of client c: page page[i] of region region[i] into buffer buffer[i] of the pool of
 * `pool_buffers` buffers of `len` bytes at `pool_addr`. The arrays are copied; returns the job, or NULL
 * with *err = i + 1 for the first read naming a region, page or buffer out of range (nothing queued),
 * -ENOMEM, or -ESHUTDOWN once the queue is stopping. */
struct st_job *st_eng_submit(struct st_client *c, int n, const int32_t *region, const int64_t *page,
                             const int32_t *buffer, uint64_t pool_addr, int64_t pool_buffers, int64_t *err) {
    struct st_eng *e = c->eng;
    int prio = INT32_MAX;
    for (int i = 0; i < n; i++) {
        int32_t g = region[i];
        if (g < 0 || g >= c->nregions || page[i] < 0 || page[i] >= c->region_pages[g] || buffer[i] < 0 ||
            buffer[i] >= pool_buffers) {
            *err = (int64_t)i + 1;
            return NULL;
        }
        if (c->region_prio[g] < prio) prio = c->region_prio[g];
    }
    size_t each = sizeof(int64_t) + 3 * sizeof(int32_t);
    struct st_job *j = malloc(sizeof(*j) + each * (size_t)(n ? n : 1));
    if (!j) { *err = -ENOMEM; return NULL; }
    j->page = (int64_t *)(j + 1);        /* the 8-byte array first, then the 4-byte ones */
    j->region = (int32_t *)(j->page + n);
    j->buffer = j->region + n;
    j->res = j->buffer + n;
    memcpy(j->page, page, sizeof(int64_t) * n);
    memcpy(j->region, region, sizeof(int32_t) * n);
    memcpy(j->buffer, buffer, sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) j->res[i] = INT32_MIN;
    j->client = c;
    j->n = n;
    j->admitted = j->landed = 0;
    j->prio = prio;
    j->next = NULL;
    j->pool_addr = pool_addr;
    j->pool_len = (uint64_t)pool_buffers * e->len;
    j->done = 0;
    j->first_bad = -1;
    j->end_ns = j->cpu_ns = 0;
    j->submit_ns = j->first_ns = mono_ns();
    pthread_mutex_lock(&e->mu);
    if (e->stop) {
        pthread_mutex_unlock(&e->mu);
        free(j);
        *err = -ESHUTDOWN;
        return NULL;
    }
    j->seq = ++e->seq;
    c->live++;
    j->prev_all = NULL;
    j->next_all = e->all;
    if (e->all) e->all->prev_all = j;
    e->all = j;
    if (n == 0) {
        j->done = 1;
        j->end_ns = j->submit_ns;
    } else {
        struct st_job **at = &e->queue;
        while (*at && (*at)->prio <= prio) at = &(*at)->next;
        j->next = *at;
        *at = j;
        wake_workers(e);
    }
    pthread_mutex_unlock(&e->mu);
    *err = 0;
    return j;
}

/* Cancel the reads of job j not yet handed to the kernel (a caller that stopped waiting for it: a timeout):
 * they land at once as -ECANCELED, so the job is done when its reads already in flight land, and a device
 * that fell behind does not keep reading for batches nobody waits for. Returns how many were cancelled. */
int st_eng_cancel(struct st_eng *e, struct st_job *j) {
    pthread_mutex_lock(&e->mu);
    int n = 0;
    if (!j->done && j->admitted < j->n) {
        struct st_job **at = &e->queue;
        while (*at && *at != j) at = &(*at)->next;
        if (*at) *at = j->next;
        n = j->n - j->admitted;
        for (int i = j->admitted; i < j->n; i++) j->res[i] = -ECANCELED;
        j->admitted = j->n;
        j->landed += n;
        if (j->landed == j->n) {
            finish_job(j);
            pthread_cond_broadcast(&e->done);
        }
        pthread_cond_broadcast(&e->work);   /* a batch held back behind it may go now */
    }
    pthread_mutex_unlock(&e->mu);
    return n;
}

/* Block until job j is done, at most timeout_ns (< 0: no limit). 0 done, ETIMEDOUT not yet.
 * On done, *info holds what st_io.h's struct st_wait_info says. */
int st_eng_wait(struct st_eng *e, struct st_job *j, int64_t timeout_ns, struct st_wait_info *info) {
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
        info->first_bad = j->first_bad;
        info->submit_ns = j->submit_ns;
        info->end_ns = j->end_ns;
        info->cpu_ns = j->cpu_ns;
        info->buffers_refused = e->buffers_refused;
        info->files_refused = e->files_refused;
        info->first_ns = j->first_ns;
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
    j->client->live--;
    pthread_mutex_unlock(&e->mu);
    free(j);
}

/* The pool address each worker's ring has registered (0: none), into out[nthreads]; returns nthreads. */
int st_eng_registered(struct st_eng *e, uint64_t *out) {
    pthread_mutex_lock(&e->mu);
    for (int t = 0; t < e->nthreads; t++) out[t] = e->workers[t].registered_addr;
    pthread_mutex_unlock(&e->mu);
    return e->nthreads;
}

/* Record the next `cap` admitted reads (0: stop recording and forget them). */
int st_eng_trace(struct st_eng *e, int64_t cap) {
    pthread_mutex_lock(&e->mu);
    free(e->trace_client); free(e->trace_region); free(e->trace_page);
    e->trace_client = e->trace_region = NULL;
    e->trace_page = NULL;
    e->trace_cap = e->trace_len = 0;
    int rc = 0;
    if (cap > 0) {
        e->trace_client = malloc(sizeof(int32_t) * cap);
        e->trace_region = malloc(sizeof(int32_t) * cap);
        e->trace_page = malloc(sizeof(int64_t) * cap);
        if (e->trace_client && e->trace_region && e->trace_page) e->trace_cap = cap;
        else rc = ENOMEM;
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

/* Copy the reads admitted so far (at most cap): client id, region, page, in admission order; how many. */
int64_t st_eng_trace_read(struct st_eng *e, int32_t *client, int32_t *region, int64_t *page, int64_t cap) {
    pthread_mutex_lock(&e->mu);
    int64_t n = e->trace_len < cap ? e->trace_len : cap;
    if (n > 0) {
        memcpy(client, e->trace_client, sizeof(int32_t) * n);
        memcpy(region, e->trace_region, sizeof(int32_t) * n);
        memcpy(page, e->trace_page, sizeof(int64_t) * n);
    }
    pthread_mutex_unlock(&e->mu);
    return n;
}

/* Finish every queued batch, stop the threads, free the rings, every job not released and every client. */
void st_eng_destroy(struct st_eng *e) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    e->held = 0;
    e->deferred = 0;
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->mu);
    for (int t = 0; t < e->nthreads; t++) pthread_join(e->workers[t].thread, NULL);
    while (e->all) {
        struct st_job *j = e->all;
        e->all = j->next_all;
        free(j);
    }
    while (e->clients) {
        struct st_client *c = e->clients;
        e->clients = c->next;
        free(c->region_fd); free(c->region_offset); free(c->region_pages); free(c->region_prio);
        free(c->region_ioprio); free(c);
    }
    st_eng_trace(e, 0);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->work);
    pthread_cond_destroy(&e->done);
    free(e);
}
