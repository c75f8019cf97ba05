//! Times `cairn_blas::sgemm` over one decode step's products of SmolLM2-135M
//! (30 layers' weights, streamed from memory) at 1, 8 and 16 rows.
use std::time::Instant;

use cairn_blas::Operands;

fn main() {
    assert!(cairn_blas::available());
    let shapes = [
        (576, 1536),
        (576, 1536),
        (1536, 576),
        (576, 576),
        (576, 576),
        (576, 192),
        (576, 192),
    ];
    let layers = 30;
    let weights: Vec<(usize, usize, Vec<f32>)> = (0..layers)
        .flat_map(|l| {
            shapes.iter().map(move |&(k, n)| {
                (
                    k,
                    n,
                    (0..k * n).map(|i| ((i + l) % 7) as f32 * 0.01).collect(),
                )
            })
        })
        .collect();
    let head = (576usize, 49152usize, vec![0.01f32; 576 * 49152]);
    for rows in [1usize, 8, 16] {
        let a: Vec<f32> = (0..rows * 1536).map(|i| (i % 5) as f32).collect();
        let mut c = vec![0f32; rows * 49152];
        let mut best = (f64::MAX, f64::MAX);
        for _ in 0..7 {
            let t = Instant::now();
            for (k, n, w) in &weights {
                unsafe {
                    cairn_blas::sgemm(Operands::contiguous(
                        rows,
                        *n,
                        *k,
                        a.as_ptr(),
                        w.as_ptr(),
                        c.as_mut_ptr(),
                    ))
                };
            }
            let layers_ms = t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            unsafe {
                cairn_blas::sgemm(Operands::contiguous(
                    rows,
                    head.1,
                    head.0,
                    a.as_ptr(),
                    head.2.as_ptr(),
                    c.as_mut_ptr(),
                ))
            };
            let head_ms = t.elapsed().as_secs_f64() * 1e3;
            best = (best.0.min(layers_ms), best.1.min(head_ms));
        }
        println!(
            "rows {rows}: layers {:.1} ms, head {:.1} ms",
            best.0, best.1
        );
    }
}
