//! Medusa head directories (`config.json` + `medusa_lm_head.safetensors`, the reference's names)
//! as `deco generate/serve --medusa DIR` read them (`medusa::load_blocks`), then the checks
//! against a model's sizes that `MedusaHeads::load` makes. Input: a little-endian u16 length,
//! that many bytes of the config, then the safetensors file.
#![no_main]

use deco_autodeco::medusa::{self, CONFIG_FILE, WEIGHTS_FILE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((config, st)) = deco_fuzz::split_pair(data) else { return };
    let d = deco_fuzz::scratch_dir("medusa");
    deco_fuzz::write_pair(d, (CONFIG_FILE, config), (WEIGHTS_FILE, st));
    let Ok((cfg, blocks)) = medusa::load_blocks(d) else { return };
    // What was accepted is complete and usable: a valid config, one block per head, the
    // declared shapes, finite weights.
    assert!(cfg.validate().is_ok());
    assert_eq!(blocks.len(), cfg.medusa_num_heads);
    let h = cfg.hidden_size;
    for b in &blocks {
        assert_eq!(b.weight.len(), h * h);
        assert_eq!(b.bias.len(), h);
        assert!(b.weight.iter().chain(&b.bias).all(|x| x.is_finite()));
    }
    // The model-size check: its own sizes pass, others are refused.
    assert!(cfg.check_model(h, cfg.vocab_size).is_ok());
    assert!(cfg.check_model(h ^ 1, cfg.vocab_size).is_err());
});
