/* cblas_sgemm that routes matrix-vector products to cblas_sgemv.
 *
 * MLX's CPU backend calls cblas_sgemm for every float32 matmul, including the
 * M == 1 products of a decode step. OpenBLAS 0.3.21 (Debian 12) runs those
 * through its GEMM kernels at ~8 GB/s; its GEMV reaches ~23 GB/s here. This
 * shim is loaded (RTLD_GLOBAL) before OpenBLAS and MLX, so MLX binds to it;
 * everything else is forwarded to OpenBLAS unchanged.
 */
#include <dlfcn.h>
#include <stddef.h>

enum { RowMajor = 101, ColMajor = 102 };
enum { NoTrans = 111, Trans = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;

/* Bind to the BLAS at `path`; returns 0 on success. */
int kvchat_blas_init(const char *path) {
  void *h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (!h) return 1;
  real_sgemm = (sgemm_fn)dlsym(h, "cblas_sgemm");
  real_sgemv = (sgemv_fn)dlsym(h, "cblas_sgemv");
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
  real_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
