/* pool.h — fastattn's own worker threads (POSIX). Internal, used by attention.c.
 *
 * Why not an OpenMP team: a team's idle workers spin for milliseconds after
 * each call (GCC's default), taking a core from the BLAS matmul that an
 * inference loop runs next, and a call waits at its closing barrier for a
 * worker that started late because another pool held the cores. Here a
 * worker spins FA_POOL_SPIN_NS at most and then sleeps, and the caller never
 * waits for a worker that has not started: it takes the items itself. The
 * thread count still comes from the OpenMP runtime (omp_get_max_threads), so
 * OMP_NUM_THREADS and threadpoolctl limit fastattn as before.
 */
#ifndef FA_POOL_H
#define FA_POOL_H

/* One thread's share of a job: called on the calling thread and on each
 * worker that joins in time; it takes work items until none are left. */
typedef void (*fa_pool_task)(void *ctx);

/* Runs task(ctx) on the calling thread and on up to `threads` − 1 workers
 * (created on first use, kept for later calls), and returns once every
 * thread that started it has returned. Workers that wake after the caller
 * has finished never touch ctx. While another thread's job is in flight, or
 * if no worker can be created, task runs on the calling thread alone.
 * Returns the number of threads that ran task. */
int fa_pool_run(int threads, fa_pool_task task, void *ctx);

#endif /* FA_POOL_H */
