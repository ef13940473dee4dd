/* Batched O_DIRECT page reads through io_uring, with raw syscalls.
 *
 * No liburing: the rings are set up with io_uring_setup(2) and mmap(2), reads
 * are queued as IORING_OP_READ entries and io_uring_enter(2) submits them and
 * waits for completions. Only <linux/io_uring.h> (linux-libc-dev) is needed.
 *
 * One ring belongs to one thread (the device's I/O worker). Python calls
 * st_ring_read through ctypes, which releases the GIL for the whole batch.
 * Every read's result lands in res[i]: bytes read, or -errno.
 */
#define _GNU_SOURCE
#include <errno.h>
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
    unsigned setup_flags;   /* the flags the kernel accepted */
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
    unsigned used = 0;
    for (unsigned i = 0; i < sizeof(choices) / sizeof(choices[0]); i++) {
        fd = try_setup(entries, choices[i], &p);
        if (fd >= 0) { used = choices[i]; break; }
        if (errno != EINVAL) break;
    }
    if (fd < 0) { *err = errno; return NULL; }

    struct st_ring *r = calloc(1, sizeof(*r));
    if (!r) { *err = ENOMEM; close(fd); return NULL; }
    r->fd = fd;
    r->entries = p.sq_entries;
    r->setup_flags = used;
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

unsigned st_ring_entries(const struct st_ring *r) { return r->entries; }
unsigned st_ring_flags(const struct st_ring *r) { return r->setup_flags; }

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
