//! OpenAI request bodies as `deco serve` receives them: `deco_serve::prepare_completion` and
//! `prepare_chat` are exactly what the `/v1/completions` and `/v1/chat/completions` handlers run
//! before they submit to the engine (JSON, OpenAI and sampling fields, validation, chat template,
//! tokenization, and the compilation of output constraints: `response_format` JSON schemas,
//! `guided_regex`, `guided_grammar` through llguidance), with SmolLM2-135M-Instruct's tokenizer
//! and chat template. Input: one selector byte (even: completion, odd: chat), then the body. A
//! refused body must be a 400 with a message; an accepted one must have valid parameters and
//! non-empty prompts, and a compiled constraint must yield a mask with at least one token.
#![no_main]

use std::sync::OnceLock;

use deco_formats::chat_template::ChatTemplate;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use std::sync::Arc;

use deco_serve::{Grammars, RequestContext, prepare_chat, prepare_completion};
use libfuzzer_sys::fuzz_target;

struct Ctx {
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    grammars: Grammars,
}

fn ctx() -> &'static Ctx {
    static C: OnceLock<Ctx> = OnceLock::new();
    C.get_or_init(|| {
        let path = std::env::var("DECO_FUZZ_MODEL").expect("DECO_FUZZ_MODEL must name SmolLM2-135M-Instruct's GGUF (cargo xtask fuzz sets it)");
        let gguf = GgufFile::open(&path).expect("open the model");
        let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf).expect("tokenizer"));
        let template = ChatTemplate::new(tokenizer.chat_template().expect("chat template")).expect("compile the template");
        let grammars = Grammars::new(tokenizer.clone()).expect("structured-output compiler");
        Ctx { tokenizer, template, grammars }
    })
}

// The one-time setup (tokenizer, template, llguidance's token slices: about 2 s in this build)
// runs before the first input, so that libFuzzer's 1 s timeout measures inputs only.
fuzz_target!(init: {
    let _ = ctx();
}, |data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else { return };
    let c = ctx();
    let rc = RequestContext { tokenizer: &c.tokenizer, template: Some(&c.template), model_name: "m", max_sequence_tokens: 8192, grammars: Some(&c.grammars) };
    let r = if selector % 2 == 0 { prepare_completion(&rc, body) } else { prepare_chat(&rc, body) };
    match r {
        Ok(p) => {
            assert!(p.params.validate().is_ok());
            assert!(!p.prompts.is_empty());
            for prompt in &p.prompts {
                assert!(!prompt.is_empty());
                assert!(p.max_new_tokens_for(prompt.len()) >= 1);
            }
            if let Some(mut constraint) = p.constraint {
                let mut row = vec![0.0f32; c.tokenizer.vocab_size()];
                // A grammar may allow nothing (e.g. an unsatisfiable schema): that must be an
                // error, never a panic.
                if constraint.apply(&mut row).is_ok() {
                    assert!(row.iter().any(|x| x.is_finite()));
                }
            }
        }
        Err(e) => {
            assert_eq!(e.status().as_u16(), 400, "a bad request must be a 400: {}", e.message());
            assert!(!e.message().is_empty());
        }
    }
});
