//! `switchyard calibrate`'s front-end timing: what the server's tokenizer pool does for a chat
//! request before the request is queued (the model's chat template over one user message, then
//! its tokenizer; a text prompt's encoding where the model has no template), timed on this
//! machine on prompts of several lengths, so that the simulator's `front_end_us` and
//! `front_end_per_token_us` ([`switchyard_simulator::front_end`]) are measured, not guessed.
//! The server's `switchyard:request_front_end_seconds` times the whole way from the engine's
//! receipt to its queue (the hops between actors too) on its real requests.

use std::time::Instant;

use switchyard_gpu::model::{ChatEnding, ChatMessage, ChatTemplate, Tokenizer};

/// Prompt lengths timed, in tokens (those below the model's context).
const LENGTHS: [usize; 5] = [16, 64, 256, 1024, 4096];
/// Timings per length; their median is kept.
const TIMINGS: usize = 15;
/// What the prompts are made of, repeated to their length.
const SENTENCE: &str = "The scheduler admits each request once its prompt has been encoded, \
                        and the engine runs its prefill with the decodes of the others. ";

/// (prompt tokens, median microseconds) for each length below `max_tokens`.
pub fn measure(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    max_tokens: usize,
) -> anyhow::Result<Vec<(usize, f64)>> {
    let per_sentence = tokenizer.encode(SENTENCE, false)?.len().max(1);
    let max_text = tokenizer.max_text_len(max_tokens);
    let mut samples = Vec::with_capacity(LENGTHS.len());
    for &target in LENGTHS.iter().filter(|&&n| n < max_tokens) {
        let text = SENTENCE.repeat(target.div_ceil(per_sentence));
        let mut times = Vec::with_capacity(TIMINGS);
        let mut tokens = 0;
        for _ in 0..TIMINGS {
            let start = Instant::now();
            let ids = match template {
                Some(t) => {
                    let messages = [ChatMessage::new("user", text.as_str())];
                    let rendered = t.render_within(
                        &messages,
                        ChatEnding::GenerationPrompt,
                        &serde_json::Map::new(),
                        max_text,
                    )?;
                    tokenizer.encode(&rendered, false)?
                }
                None => tokenizer.encode(&text, true)?,
            };
            times.push(start.elapsed().as_secs_f64() * 1e6);
            tokens = ids.len();
        }
        times.sort_by(f64::total_cmp);
        samples.push((tokens, times[times.len() / 2]));
    }
    Ok(samples)
}
