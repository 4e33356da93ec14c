//! Decoding with the heads: at every step the heads read the position's final hidden state and
//! raw logits and predict `(T, P)`; the token is then sampled with
//! `temperature = T × user temperature` and `top_p = clamp(P × user top_p, 0, 1)` through the
//! usual processor chain (all other parameters unchanged).
//!
//! A greedy request (user temperature 0 / `do_sample: false`) stays greedy; the heads are still
//! evaluated so the trace shows what they predicted. The combined temperature is floored at
//! `1e-2` (the temperature loss's clamp), so a saturated head never turns a sampled request into
//! an unwarped one.
//!
//! Decoding itself runs on the serving engine (`deco_serve::engine`, with the heads loaded:
//! `deco generate --autodeco`, `deco serve --autodeco`, `deco autodeco eval`), which calls
//! [`HostHeads::predict`](crate::HostHeads::predict) and [`combine`] per token.
//!
//! Source: AutoDeco §3.3 (inference: "the predicted T and P replace the static values");
//! combining them multiplicatively with the user's values is deco's choice (the reference's vLLM
//! integration uses the predicted values directly, i.e. user temperature = top_p = 1).

use deco_decoding::SamplingParams;

use crate::error::Result;
use crate::heads::HeadOutput;

/// Smallest combined temperature (see the module docs).
pub const MIN_TEMPERATURE: f32 = 1e-2;

/// One decoded token with the heads' predictions (`--trace-decoding`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TraceRow {
    /// 0-based index of the generated token.
    pub step: usize,
    /// The token chosen.
    pub token: u32,
    /// The temperature head's output `T`.
    pub temperature: f32,
    /// The top-p head's output `P`.
    pub top_p: f32,
    /// The temperature used (`T × user temperature`, 0 for greedy).
    pub final_temperature: f32,
    /// The top-p used (`clamp(P × user top_p, 0, 1)`).
    pub final_top_p: f32,
}

/// The sampling parameters for one token: `user` with temperature and top-p replaced by the
/// combination with the heads' `out` (unchanged for a greedy request).
pub fn combine(user: &SamplingParams, out: HeadOutput) -> SamplingParams {
    if user.is_greedy() {
        return user.clone();
    }
    let t = (user.temperature.unwrap_or(1.0) * out.temperature).max(MIN_TEMPERATURE);
    let p = (user.top_p.unwrap_or(1.0) * out.top_p).clamp(0.0, 1.0);
    SamplingParams { temperature: Some(t), top_p: Some(p), do_sample: Some(true), ..user.clone() }
}


/// Writes a trace as CSV (`step,token,piece,temperature,top_p,final_temperature,final_top_p`),
/// atomically, one line per token. `piece(token)` gives the token's text; it is written quoted,
/// with control characters escaped as in Rust (`\n`) and quotes doubled.
///
/// # Errors
/// [`Error::Io`].
pub fn write_trace_csv(path: &std::path::Path, trace: &[TraceRow], piece: &dyn Fn(u32) -> String) -> Result<()> {
    let mut s = String::from("step,token,piece,temperature,top_p,final_temperature,final_top_p\n");
    for r in trace {
        // One line per token: control characters are escaped (`\n`), quotes doubled.
        let p = piece(r.token).escape_debug().to_string().replace("\\\"", "\"").replace('"', "\"\"");
        s.push_str(&format!(
            "{},{},\"{}\",{:.6},{:.6},{:.6},{:.6}\n",
            r.step, r.token, p, r.temperature, r.top_p, r.final_temperature, r.final_top_p
        ));
    }
    crate::write_atomic(path, s.as_bytes())
}
