//! AutoDeco on the real SmolLM2-135M-Instruct: a short training run on GSM train data lowers the
//! held-out loss and leaves the base untouched; decoding with heads (on the serving engine)
//! leaves greedy decoding unchanged and applies T × temperature, clamp(P × top_p).

use burn::tensor::Device;
use deco_autodeco::data::{chat_example, collect_tokens, read_gsm_jsonl, strip_calculator};
use deco_autodeco::decode::combine;
use deco_autodeco::heads::{AutoDecoConfig, AutoDecoHeads, HeadOutput, HostHeads};
use deco_autodeco::train::{FrozenHead, TrainConfig, train};
use deco_decoding::SamplingParams;
use deco_formats::chat_template::ChatTemplate;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_model::Llama;
use deco_model::host::to_host;
use deco_tests::{asset, smollm2_gguf};

fn load() -> (Llama, Tokenizer) {
    let path = smollm2_gguf();
    let model = Llama::load(&Checkpoint::open(&path).expect("open"), &Device::flex(), Some(2048)).expect("load");
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).expect("gguf")).expect("tokenizer");
    (model, tok)
}

#[test]
fn short_training_lowers_heldout_loss_and_keeps_the_base_frozen() {
    let (model, tok) = load();
    let template = ChatTemplate::new(tok.chat_template().expect("template")).expect("template");
    let items = read_gsm_jsonl(&asset("data/gsm_train.jsonl")).expect("data");
    let examples: Vec<_> = items
        .iter()
        .take(14)
        .map(|it| chat_example(&tok, &template, &it.question, &strip_calculator(&it.answer)).expect("example"))
        .collect();
    // The answer ends with the template's end-of-turn token.
    assert!(examples.iter().all(|e| tok.is_eos(*e.answer.last().expect("answer"))));
    let train_pool = collect_tokens(&model, &examples[..10], &mut |_, _| {}).expect("train pool");
    let held_pool = collect_tokens(&model, &examples[10..], &mut |_, _| {}).expect("held pool");
    assert!(train_pool.len() > 500 && held_pool.len() > 100, "{} / {}", train_pool.len(), held_pool.len());
    let head_before = to_host(model.lm_head().clone()).expect("lm head");
    let cfg = AutoDecoConfig::new(model.config.hidden_size, model.config.vocab_size);
    let tc = TrainConfig { steps: 40, batch_size: 16, eval_every: 0, max_heldout: 128, ..TrainConfig::default() };
    let head = FrozenHead { weight: model.lm_head().clone(), device: model.device().clone() };
    let (heads, log) = train(&cfg, &tc, &train_pool, &held_pool, &head, &mut |_| {}).expect("train");
    let first = log.first().expect("log");
    let last = log.last().expect("log");
    let before = first.heldout_temp + first.heldout_top_p;
    let after = last.heldout_temp + last.heldout_top_p;
    assert!(after < 0.9 * before, "held-out loss {before} -> {after}");
    assert_eq!(to_host(model.lm_head().clone()).expect("lm head"), head_before, "the base must stay frozen");
    assert_eq!(heads.config().num_params(), cfg.num_params());
    assert_eq!(cfg.num_params(), 576 * 256 + 256 + 256 + 1 + 581 * 256 + 256 + 256 + 1);
}

/// One request on the serving engine with `heads`: its tokens (an end token not included) and
/// the heads' `(T, P)` per token.
fn on_engine(model: &Llama, tok: &Tokenizer, heads: Option<HostHeads>, prompt: &[u32], params: &SamplingParams) -> (Vec<u32>, Vec<(f32, f32)>) {
    let options = deco_serve::EngineOptions { autodeco: heads, ..Default::default() };
    let (engine, join) = deco_serve::spawn_engine_opts(model.clone(), std::sync::Arc::new(tok.clone()), deco_serve::EngineConfig::default(), options).expect("engine");
    let (_, mut rx) = engine.submit(deco_serve::GenerateRequest::sample(prompt.to_vec(), params.clone(), 1)).expect("submit");
    let (mut ids, mut tp) = (Vec::new(), Vec::new());
    loop {
        match rx.blocking_recv().expect("event") {
            deco_serve::EngineEvent::Delta { tokens, .. } => {
                for t in tokens {
                    ids.push(t.id);
                    tp.extend(t.autodeco);
                }
            }
            deco_serve::EngineEvent::Finished { .. } => break,
            deco_serve::EngineEvent::Failed(e) => panic!("engine: {e}"),
        }
    }
    drop((rx, engine));
    join.join().expect("engine thread");
    (ids, tp)
}

/// Decoding with heads (on the serving engine): every token's reported `(T, P)` lies in the
/// heads' ranges and the sampling parameters are `T × temperature`, `clamp(P × top_p)`;
/// greedy decoding with heads is plain greedy decoding, and its parameters are unchanged.
#[test]
fn decoding_with_heads_applies_t_and_p_and_leaves_greedy_alone() {
    let (model, tok) = load();
    let device = Device::flex();
    device.seed(1);
    let cfg = AutoDecoConfig::new(model.config.hidden_size, model.config.vocab_size);
    let heads = AutoDecoHeads::init(&cfg, &device).expect("init").to_host(&cfg).expect("host");
    let prompt = tok.encode("Once upon a time", true).expect("encode");
    let sampled = SamplingParams { temperature: Some(0.8), top_p: Some(0.9), seed: Some(11), max_new_tokens: Some(12), ..Default::default() };
    let (ids, tp) = on_engine(&model, &tok, Some(heads.clone()), &prompt, &sampled);
    assert!(!ids.is_empty() && tp.len() == ids.len(), "{} tokens, {} predictions", ids.len(), tp.len());
    for &(t, p) in &tp {
        assert!(t > 0.0 && t < 2.0 && p > 0.0 && p < 1.0);
        let used = combine(&sampled, HeadOutput { temperature: t, top_p: p });
        assert!((used.temperature.expect("T") - (0.8 * t).max(1e-2)).abs() < 1e-6);
        assert!((used.top_p.expect("P") - (0.9 * p).clamp(0.0, 1.0)).abs() < 1e-6);
    }
    // Greedy stays greedy: same tokens as plain greedy decoding, predictions still reported.
    let greedy = SamplingParams { temperature: Some(0.0), max_new_tokens: Some(12), ..Default::default() };
    let (with, tp) = on_engine(&model, &tok, Some(heads), &prompt, &greedy);
    let (plain, none) = on_engine(&model, &tok, None, &prompt, &greedy);
    assert_eq!(with, plain);
    assert!(none.is_empty() && tp.len() == with.len());
    assert_eq!(combine(&greedy, HeadOutput { temperature: tp[0].0, top_p: tp[0].1 }), greedy);
}

/// The heads trained by `cargo xtask bench autodeco` and committed under `assets/` load, fit the
/// model, and on GSM eval answers (never seen in training) have a lower loss than the same
/// architecture freshly initialized.
#[test]
fn committed_smollm2_heads_beat_untrained_heads_on_eval_answers() {
    let (model, tok) = load();
    let dir = deco_tests::workspace_root().join("assets/autodeco/smollm2-135m-instruct-gsm");
    let trained = deco_autodeco::HostHeads::load(&dir).expect("committed heads");
    assert_eq!(trained.config().hidden_size, model.config.hidden_size);
    assert_eq!(trained.config().vocab_size, model.config.vocab_size);
    let template = ChatTemplate::new(tok.chat_template().expect("template")).expect("template");
    let items = read_gsm_jsonl(&asset("data/gsm_eval.jsonl")).expect("eval data");
    let examples: Vec<_> = items
        .iter()
        .take(3)
        .map(|it| chat_example(&tok, &template, &it.question, &strip_calculator(&it.answer)).expect("example"))
        .collect();
    let pool = collect_tokens(&model, &examples, &mut |_, _| {}).expect("pool");
    let head = FrozenHead { weight: model.lm_head().clone(), device: model.device().clone() };
    let rows: Vec<usize> = (0..pool.len()).collect();
    let cfg = trained.config().clone();
    let device = Device::flex();
    let lc = deco_autodeco::loss::LossConfig::default();
    let (tt, tp) = deco_autodeco::train::evaluate(&trained.to_module(&device), &cfg, &pool, &rows, &head, &lc, &device).expect("trained");
    device.seed(0);
    let fresh = AutoDecoHeads::init(&cfg, &device).expect("init");
    let (ft, fp) = deco_autodeco::train::evaluate(&fresh, &cfg, &pool, &rows, &head, &lc, &device).expect("fresh");
    assert!(tt + tp < 0.8 * (ft + fp), "trained {} vs untrained {}", tt + tp, ft + fp);
}

/// The meta-instruction stage on the real model: from the committed heads, a short ranking stage
/// on training phrasings orders T for held-out questions with held-out phrasings.
#[test]
fn meta_instruction_stage_orders_temperature_on_heldout_phrasings() {
    use deco_autodeco::meta::{MetaConfig, Phrasings, collect_meta, measure, train_meta};
    let (model, tok) = load();
    let stage_one = deco_autodeco::HostHeads::load(&deco_tests::workspace_root().join("assets/autodeco/smollm2-135m-instruct-gsm")).expect("committed heads");
    let template = ChatTemplate::new(tok.chat_template().expect("template")).expect("template");
    let items = read_gsm_jsonl(&asset("data/gsm_train.jsonl")).expect("data");
    let indexed: Vec<_> = items.iter().enumerate().take(14).collect();
    let train_pool = collect_meta(&model, &tok, &template, &indexed[..10], Phrasings::TrainOnePerPrompt, 12, 0, &mut |_, _| {}).expect("train pool");
    let held_pool = collect_meta(&model, &tok, &template, &indexed[10..], Phrasings::HeldOutAll, 12, 0, &mut |_, _| {}).expect("held pool");
    assert!(train_pool.iter().all(|q| q.low.len() == 1 && q.high.len() == 1 && q.rows == 12));
    assert!(held_pool.iter().all(|q| q.low.len() == 3 && q.high.len() == 3));
    let head = FrozenHead { weight: model.lm_head().clone(), device: model.device().clone() };
    let logits = |h: &[f32], n: usize| head.logits(h, n);
    let (before, _) = measure(&stage_one, &held_pool, &logits).expect("measure");
    // The top-p head left out (margin_p 0): the committed heads saturate P at 1, and no logits
    // are needed per step.
    let mc = MetaConfig { steps: 400, margin_p: 0.0, anchor_weight: 10.0, ..MetaConfig::default() };
    let (heads, _) = train_meta(&stage_one, &train_pool, &head, &mc, &mut |_| {}).expect("train");
    let (after, _) = measure(&heads, &held_pool, &logits).expect("measure");
    assert!(after.frac_t_order >= 0.9 && after.frac_t_order > before.frac_t_order, "order {} -> {}", before.frac_t_order, after.frac_t_order);
    assert!(after.delta_t_low <= -0.05 && after.delta_t_high >= 0.05, "{after:?}");
    // Heads for another model are refused.
    let other = deco_autodeco::heads::AutoDecoConfig::new(64, model.config.vocab_size);
    let wrong = AutoDecoHeads::init(&other, &Device::flex()).expect("init").to_host(&other).expect("host");
    assert!(train_meta(&wrong, &train_pool, &head, &mc, &mut |_| {}).is_err());
}
