//! AutoDeco head directories (`autodeco_config.json` + `autodeco_heads.safetensors`) as `deco
//! generate/serve --autodeco DIR` load them (`HostHeads::load`), then one prediction on a
//! hidden state and logits of the configured sizes (bounded). Input: a little-endian u16
//! length, that many bytes of the config, then the safetensors file.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use deco_autodeco::HostHeads;
use libfuzzer_sys::fuzz_target;

fn dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let d = base.join(format!("deco-fuzz-heads-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("fuzz scratch directory");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let n = usize::from(u16::from_le_bytes([data[0], data[1]])).min(data.len() - 2);
    let (config, st) = data[2..].split_at(n);
    let d = dir();
    std::fs::write(d.join("autodeco_config.json"), config).expect("write config");
    std::fs::write(d.join("autodeco_heads.safetensors"), st).expect("write weights");
    let Ok(h) = HostHeads::load(d) else { return };
    let cfg = h.config().clone();
    if cfg.hidden_size > 1 << 16 || cfg.vocab_size > 1 << 17 {
        return;
    }
    assert!(cfg.validate().is_ok());
    let hidden: Vec<f32> = (0..cfg.hidden_size).map(|i| (i as f32 * 0.37).sin()).collect();
    let logits: Vec<f32> = (0..cfg.vocab_size).map(|i| (i as f32 * 0.11).cos() * 4.0).collect();
    if let Ok(out) = h.predict(&hidden, &logits) {
        assert!((0.0..=2.0).contains(&out.temperature) && (0.0..=1.0).contains(&out.top_p), "{out:?}");
    }
    // Wrong sizes are errors.
    assert!(h.predict(&hidden[..cfg.hidden_size - 1], &logits).is_err() || cfg.hidden_size == 0);
});
