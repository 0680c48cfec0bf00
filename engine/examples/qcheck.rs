use ember_gguf::Gguf;
fn main() {
    let path = ember::models::resolve(&std::env::args().nth(1).unwrap(), &mut ember::models::NoProgress).unwrap();
    let g = Gguf::open(&path).unwrap();
    for name in ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight", "blk.3.ffn_gate.weight", "blk.0.attn_v.weight"] {
        let Some(info) = g.tensor(name) else { continue };
        let cols = info.dims[0] as usize; let rows = info.dims[1] as usize;
        let q = ember_quant::QMatrix::new(info.ty, rows, cols, g.tensor_data(info)).unwrap();
        let n_tokens = 5;
        let x: Vec<f32> = (0..n_tokens*cols).map(|i| (((i * 7919) % 1000) as f32 / 500.0 - 1.0)).collect();
        let mut out = vec![0f32; n_tokens*rows];
        ember_quant::matmul_f32(&q, &x, n_tokens, &mut out).unwrap();
        let mut out1 = vec![0f32; rows];
        ember_quant::matmul_f32(&q, &x[..cols], 1, &mut out1).unwrap();
        let mut row = vec![0f32; cols];
        let (mut maxerr, mut maxv, mut maxerr1) = (0f64, 0f64, 0f64);
        for r in 0..rows.min(2000) {
            q.dequantize_row(r, &mut row).unwrap();
            for t in 0..n_tokens {
                let exact: f64 = row.iter().zip(&x[t*cols..(t+1)*cols]).map(|(a,b)| *a as f64 * *b as f64).sum();
                maxerr = maxerr.max((exact - out[t*rows+r] as f64).abs());
                maxv = maxv.max(exact.abs());
                if t == 0 { maxerr1 = maxerr1.max((exact - out1[r] as f64).abs()); }
            }
        }
        println!("{name} {:?}: max |exact| {maxv:.4}, max err tiled {maxerr:.5}, rowwise {maxerr1:.5}", info.ty);
    }
}
