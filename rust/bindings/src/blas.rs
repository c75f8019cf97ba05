//! `cblas_sgemm` for MLX's CPU backend: decode-sized products by
//! `cairn_blas::sgemm`, every other call forwarded to the BLAS loaded after us.
//!
//! `mlx_cairn/_blas.py` opens this library with `RTLD_GLOBAL` before OpenBLAS,
//! so MLX binds its `cblas_sgemm` here; it then hands OpenBLAS's own entry to
//! [`cairn_blas_set_fallback`]. These are C-ABI exports, not Python functions.
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

const ROW_MAJOR: i32 = 101;
const COL_MAJOR: i32 = 102;
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
            cairn_blas::sgemm(
                m as usize,
                n as usize,
                k as usize,
                a,
                lda as usize,
                b,
                ldb as usize,
                c,
                ldc as usize,
            )
        };
        return;
    }
    match FALLBACK.load(Ordering::Acquire) {
        0 => {
            // SAFETY: the caller's contract.
            unsafe {
                reference(
                    order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
                )
            }
        }
        f => {
            // SAFETY: `f` is the address of the BLAS's own `cblas_sgemm` (same signature).
            let f: Sgemm = unsafe { std::mem::transmute::<usize, Sgemm>(f) };
            unsafe {
                f(
                    order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
                )
            }
        }
    }
}

/// The plain triple loop, for calls before a fallback is set (slow, exact CBLAS semantics).
#[allow(clippy::too_many_arguments)]
unsafe fn reference(
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
    let (m, n, k) = (m.max(0) as usize, n.max(0) as usize, k.max(0) as usize);
    let (lda, ldb, ldc) = (lda as usize, ldb as usize, ldc as usize);
    let col = order == COL_MAJOR;
    // Element (i, j) of a matrix stored with leading dimension `ld`, honouring order and transpose.
    let at = |p: *const f32, ld: usize, trans: bool, i: usize, j: usize| {
        let (i, j) = if trans { (j, i) } else { (i, j) };
        // SAFETY: the caller's contract.
        unsafe { *p.add(if col { j * ld + i } else { i * ld + j }) }
    };
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f32;
            for l in 0..k {
                s += at(a, lda, trans_a != NO_TRANS, i, l) * at(b, ldb, trans_b != NO_TRANS, l, j);
            }
            let idx = if col { j * ldc + i } else { i * ldc + j };
            // SAFETY: the caller's contract.
            unsafe {
                let old = if beta == 0.0 { 0.0 } else { beta * *c.add(idx) };
                *c.add(idx) = alpha * s + old;
            }
        }
    }
}
