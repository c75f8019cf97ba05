//! A single-precision product for the few rows of a decode step.
//!
//! `C[m, n] = A[m, k] · B[k, n]` (row-major, no transposes) for `m <= MAX_ROWS`.
//! For so few rows the product is bound by reading `B` from memory once.
//! A general GEMM first copies ("packs") each block of `B` into a buffer and
//! only then multiplies, so the copy and the arithmetic take turns; here the
//! rows of `B` are streamed once, straight into fused multiply-adds, so the
//! arithmetic hides under the memory reads.
//!
//! Each output element is summed over `k` in ascending order by one fused
//! multiply-add per term, whatever `m` is: a row's result does not depend on
//! which other rows share the call.

#![deny(unsafe_op_in_unsafe_fn)]

use std::sync::OnceLock;

/// The most rows [`sgemm`] takes. Measured here against OpenBLAS 0.3.21 over
/// SmolLM2-135M's products: faster at 1-12 rows, level at 15, slower at 14 and
/// 16 (where OpenBLAS's 16-wide kernel fits the rows exactly).
pub const MAX_ROWS: usize = 12;

/// Output columns per accumulator panel (kept in L1/L2 while `k` sweeps).
const PANEL: usize = 512;

/// Rows of `C` computed together (their accumulators fill the 16 vector registers).
const GROUP: usize = 8;

/// Rows of `B` folded into the accumulators per pass over a panel.
const K_BLOCK: usize = 8;

/// Whether this CPU can run the kernel (x86-64 with AVX2 and FMA).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The worker threads, or None (the calling thread computes alone): in a child
/// forked after they started (it has none of them), or if they could not start.
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<(u32, Option<rayon::ThreadPool>)> = OnceLock::new();
    let (pid, pool) = POOL.get_or_init(|| {
        let threads = std::env::var("CAIRN_BLAS_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&t: &usize| t > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        // The calling thread computes a share too: one worker fewer to wake.
        let pool = (threads > 1).then(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads - 1)
                .thread_name(|i| format!("cairn-blas-{i}"))
                .build()
                .ok()
        });
        (std::process::id(), pool.flatten())
    });
    pool.as_ref().filter(|_| *pid == std::process::id())
}

/// The operands of `C = A · B`: row-major `A [m, k]` (stride `lda`),
/// `B [k, n]` (`ldb`), `C [m, n]` (`ldc`).
#[derive(Debug, Clone, Copy)]
pub struct Operands {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: *const f32,
    pub lda: usize,
    pub b: *const f32,
    pub ldb: usize,
    pub c: *mut f32,
    pub ldc: usize,
}
impl Operands {
    /// Operands without padding: each stride is its row's length.
    pub fn contiguous(
        m: usize,
        n: usize,
        k: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
    ) -> Self {
        Operands {
            m,
            n,
            k,
            a,
            lda: k,
            b,
            ldb: n,
            c,
            ldc: n,
        }
    }
}

// The pointers cross to pool threads, each of which writes disjoint columns
// of `c`; reading or writing through them is what [`sgemm`]'s contract covers.
unsafe impl Send for Operands {}
unsafe impl Sync for Operands {}

/// `C = A · B` for the shapes and strides of `ops`.
///
/// # Safety
/// The pointers must address arrays of those shapes and strides; `C` must not
/// overlap `A` or `B`; [`available`] must be true; `1 <= m <= MAX_ROWS`.
pub unsafe fn sgemm(ops: Operands) {
    let Operands { m, n, .. } = ops;
    debug_assert!((1..=MAX_ROWS).contains(&m) && available());
    let pool = pool();
    let threads = pool.map_or(1, |p| p.current_num_threads() + 1);
    // Whole 8-column vectors per thread, as even as they go; `busy` threads get some.
    let per = (n.div_ceil(8).div_ceil(threads) * 8).max(8);
    let busy = n.div_ceil(per);
    let Some(pool) = pool.filter(|_| busy > 1) else {
        // SAFETY: the caller's contract, over all columns.
        unsafe { columns(ops, 0, n) };
        return;
    };
    pool.in_place_scope(|s| {
        for t in 1..busy {
            let (lo, hi) = (t * per, ((t + 1) * per).min(n));
            // SAFETY: the caller's contract; the ranges are disjoint.
            s.spawn(move |_| unsafe { columns(ops, lo, hi) });
        }
        // SAFETY: as above, the first range, on this thread.
        unsafe { columns(ops, 0, per.min(n)) };
    });
}

/// Columns `lo..hi` of `C`, panel by panel.
unsafe fn columns(ops: Operands, lo: usize, hi: usize) {
    let mut p = lo;
    while p < hi {
        let width = PANEL.min(hi - p);
        // Eight rows at a time (more accumulators than registers spill);
        // the later groups read this panel of `B` again from cache.
        let mut r = 0;
        while r < ops.m {
            let group = Operands {
                a: ops.a.wrapping_add(r * ops.lda),
                c: ops.c.wrapping_add(r * ops.ldc),
                m: GROUP.min(ops.m - r),
                ..ops
            };
            // SAFETY: forwarded contract; rows `r..r + group.m` and columns
            // `p..p + width` are inside `C`.
            unsafe { dispatch(group, p, width) };
            r += GROUP;
        }
        p += width;
    }
}

unsafe fn dispatch(ops: Operands, col: usize, width: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `available()` was checked by the caller; 1 <= m <= GROUP.
    unsafe {
        macro_rules! rows {
            ($($m:literal)*) => {
                match ops.m { $($m => avx2::panel::<$m>(ops, col, width),)* _ => unreachable!() }
            };
        }
        rows!(1 2 3 4 5 6 7 8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ops, col, width);
        unreachable!("sgemm needs available()")
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Operands, K_BLOCK, PANEL};
    use std::arch::x86_64::*;

    /// `C[:, col..col + width] = A · B[:, col..col + width]` for `M` rows.
    // Index loops over the const `M` rows unroll into registers; iterators read worse here.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn panel<const M: usize>(ops: Operands, col: usize, width: usize) {
        let full = width / 8;
        let mut acc = [[_mm256_setzero_ps(); PANEL / 8]; M];
        let mut k0 = 0;
        // SAFETY (whole body): every load reads row `kk < k` of `B` at columns below
        // `col + full * 8 <= n`, or `A[r, kk]` with `r < M <= m`; stores go to `C`'s rows `< m`.
        unsafe {
            while k0 < ops.k {
                let kb = K_BLOCK.min(ops.k - k0);
                for v in 0..full {
                    let mut c = [_mm256_setzero_ps(); M];
                    for r in 0..M {
                        c[r] = acc[r][v];
                    }
                    for kk in k0..k0 + kb {
                        let bv = _mm256_loadu_ps(ops.b.add(kk * ops.ldb + col + v * 8));
                        for r in 0..M {
                            let av = _mm256_broadcast_ss(&*ops.a.add(r * ops.lda + kk));
                            c[r] = _mm256_fmadd_ps(av, bv, c[r]);
                        }
                    }
                    for r in 0..M {
                        acc[r][v] = c[r];
                    }
                }
                k0 += kb;
            }
            for r in 0..M {
                for v in 0..full {
                    _mm256_storeu_ps(ops.c.add(r * ops.ldc + col + v * 8), acc[r][v]);
                }
            }
            // The last < 8 columns: the same sums, one lane at a time.
            for j in col + full * 8..col + width {
                for r in 0..M {
                    let mut s = 0.0f32;
                    for kk in 0..ops.k {
                        s = (*ops.a.add(r * ops.lda + kk)).mul_add(*ops.b.add(kk * ops.ldb + j), s);
                    }
                    *ops.c.add(r * ops.ldc + j) = s;
                }
            }
        }
    }
}
