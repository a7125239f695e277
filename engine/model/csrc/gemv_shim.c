/* cblas_sgemm that routes matrix-vector products to cblas_sgemv, and splits
 * small-M products (batched decode) over two threads.
 *
 * MLX's CPU backend calls cblas_sgemm for every float32 matmul, including the
 * M == 1 products of a decode step. OpenBLAS 0.3.21 (Debian 12) runs those
 * through its GEMM kernels at ~8 GB/s; its GEMV reaches ~23 GB/s here. This
 * shim is loaded (RTLD_GLOBAL) before OpenBLAS and MLX, so MLX binds to it;
 * everything else is forwarded to OpenBLAS unchanged.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>

enum { RowMajor = 101, ColMajor = 102 };
enum { NoTrans = 111, Trans = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
typedef void (*set_threads_fn)(int);
typedef int (*get_threads_fn)(void);
static set_threads_fn set_threads;
static get_threads_fn get_threads;

/* Small-M products (a batched decode step: M = sequences, 2..32) run single-
 * threaded inside OpenBLAS at ~5 GB/s. Splitting N in two halves, one on a
 * persistent helper thread, uses both cores. Off with KVCHAT_SPLIT_GEMM=0. */
typedef struct {
  int order, ta, tb, M, N, K, lda, ldb, ldc;
  float alpha, beta;
  const float *A, *B;
  float *C;
} job_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static job_t job;
static int pending, done, split_on;
static pthread_t worker;

static void *worker_main(void *arg) {
  (void)arg;
  for (;;) {
    pthread_mutex_lock(&mu);
    while (!pending) pthread_cond_wait(&cv, &mu);
    job_t j = job;
    pending = 0;
    pthread_mutex_unlock(&mu);
    real_sgemm(j.order, j.ta, j.tb, j.M, j.N, j.K, j.alpha, j.A, j.lda, j.B, j.ldb, j.beta,
               j.C, j.ldc);
    pthread_mutex_lock(&mu);
    done = 1;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
  }
  return NULL;
}

static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;

/* C (MxN) = A op(B), row-major: columns [0, h) on the helper, [h, N) here. */
static void split_sgemm(int ta, int tb, int M, int N, int K, float alpha, const float *A,
                        int lda, const float *B, int ldb, float beta, float *C, int ldc) {
  int h = N / 2;
  const float *B2 = tb == NoTrans ? B + h : B + (size_t)h * ldb;
  pthread_mutex_lock(&call_mu); /* one split at a time: the helper is single */
  int saved = get_threads();
  set_threads(1);
  pthread_mutex_lock(&mu);
  job = (job_t){RowMajor, ta, tb, M, h, K, lda, ldb, ldc, alpha, beta, A, B, C};
  pending = 1;
  done = 0;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
  real_sgemm(RowMajor, ta, tb, M, N - h, K, alpha, A, lda, B2, ldb, beta, C + h, ldc);
  pthread_mutex_lock(&mu);
  while (!done) pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
  set_threads(saved);
  pthread_mutex_unlock(&call_mu);
}

/* A forked child has no helper thread: it must never wait for one. */
static void no_split_in_child(void) { split_on = 0; }

/* Bind to the BLAS at `path`; returns 0 on success. */
int kvchat_blas_init(const char *path) {
  void *h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (!h) return 1;
  real_sgemm = (sgemm_fn)dlsym(h, "cblas_sgemm");
  real_sgemv = (sgemv_fn)dlsym(h, "cblas_sgemv");
  set_threads = (set_threads_fn)dlsym(h, "openblas_set_num_threads");
  get_threads = (get_threads_fn)dlsym(h, "openblas_get_num_threads");
  const char *env = getenv("KVCHAT_SPLIT_GEMM");
  split_on = set_threads && get_threads && !(env && env[0] == '0') &&
             pthread_create(&worker, NULL, worker_main, NULL) == 0;
  if (split_on) {
    pthread_detach(worker);
    pthread_atfork(NULL, NULL, no_split_in_child);
  }
  return real_sgemm && real_sgemv ? 0 : 2;
}

static int flip(int t) { return t == NoTrans ? Trans : NoTrans; }

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta,
                 float *C, int ldc) {
  if (order == RowMajor && K > 0 && M == 1 && N > 1) {
    /* c (1xN) = a (1xK) op(B): y = op(B)^T a over B's stored (rows x cols). */
    int rows = tb == NoTrans ? K : N, cols = tb == NoTrans ? N : K;
    int incx = ta == NoTrans ? 1 : lda;
    real_sgemv(RowMajor, flip(tb), rows, cols, alpha, B, ldb, A, incx, beta, C, 1);
    return;
  }
  if (order == RowMajor && K > 0 && N == 1 && M > 1) {
    /* c (Mx1) = op(A) b: y = op(A) b over A's stored (rows x cols). */
    int rows = ta == NoTrans ? M : K, cols = ta == NoTrans ? K : M;
    int incx = tb == NoTrans ? ldb : 1;
    real_sgemv(RowMajor, ta, rows, cols, alpha, A, lda, B, incx, beta, C, ldc);
    return;
  }
  if (split_on && order == RowMajor && K > 0 && M >= 2 && M <= 32 && N >= 512) {
    split_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  real_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
