//! `cairn_blas::sgemm` against a float64 reference, over shapes, strides and row counts.

use cairn_blas::Operands;

/// A small deterministic generator (values in [-1, 1)).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn fill(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// `C = A · B` with padded strides, checked element by element against float64.
fn check(m: usize, n: usize, k: usize, pad: usize, seed: u64) {
    let (lda, ldb, ldc) = (k + pad, n + pad, n + 2 * pad);
    let mut rng = Lcg(seed);
    let a = rng.fill(m * lda);
    let b = rng.fill(k * ldb);
    let sentinel = 7.5f32;
    let mut c = vec![sentinel; m * ldc];
    unsafe {
        cairn_blas::sgemm(Operands {
            m,
            n,
            k,
            a: a.as_ptr(),
            lda,
            b: b.as_ptr(),
            ldb,
            c: c.as_mut_ptr(),
            ldc,
        })
    };
    for i in 0..m {
        for j in 0..ldc {
            let got = c[i * ldc + j];
            if j >= n {
                assert_eq!(got, sentinel, "wrote outside C at ({i}, {j})");
                continue;
            }
            let want: f64 = (0..k)
                .map(|l| a[i * lda + l] as f64 * b[l * ldb + j] as f64)
                .sum();
            let tol = 1e-5 * (k as f64).sqrt() * 4.0;
            assert!(
                (got as f64 - want).abs() <= tol,
                "m{m} n{n} k{k} ({i},{j}): {got} vs {want}"
            );
        }
    }
}

#[test]
fn matches_float64_over_shapes_and_strides() {
    if !cairn_blas::available() {
        return; // the kernel is x86-64 AVX2 only; callers check `available()`
    }
    let mut seed = 1;
    for m in 1..=cairn_blas::MAX_ROWS {
        for &(n, k) in &[
            (8, 1),
            (13, 64),
            (576, 576),
            (1539, 576),
            (1030, 3),
            (4096, 96),
        ] {
            for pad in [0, 5] {
                check(m, n, k, pad, seed);
                seed += 1;
            }
        }
    }
}

#[test]
fn a_rows_result_does_not_depend_on_the_other_rows() {
    if !cairn_blas::available() {
        return;
    }
    let (n, k) = (1000, 300);
    let mut rng = Lcg(42);
    let a = rng.fill(cairn_blas::MAX_ROWS * k);
    let b = rng.fill(k * n);
    // Each row on its own, then in every batch from 1 to MAX_ROWS rows.
    let mut alone = vec![0f32; cairn_blas::MAX_ROWS * n];
    for i in 0..cairn_blas::MAX_ROWS {
        let (row, out) = (a[i * k..].as_ptr(), alone[i * n..].as_mut_ptr());
        unsafe { cairn_blas::sgemm(Operands::contiguous(1, n, k, row, b.as_ptr(), out)) };
    }
    for m in 1..=cairn_blas::MAX_ROWS {
        let mut c = vec![0f32; m * n];
        unsafe {
            cairn_blas::sgemm(Operands::contiguous(
                m,
                n,
                k,
                a.as_ptr(),
                b.as_ptr(),
                c.as_mut_ptr(),
            ))
        };
        assert_eq!(
            &c[..],
            &alone[..m * n],
            "a row changed with {m} rows in the call"
        );
    }
}
