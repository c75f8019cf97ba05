//! `cblas_sgemm` for MLX's CPU backend: decode-sized products by
//! `cairn_blas::sgemm`, every other call forwarded to the BLAS loaded after us.
//!
//! `mlx_cairn/backends/cpu/blas.py` hands OpenBLAS's own entry to [`cairn_blas_set_fallback`],
//! then makes this library global before OpenBLAS, so MLX binds its
//! `cblas_sgemm` here. These are C-ABI exports, not Python functions.
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

const ROW_MAJOR: i32 = 101;
const NO_TRANS: i32 = 111;

/// Below this many weights (`k * n`) a product is left to the BLAS: it is in
/// cache already, and the general kernel has nothing to lose.
const MIN_WEIGHTS: usize = 1 << 16;

type Sgemm = unsafe extern "C" fn(
    i32,
    i32,
    i32,
    i32,
    i32,
    i32,
    f32,
    *const f32,
    i32,
    *const f32,
    i32,
    f32,
    *mut f32,
    i32,
);

static FALLBACK: AtomicUsize = AtomicUsize::new(0);
static ENABLED: AtomicBool = AtomicBool::new(true);

/// The BLAS's own `cblas_sgemm`, for every call this file does not take.
#[no_mangle]
pub extern "C" fn cairn_blas_set_fallback(sgemm: usize) {
    FALLBACK.store(sgemm, Ordering::Release);
}

/// Turn the decode kernel on or off (off: every call goes to the fallback).
#[no_mangle]
pub extern "C" fn cairn_blas_set_enabled(on: i32) {
    ENABLED.store(on != 0, Ordering::Release);
}

/// Whether calls like `(m, n, k)` go to the decode kernel on this CPU (0 or 1).
#[no_mangle]
pub extern "C" fn cairn_blas_takes(m: i32, n: i32, k: i32) -> i32 {
    i32::from(takes(m, n, k))
}

fn takes(m: i32, n: i32, k: i32) -> bool {
    let (Ok(m), Ok(n), Ok(k)) = (usize::try_from(m), usize::try_from(n), usize::try_from(k)) else {
        return false;
    };
    ENABLED.load(Ordering::Acquire)
        && (1..=cairn_blas::MAX_ROWS).contains(&m)
        && n >= 8
        && k.saturating_mul(n) >= MIN_WEIGHTS
        && cairn_blas::available()
}

/// # Safety
/// The CBLAS contract: the pointers address arrays of the given shapes and strides.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cblas_sgemm(
    order: i32,
    trans_a: i32,
    trans_b: i32,
    m: i32,
    n: i32,
    k: i32,
    alpha: f32,
    a: *const f32,
    lda: i32,
    b: *const f32,
    ldb: i32,
    beta: f32,
    c: *mut f32,
    ldc: i32,
) {
    if order == ROW_MAJOR
        && trans_a == NO_TRANS
        && trans_b == NO_TRANS
        && alpha == 1.0
        && beta == 0.0
        && lda >= k
        && ldb >= n
        && ldc >= n
        && takes(m, n, k)
    {
        // SAFETY: the caller's contract, checked shapes; `takes` checked the CPU.
        unsafe {
            cairn_blas::sgemm(cairn_blas::Operands {
                m: m as usize,
                n: n as usize,
                k: k as usize,
                a,
                lda: lda as usize,
                b,
                ldb: ldb as usize,
                c,
                ldc: ldc as usize,
            })
        };
        return;
    }
    let f = FALLBACK.load(Ordering::Acquire);
    if f == 0 {
        // `backends/cpu/blas.py` makes this library global only after setting the fallback.
        std::process::abort();
    }
    // SAFETY: `f` is the address of the BLAS's own `cblas_sgemm` (same signature),
    // called with the caller's arguments and contract.
    unsafe {
        let f: Sgemm = std::mem::transmute::<usize, Sgemm>(f);
        f(
            order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
        )
    }
}
