/*
 * xstate-shim.so: lets Debian 12's User-Mode Linux (Linux 6.1) run on hosts whose XSAVE
 * area is larger than the one it was built for (AVX-512, AMX: 2.7 to 11 KiB, where UML
 * keeps 832 bytes per thread).
 *
 * Why: UML saves and restores each of its threads' extended registers with
 * ptrace(PTRACE_GETREGSET / PTRACE_SETREGSET, NT_X86_XSTATE) and a buffer of its own size.
 * The host kernel truncates a short GETREGSET but refuses a short SETREGSET with EFAULT, so
 * on such a host UML's init dies at its first context switch ("ptrace set fp regs failed,
 * errno = 14"). This is the host's rule, not a bug of ours to work around in Rust: the
 * interposition has to happen inside UML's own process, so it is an LD_PRELOAD library,
 * written in C because it replaces a libc function. It is test tooling only (built by
 * scripts/fetch-uml, preloaded by crates/testkit/src/uml.rs), never part of thinpool.
 *
 * What it does: it keeps, for each buffer UML passes (one per UML thread), a full-size copy
 * of that thread's state. A short GETREGSET reads the full state into the copy and gives UML
 * its prefix; a short SETREGSET writes UML's prefix over the copy (read from the thread
 * first, if there is none yet) and sets the full state. So every UML thread keeps all of its
 * registers across switches, as on a host whose XSAVE area fits. Calls of full size, and
 * every other ptrace request, go to libc's ptrace unchanged: on a host where UML's buffer
 * fits, the shim changes nothing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/types.h>
#include <sys/uio.h>

typedef long (*ptrace_fn)(int, pid_t, void *, void *);

/* Buffers UML has used, each with the full state last seen for it. */
#define SLOTS 8192
#define MAX_XSTATE (64 * 1024)

struct slot {
    void *key;
    unsigned char *full;
};

static struct slot slots[SLOTS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static size_t host_size; /* 0 until learnt from a full-size GETREGSET */

static ptrace_fn real_ptrace(void) {
    static ptrace_fn real;
    if (!real)
        real = (ptrace_fn)dlsym(RTLD_NEXT, "ptrace");
    return real;
}

/* The slot of `key`, made if missing (NULL if the table is full or memory is out). */
static struct slot *slot_of(void *key, int *fresh) {
    size_t start = ((uintptr_t)key >> 4) % SLOTS;
    for (size_t i = 0; i < SLOTS; i++) {
        struct slot *s = &slots[(start + i) % SLOTS];
        if (s->key == key) {
            *fresh = 0;
            return s;
        }
        if (s->key == NULL) {
            s->full = calloc(1, MAX_XSTATE);
            if (!s->full)
                return NULL;
            s->key = key;
            *fresh = 1;
            return s;
        }
    }
    return NULL;
}

/* Reads the full state of `pid` into `full`; learns the host's size. */
static long get_full(pid_t pid, unsigned char *full) {
    struct iovec iov = {full, MAX_XSTATE};
    long r = real_ptrace()(PTRACE_GETREGSET, pid, (void *)(uintptr_t)NT_X86_XSTATE, &iov);
    if (r == 0)
        host_size = iov.iov_len;
    return r;
}

long ptrace(enum __ptrace_request request, ...) {
    va_list ap;
    va_start(ap, request);
    pid_t pid = va_arg(ap, pid_t);
    void *addr = va_arg(ap, void *);
    void *data = va_arg(ap, void *);
    va_end(ap);

    int xstate = (uintptr_t)addr == NT_X86_XSTATE;
    if (!xstate || (request != PTRACE_GETREGSET && request != PTRACE_SETREGSET))
        return real_ptrace()(request, pid, addr, data);

    struct iovec *iov = data;
    pthread_mutex_lock(&lock);
    long r;
    int fresh;
    struct slot *s = slot_of(iov->iov_base, &fresh);
    if (!s) {
        pthread_mutex_unlock(&lock);
        return real_ptrace()(request, pid, addr, data);
    }
    if (request == PTRACE_GETREGSET) {
        r = get_full(pid, s->full);
        if (r == 0) {
            size_t n = iov->iov_len < host_size ? iov->iov_len : host_size;
            memcpy(iov->iov_base, s->full, n);
            iov->iov_len = n;
        }
    } else if (host_size != 0 && iov->iov_len >= host_size) {
        r = real_ptrace()(request, pid, addr, data);
    } else {
        r = fresh ? get_full(pid, s->full) : 0;
        if (r == 0 && iov->iov_len > host_size) {
            errno = EINVAL;
            r = -1;
        }
        if (r == 0) {
            memcpy(s->full, iov->iov_base, iov->iov_len);
            struct iovec full = {s->full, host_size};
            r = real_ptrace()(PTRACE_SETREGSET, pid, addr, &full);
        }
    }
    pthread_mutex_unlock(&lock);
    return r;
}
