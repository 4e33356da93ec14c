//! AutoDeco head directories (`autodeco_config.json` + `autodeco_heads.safetensors`) as `deco
//! generate/serve --autodeco DIR` load them (`HostHeads::load`), then one prediction on a
//! hidden state and logits of the configured sizes (bounded). Input: a little-endian u16
//! length, that many bytes of the config, then the safetensors file.
#![no_main]

use deco_autodeco::HostHeads;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((config, st)) = deco_fuzz::split_pair(data) else { return };
    let d = deco_fuzz::scratch_dir("heads");
    deco_fuzz::write_pair(d, ("autodeco_config.json", config), ("autodeco_heads.safetensors", st));
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
