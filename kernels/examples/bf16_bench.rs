//! The bf16 products against the f32 ones on the calibration shapes of SmolLM2-135M
//! (`cargo run --release -p deco-kernels --example bf16_bench [TOKENS]`): GFLOP/s of
//! `dense::matmul` / `bf16::matmul` per projection and of `dense::gram` / `bf16::gram` per
//! Hessian width, median of 5 calls each, the two alternated.

use std::time::Instant;

fn values(seed: u64, len: usize) -> Vec<f32> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(8192);
    if !deco_kernels::bf16::available() {
        eprintln!("this CPU has no AVX-512 BF16: nothing to compare");
        return;
    }
    println!("{n} tokens, {} threads", rayon::current_num_threads());
    for (name, inner, out) in [("qkv", 576, 960), ("o", 576, 576), ("gate/up", 576, 3072), ("down", 1536, 576)] {
        let x = values(1, n * inner);
        let w = values(2, inner * out);
        let p = deco_kernels::bf16::PackedBf16::new(&w, inner, out).expect("pack");
        let mut y = vec![0.0f32; n * out];
        let (mut tf, mut tb) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let t = Instant::now();
            deco_kernels::dense::matmul(&x, n, &w, inner, out, &mut y).expect("f32");
            tf.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            deco_kernels::bf16::matmul(&x, n, &p, &mut y).expect("bf16");
            tb.push(t.elapsed().as_secs_f64());
        }
        let fl = 2.0 * (n * inner * out) as f64 / 1e9;
        println!("matmul {name:8} f32 {:6.1} GFLOP/s  bf16 {:6.1} GFLOP/s", fl / median(tf), fl / median(tb));
    }
    for cols in [576usize, 1536] {
        let x = values(3, n * cols);
        let (mut tf, mut tb) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let t = Instant::now();
            std::hint::black_box(deco_kernels::dense::gram(&x, n, cols).expect("f32"));
            tf.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            std::hint::black_box(deco_kernels::bf16::gram(&x, n, cols).expect("bf16"));
            tb.push(t.elapsed().as_secs_f64());
        }
        // The lower half: n · cols² / 2 multiply-adds.
        let fl = (n * cols * cols) as f64 / 1e9;
        println!("gram   {cols:<8} f32 {:6.1} GFLOP/s  bf16 {:6.1} GFLOP/s", fl / median(tf), fl / median(tb));
    }
}
