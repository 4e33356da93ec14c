//! Chat template tests: the real templates stored in the shared GGUF files, and the
//! transformers-specific parts of the Jinja environment. Expected strings are written by hand
//! from the template source and Jinja's semantics (`trim_blocks`, `lstrip_blocks`).

use deco_formats::Error;
use deco_formats::chat_template::{ChatMessage, ChatTemplate};
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;

mod common;

fn gguf_template(rel: &str) -> String {
    let gguf = GgufFile::open(common::asset(rel)).expect("open gguf");
    gguf.get_str("tokenizer.chat_template").expect("chat template").to_owned()
}

fn smollm2_template() -> ChatTemplate {
    ChatTemplate::new(gguf_template("models/SmolLM2-135M-Instruct.Q4_1.gguf")).expect("compile")
}

fn msgs(list: &[(&str, &str)]) -> Vec<ChatMessage> {
    list.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect()
}

#[test]
fn smollm2_system_and_user() {
    let t = smollm2_template();
    let out = t
        .render(&msgs(&[("system", "You are terse."), ("user", "Hi")]), true, "<|im_start|>", "<|im_end|>")
        .expect("render");
    assert_eq!(
        out,
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn smollm2_default_system_prompt() {
    // The template inserts its own system message when the first message is not a system one.
    let t = smollm2_template();
    let out = t.render(&msgs(&[("user", "Hi")]), true, "<|im_start|>", "<|im_end|>").expect("render");
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    // Multi-turn, no generation prompt.
    let out =
        t.render(&msgs(&[("user", "2+2?"), ("assistant", "4"), ("user", "Thanks")]), false, "", "").expect("render");
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n"
    );
    // No messages: nothing but the generation prompt.
    assert_eq!(t.render(&[], true, "", "").expect("render"), "<|im_start|>assistant\n");
}

#[test]
fn smollm2_prompt_tokenizes_with_special_tokens() {
    let gguf = GgufFile::open(common::smollm2_gguf()).expect("open");
    let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
    let t = ChatTemplate::new(tok.chat_template().expect("template")).expect("compile");
    let prompt = t
        .render(&msgs(&[("system", "S"), ("user", "Hi")]), true, &tok.bos_token().unwrap_or_default(), "")
        .expect("render");
    let ids = tok.encode(&prompt, true).expect("encode");
    // <|im_start|> = 1, <|im_end|> = 2, "\n" = 198.
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2);
    assert_eq!(ids.last(), Some(&198));
}

#[test]
fn qwen2_default_system_prompt() {
    let t = ChatTemplate::new(gguf_template("tokenizer-tests/ggml-vocab-qwen2.gguf")).expect("compile");
    let out = t.render(&msgs(&[("user", "Hello")]), true, "", "").expect("render");
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn trim_blocks_and_lstrip_blocks_like_transformers() {
    let src = "{% for message in messages %}\n    {% if message.role == 'system' %}\n<<SYS>>{{ message.content | trim }}<</SYS>>\n    {% else %}\n[{{ message.role | upper }}] {{ message['content'].strip() }}\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}[ASSISTANT]{% endif %}\n";
    let t = ChatTemplate::new(src).expect("compile");
    let out = t.render(&msgs(&[("system", "  sys "), ("user", " hi\n")]), true, "", "").expect("render");
    // Block-tag lines vanish entirely; the template's final newline is dropped.
    assert_eq!(out, "<<SYS>>sys<</SYS>>\n[USER] hi\n[ASSISTANT]");
}

#[test]
fn bos_eos_variables_and_python_methods() {
    let src = "{{ bos_token }}{% for m in messages %}{% if m.content.startswith('!') %}{% continue %}{% endif %}{{ m.role.title() }}: {{ m.content.replace('a', 'A') }}{{ eos_token }}{% endfor %}{% for k, v in {'x': 1}.items() %}{{ k }}={{ v }}{% endfor %}";
    let t = ChatTemplate::new(src).expect("compile");
    let out = t
        .render(&msgs(&[("user", "banana"), ("user", "!skip"), ("assistant", "ok")]), false, "<s>", "</s>")
        .expect("render");
    assert_eq!(out, "<s>User: bAnAnA</s>Assistant: ok</s>x=1");
}

#[test]
fn tojson_is_python_json_dumps() {
    let t = ChatTemplate::new("{{ tools | tojson }}|{{ messages | tojson }}|{{ tools[0] | tojson(indent=2) }}")
        .expect("compile");
    let extra = serde_json::json!({"tools": [{"name": "get_weather", "parameters": {"city": "Zürich <x>", "days": 3, "scale": 1.5, "ok": true, "none": null}}]});
    let out = t.render_with(&msgs(&[("user", "Hi \"there\"")]), false, "", "", &extra).expect("render");
    // Keys keep the order of the JSON they came from, as Python's json.loads + json.dumps
    // (transformers' `tojson`, `sort_keys=False`) keep it; message fields keep theirs.
    assert_eq!(
        out,
        "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Zürich <x>\", \"days\": 3, \"scale\": 1.5, \"ok\": true, \"none\": null}}]\
         |[{\"role\": \"user\", \"content\": \"Hi \\\"there\\\"\"}]\
         |{\n  \"name\": \"get_weather\",\n  \"parameters\": {\n    \"city\": \"Zürich <x>\",\n    \"days\": 3,\n    \"scale\": 1.5,\n    \"ok\": true,\n    \"none\": null\n  }\n}"
    );
    let t = ChatTemplate::new("{{ 'é\n' | tojson(ensure_ascii=true) }}").expect("compile");
    assert_eq!(t.render(&[], false, "", "").expect("render"), "\"\\u00e9\\n\"");
}

#[test]
fn raise_exception_fails_with_message() {
    let src = "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('Conversation roles must be user/assistant') }}{% endif %}{{ m.content }}{% endfor %}";
    let t = ChatTemplate::new(src).expect("compile");
    assert_eq!(t.render(&msgs(&[("user", "a"), ("assistant", "b")]), false, "", "").expect("render"), "ab");
    let err = t.render(&msgs(&[("system", "x")]), false, "", "").expect_err("must raise");
    assert!(matches!(err, Error::ChatTemplate(_)));
    assert!(err.to_string().contains("Conversation roles must be user/assistant"), "{err}");
}

#[test]
fn strftime_now_formats_current_date() {
    let t = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}").expect("compile");
    let out = t.render(&[], false, "", "").expect("render");
    let parts: Vec<&str> = out.split('-').collect();
    assert_eq!(parts.len(), 3, "{out}");
    assert!(parts[0].parse::<u32>().is_ok_and(|y| y >= 2024), "{out}");
    assert!(parts[1].parse::<u32>().is_ok_and(|m| (1..=12).contains(&m)), "{out}");
    assert!(parts[2].parse::<u32>().is_ok_and(|d| (1..=31).contains(&d)), "{out}");
}

#[test]
fn bad_templates_are_clear_errors() {
    let err = ChatTemplate::new("line one\n{% for m in messages %}{{ m.content }}").expect_err("unclosed for");
    let msg = err.to_string();
    assert!(matches!(err, Error::ChatTemplate(_)));
    assert!(msg.starts_with("chat template: syntax error"), "{msg}");
    assert!(msg.contains("line"), "{msg}");

    // minijinja resolves filters when rendering (Jinja2 when compiling): an error either way.
    let err = ChatTemplate::new("{{ messages[0].content | no_such_filter }}")
        .and_then(|t| t.render(&msgs(&[("user", "x")]), false, "", ""))
        .expect_err("unknown filter");
    assert!(err.to_string().contains("no_such_filter"), "{err}");

    // Runtime failures are errors too, never panics.
    let t = ChatTemplate::new("{{ messages[0].content.no_such_method() }}").expect("compile");
    assert!(t.render(&msgs(&[("user", "x")]), false, "", "").is_err());
    let t = ChatTemplate::new("{{ messages[0].content.missing.deeper }}").expect("compile");
    assert!(t.render(&msgs(&[("user", "x")]), false, "", "").is_err());
    let err = t.render_with(&[], false, "", "", &serde_json::json!([1])).expect_err("extra must be an object");
    assert!(err.to_string().contains("object"), "{err}");
}

/// Hostile templates (issue 17): runaway loops and recursion stop with an error naming the
/// cause, quickly, instead of hanging. (Not covered: a template that doubles a string ~40 times
/// exhausts memory in a few instructions; minijinja has no value-size limit. docs/reliability.md.)
#[test]
fn hostile_templates_stop_with_an_error() {
    for (src, needle) in [
        ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "fuel"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
    ] {
        let t = ChatTemplate::new(src).expect("compiles");
        let start = std::time::Instant::now();
        let err = t.render(&msgs(&[("user", "Hi")]), true, "", "").expect_err("must not render");
        let msg = err.to_string();
        assert!(msg.contains(needle), "{src}: {msg}");
        assert!(start.elapsed() < std::time::Duration::from_secs(5), "{src}: took {:?}", start.elapsed());
    }
    // A huge tojson indent is refused instead of allocated.
    let t = ChatTemplate::new("{{ messages | tojson(indent=100000000000) }}").expect("compiles");
    let err = t.render(&msgs(&[("user", "Hi")]), true, "", "").expect_err("huge indent");
    assert!(err.to_string().contains("indent"), "{err}");
}

/// Doubling in a loop (`ns.s = ns.s ~ ns.s`, `ns.l = ns.l + ns.l`, `replace`) would need 2^100
/// bytes in a few hundred instructions. minijinja charges fuel for every byte and list slot an
/// operator produces, checked before it allocates, and deco's patch charges the slots of a lazy
/// list concatenation when it is materialized (third_party/README.md), so each render stops with
/// "out of fuel" once the budget's bytes are spent (64 per unit of `render_fuel`, about 3 MiB
/// here) instead of exhausting memory.
#[test]
fn doubling_stops_at_the_render_budget() {
    let lazy = "{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l + ns.l %}{% endfor %}";
    for src in [
        "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
        "{% set ns = namespace(s='xy') %}{% for i in range(100) %}{% set ns.s = ns.s|replace('x', ns.s) %}{% endfor %}{{ ns.s|length }}",
        &format!("{lazy}{{{{ ns.l|length }}}}"),
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l|select %}{% endfor %}{{ ns.l|length }}",
    ] {
        let t = ChatTemplate::new(src).expect("compiles");
        let start = std::time::Instant::now();
        let err = t.render(&msgs(&[("user", "Hi")]), true, "", "").expect_err("must not render");
        assert!(err.to_string().contains("fuel"), "{src}: {err}");
        assert!(start.elapsed() < std::time::Duration::from_secs(5), "{src}: took {:?}", start.elapsed());
    }
}

/// A list doubled 19 times has 2^19 items, most of them lazy (deco's patch materializes, and
/// charges, every fifth level: the 20th doubling is over the budget). Whatever consumes it is
/// bounded: the filters that visit items run out of fuel, `tojson` is charged per item, and
/// printing it (`|string`, `~`) stops after 100,000 items with `...` (deco's patch).
#[test]
fn consuming_a_lazily_doubled_list_is_bounded() {
    let lazy = "{% set ns = namespace(l=[1]) %}{% for i in range(19) %}{% set ns.l = ns.l + ns.l %}{% endfor %}";
    let tails = ["{{ ns.l|join(',')|length }}", "{{ ns.l|tojson|length }}", "{{ ns.l|list|length }}", "{{ 2 in ns.l }}", "{{ ns.l|sum }}"];
    for tail in tails.into_iter().chain(["{{ ns.l|batch(3)|list|length }}", "{{ [ns.l, ns.l|list]|sort|length }}"]) {
        let t = ChatTemplate::new(format!("{lazy}{tail}")).expect("compiles");
        let start = std::time::Instant::now();
        let err = t.render(&msgs(&[("user", "Hi")]), true, "", "").expect_err("must not render");
        assert!(err.to_string().contains("fuel"), "{tail}: {err}");
        assert!(start.elapsed() < std::time::Duration::from_secs(60), "{tail}: took {:?}", start.elapsed());
    }
    // Used as a map key or in `unique`, it is hashed by its first 100,000 items (deco's patch).
    for tail in ["{{ {ns.l: 1}|length }}", "{{ [ns.l, ns.l]|unique|list|length }}"] {
        let t = ChatTemplate::new(format!("{lazy}{tail}")).expect("compiles");
        assert_eq!(t.render(&msgs(&[("user", "Hi")]), true, "", "").expect("render"), "1", "{tail}");
    }
    // Printing it costs more than a short conversation's budget; with a long message (the budget
    // grows with the input) it completes, truncated.
    let t = ChatTemplate::new(format!("{lazy}{{{{ ns.l|length }}}}|{{{{ (ns.l|string)[-30:] }}}}|{{{{ ('' ~ ns.l)|length }}}}")).expect("compiles");
    let err = t.render(&msgs(&[("user", "Hi")]), true, "", "").expect_err("over the base budget");
    assert!(err.to_string().contains("fuel"), "{err}");
    let long = "x".repeat(1_000_000);
    let out = t.render(&msgs(&[("user", long.as_str())]), true, "", "").expect("render");
    let parts: Vec<&str> = out.split('|').collect();
    assert_eq!(parts[0], (1u64 << 19).to_string());
    // minijinja's "omitted" marker: `..., ... N more]`.
    assert!(parts[1].ends_with(&format!("... {} more]", (1u64 << 19) - 100_000)), "{out}");
    let printed: usize = parts[2].parse().expect("a length");
    assert!(printed < 1_000_000, "{out}");
}

/// A namespace that contains itself, and lists nested a hundred thousand deep, must not
/// overflow the stack: printing, comparing and hashing stop descending at depth 500 (deco's
/// patch prints `...` there, as Python prints `[...]` for a recursive list), `tojson` refuses
/// nesting over 512, and the render runs on a thread whose stack holds the recursive drop of the
/// deepest nesting the budget allows.
#[test]
fn cyclic_and_deeply_nested_values_do_not_overflow_the_stack() {
    let t = ChatTemplate::new("{% set ns = namespace() %}{% set ns.a = ns %}{{ ns }}|{{ [ns]|unique|list|length }}|{{ ns == ns }}").expect("compiles");
    let out = t.render(&msgs(&[("user", "Hi")]), true, "", "").expect("render");
    assert!(out.contains("...") && out.ends_with("|1|True"), "{}", &out[out.len().saturating_sub(300)..]);
    let t = ChatTemplate::new("{% set ns = namespace() %}{% set ns.a = ns %}{{ ns|tojson }}").expect("compiles");
    let err = t.render(&msgs(&[("user", "Hi")]), true, "", "").expect_err("cyclic tojson");
    assert!(err.to_string().contains("nesting deeper than 512"), "{err}");

    let nest = |body: &str, tail: &str| {
        format!("{{% set ns = namespace(l=[]) %}}{{% for j in range(10) %}}{{% for i in range(100000) %}}{body}{{% endfor %}}{{% endfor %}}{tail}")
    };
    for src in [
        nest("{% set ns.l = [ns.l] %}", "{{ ns.l }}"),
        nest("{% set ns.l = {'a': ns.l} %}", "{{ ns.l == ns.l }}"),
        nest("{% set ns.l = ns.l|select %}", "{{ ns.l|list }}"),
    ] {
        let t = ChatTemplate::new(src.as_str()).expect("compiles");
        let err = t.render(&msgs(&[("user", "Hi")]), true, "", "").expect_err("must run out of fuel");
        assert!(err.to_string().contains("fuel"), "{src}: {err}");
    }
    // 2,000 levels fit the budget: printed up to depth 500, then `...`.
    let t = ChatTemplate::new("{% set ns = namespace(l=[]) %}{% for i in range(2000) %}{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l }}").expect("compiles");
    let out = t.render(&msgs(&[("user", "Hi")]), true, "", "").expect("render");
    assert!(out.starts_with(&"[".repeat(500)) && out.contains("..."), "{}", &out[..600.min(out.len())]);
}

/// Seventh session (found from the fuzzer's open compile-time timeout, then by reading the
/// parser): an operator chain, unary operators, postfix operators, filters, tests, conditional
/// expressions and assignment targets nest the expression tree one level per operator with no
/// limit, and compiling (and dropping) the tree recursed once per level, so a template of a few
/// hundred kilobytes aborted the process with a stack overflow while loading the model. Each
/// such chain of 300,000 is now a syntax error; 450 levels compile, on a 2 MiB thread (a tokio
/// worker's stack), and render to the value Python computes. Constant folding looks at most 16
/// levels down (it walked the whole chain at every level: quadratic), so a long constant chain
/// is partly folded and partly evaluated; the value is the same.
#[test]
fn long_expression_chains_are_an_error_not_a_stack_overflow() {
    let chains: [(&str, &str, &str, &str); 12] = [
        ("{{ x", "-1", " }}", "-445"),
        ("{{ 1", "-1", " }}", "-449"),
        ("{{ 1.5-False", "-1", " }}", "-448.5"),
        ("{{ ", "- ", "x }}", "5"),
        ("{{ ", "not ", "x }}", "True"),
        ("{{ x", "|abs", " }}", "5"),
        ("{{ x", " is number", " }}", "True"),
        ("{{ x", " if x else 0", " }}", "5"),
        ("{{ m", ".a", " }}", "None"),
        ("{{ m", "['a']", " }}", "None"),
        ("{{ l", "[:]", " }}", "[1]"),
        ("{% set ns = namespace(a=1) %}{% set ns", ".a", " = 2 %}{{ ns.a }}", "2"),
    ];
    let render = |src: &str| {
        let src = src.to_owned();
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let t = ChatTemplate::new(src)?;
                t.render_with(&msgs(&[("user", "Hi")]), true, "", "", &serde_json::json!({"x": 5, "m": {"a": null}, "l": [1]}))
            })
            .expect("thread")
            .join()
            .expect("no panic")
    };
    for (head, op, tail, want) in chains {
        let long = format!("{head}{}{tail}", op.repeat(300_000));
        let err = render(&long).expect_err("a 300,000-level chain must be refused");
        assert!(matches!(err, Error::ChatTemplate(_)) && err.to_string().contains("nests too deeply"), "{head}{op}...: {err}");
        if op == "['a']" || op == ".a" && head.starts_with("{%") {
            // Each level would need its own value to be nested 450 deep; one level says
            // the construct still works.
            let short = format!("{head}{op}{tail}");
            assert_eq!(render(&short).expect("one level renders"), want, "{short}");
            continue;
        }
        let ok = format!("{head}{}{tail}", op.repeat(450));
        match render(&ok) {
            Ok(out) => assert_eq!(out, want, "{head}{op}x450{tail}"),
            // `m.a.a...`: `None.a` is undefined in minijinja as in Jinja2.
            Err(e) if op == ".a" => assert!(e.to_string().contains("undefined"), "{e}"),
            Err(e) => panic!("{head}{op}x450{tail}: {e}"),
        }
    }
    let nested_target = format!("{{% for {}x{} in [1] %}}{{{{ x }}}}{{% endfor %}}", "(".repeat(300_000), ")".repeat(300_000));
    assert!(render(&nested_target).expect_err("nested target").to_string().contains("nests too deeply"));
    let nested_target = format!("{{% for {}x{} in [7] %}}{{{{ x }}}}{{% endfor %}}", "(".repeat(400), ")".repeat(400));
    assert_eq!(render(&nested_target).expect("400 parentheses"), "7");
}

/// Fuzzing finding (chat_template, 2026-12-01): `{{92222*[]*22**2-}}` took 2.6 s in one
/// instruction under minijinja 2.24, which repeated an empty sequence by iterating it `n` times
/// (44.6 M empty iterations here; with these factors it would never end). minijinja 3.1 returns
/// an empty list at once; the output must be `[]`.
#[test]
fn repeating_an_empty_sequence_is_immediate() {
    let t = ChatTemplate::new("{{ 1000000000 * [] * 1000000000 }}|{{92222*[]*22**2-}}").expect("compiles");
    assert_eq!(t.render(&msgs(&[("user", "Hi")]), true, "", "").expect("render"), "[]|[]");
}

/// The render budget does not bind real use: 20,000 messages through the SmolLM2 and Qwen2
/// templates render completely, and so does one message of 4 MB (the budget grows with the
/// input: `render_fuel`).
#[test]
fn long_conversations_fit_the_render_budget() {
    let turns: Vec<(&str, &str)> = (0..10_000).flat_map(|_| [("user", "What is 2+2?"), ("assistant", "4.")]).collect();
    for t in [smollm2_template(), ChatTemplate::new(gguf_template("tokenizer-tests/ggml-vocab-qwen2.gguf")).expect("compile")] {
        let out = t.render(&msgs(&turns), true, "", "<|im_end|>").expect("render");
        assert_eq!(out.matches("What is 2+2?").count(), 10_000);
        let big = "word ".repeat(800_000);
        let out = t.render(&msgs(&[("user", big.as_str())]), true, "", "<|im_end|>").expect("render a 4 MB message");
        assert!(out.contains(&big));
    }
    use deco_formats::chat_template::{RENDER_FUEL_BASE, RENDER_FUEL_PER_MESSAGE, render_fuel};
    let two = msgs(&[("user", "Hi"), ("assistant", "Hello")]);
    let bytes = serde_json::to_vec(&two).expect("json").len() as u64 + 4; // + `null`
    assert_eq!(render_fuel(&two, &serde_json::Value::Null), RENDER_FUEL_BASE + 2 * RENDER_FUEL_PER_MESSAGE + bytes);
}
