/* pool.c — the worker threads behind fa_pool_run (see pool.h for why).
 *
 * One job at a time. A job is published by writing its task, context and
 * worker count, then `state` = (job number << 32), then bumping `gen` and
 * waking sleepers. A worker joins by one compare-and-swap on `state` that
 * needs the job number it saw, the CLOSED bit clear and fewer than `want`
 * workers in; only then does it read the task and context. The caller, done
 * with its own share, sets CLOSED (from then on nobody joins), reads how many
 * joined, and waits until that many have left. So a worker that wakes late
 * never touches a finished call's data, and the caller never waits for it.
 */
#include "pool.h"

#include <pthread.h>
#include <stdint.h>
#include <time.h>

/* How long an idle worker spins before it sleeps: long enough to catch the
 * next call of a loop of attention calls, short enough not to hold a core
 * through the matmul an inference loop runs in between (GCC's OpenMP spins
 * for milliseconds). */
#define FA_POOL_SPIN_NS 50000

#define FA_CLOSED ((uint64_t)1 << 31)
#define FA_COUNT ((uint64_t)FA_CLOSED - 1)

static pthread_mutex_t fa_busy = PTHREAD_MUTEX_INITIALIZER;  /* held by the caller of the job in flight */
static pthread_mutex_t fa_sleep = PTHREAD_MUTEX_INITIALIZER; /* with fa_wake: idle workers sleep here */
static pthread_cond_t fa_wake = PTHREAD_COND_INITIALIZER;
static pthread_once_t fa_once = PTHREAD_ONCE_INIT;
static int fa_created;            /* workers alive; changed only with fa_busy held */
static uint64_t fa_gen;           /* number of the latest job (atomic) */
static uint64_t fa_state;         /* job number << 32 | FA_CLOSED | workers in (atomic) */
static int fa_exited;             /* workers of this job that have returned (atomic) */
static int fa_want;               /* workers this job may take */
static fa_pool_task fa_task;
static void *fa_ctx;

/* A forked child has none of the parent's workers (and a lock a parent thread
 * held stays held): it starts the pool afresh and creates its own workers. */
static void fa_pool_after_fork(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cond = PTHREAD_COND_INITIALIZER;
    fa_busy = fresh;
    fa_sleep = fresh;
    fa_wake = fresh_cond;
    fa_created = 0;
}

static void fa_pool_init(void) { pthread_atfork(NULL, NULL, fa_pool_after_fork); }

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* The number of the next job after `seen`: spin a while, then sleep. */
static uint64_t wait_for_job(uint64_t seen) {
    const uint64_t start = now_ns();
    uint64_t g;
    for (unsigned i = 1;; i++) {
        if ((g = __atomic_load_n(&fa_gen, __ATOMIC_ACQUIRE)) != seen) return g;
        if (i % 64 == 0 && now_ns() - start > FA_POOL_SPIN_NS) break;
        cpu_relax();
    }
    pthread_mutex_lock(&fa_sleep);
    while ((g = __atomic_load_n(&fa_gen, __ATOMIC_ACQUIRE)) == seen) pthread_cond_wait(&fa_wake, &fa_sleep);
    pthread_mutex_unlock(&fa_sleep);
    return g;
}

static void *worker(void *arg) {
    uint64_t seen = (uint64_t)(uintptr_t)arg; /* the job before the one it was created for */
    for (;;) {
        const uint64_t g = wait_for_job(seen);
        seen = g;
        uint64_t s = __atomic_load_n(&fa_state, __ATOMIC_ACQUIRE);
        int joined = 0;
        while ((s >> 32) == (g & 0xffffffffu) && !(s & FA_CLOSED) &&
               (s & FA_COUNT) < (uint64_t)__atomic_load_n(&fa_want, __ATOMIC_ACQUIRE))
            if (__atomic_compare_exchange_n(&fa_state, &s, s + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                joined = 1;
                break;
            }
        if (!joined) continue; /* too late, or not needed: wait for the next job */
        fa_task(fa_ctx);
        __atomic_fetch_add(&fa_exited, 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

int fa_pool_run(int threads, fa_pool_task task, void *ctx) {
    pthread_once(&fa_once, fa_pool_init);
    if (threads <= 1 || pthread_mutex_trylock(&fa_busy) != 0) {
        task(ctx);
        return 1;
    }
    const uint64_t g = __atomic_load_n(&fa_gen, __ATOMIC_RELAXED) + 1;
    fa_task = task;
    fa_ctx = ctx;
    __atomic_store_n(&fa_want, threads - 1, __ATOMIC_RELAXED);
    __atomic_store_n(&fa_exited, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&fa_state, (g & 0xffffffffu) << 32, __ATOMIC_RELEASE);
    pthread_mutex_lock(&fa_sleep);
    __atomic_store_n(&fa_gen, g, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&fa_wake);
    pthread_mutex_unlock(&fa_sleep);

    /* Workers are created when a call first needs them, and kept. */
    while (fa_created < threads - 1) {
        pthread_attr_t attr;
        pthread_t t;
        int failed = pthread_attr_init(&attr);
        if (!failed) {
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            failed = pthread_create(&t, &attr, worker, (void *)(uintptr_t)(g - 1));
            pthread_attr_destroy(&attr);
        }
        if (failed) break; /* fewer threads; the caller's share grows */
        fa_created++;
    }

    task(ctx);
    const uint64_t s = __atomic_fetch_or(&fa_state, FA_CLOSED, __ATOMIC_ACQ_REL);
    const int joined = (int)(s & FA_COUNT);
    while (__atomic_load_n(&fa_exited, __ATOMIC_ACQUIRE) < joined) cpu_relax();
    pthread_mutex_unlock(&fa_busy);
    return 1 + joined;
}
