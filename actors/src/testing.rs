//! Test support shared by the actors' unit tests: a three-word tokenizer and a backend that
//! counts what it is fed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use switchyard_gpu::backend::{Backend, Batch, SeqOutput};
use switchyard_gpu::model::Tokenizer;
use switchyard_gpu::GpuError;

/// A word-level tokenizer of the words "a" (0, also the unknown word), "b" (1) and "c" (2),
/// split on whitespace.
pub(crate) fn abc_tokenizer() -> Arc<Tokenizer> {
    let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
        "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,
        "decoder":null,"model":{"type":"WordLevel","vocab":{"a":0,"b":1,"c":2},"unk_token":"a"}}"#;
    Arc::new(Tokenizer::from_json_bytes(json.as_bytes()).expect("tokenizer"))
}

/// Samples token 1 at once and counts the tokens each sequence was fed, in 64 blocks of 4
/// tokens (the KV cache holds 256 tokens of one sequence); an empty batch (which the engine
/// must never build) is counted under [`EMPTY_BATCHES`].
pub(crate) struct CountingBackend(pub(crate) Arc<Mutex<HashMap<u64, usize>>>);

/// The key under which [`CountingBackend`] counts empty batches.
pub(crate) const EMPTY_BATCHES: u64 = u64::MAX;

impl Backend for CountingBackend {
    fn name(&self) -> &str {
        "counting"
    }
    fn num_kv_blocks(&self) -> usize {
        64
    }
    fn block_size(&self) -> usize {
        4
    }
    fn max_batch_tokens(&self) -> usize {
        1024
    }
    fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
        let mut fed = self.0.lock().unwrap();
        if batch.seqs.is_empty() {
            *fed.entry(EMPTY_BATCHES).or_default() += 1;
        }
        Ok(batch
            .seqs
            .iter()
            .map(|s| {
                *fed.entry(s.seq_id).or_default() += s.tokens.len();
                SeqOutput {
                    seq_id: s.seq_id,
                    accepted: Vec::new(),
                    token: s.sample.then_some(1),
                    logprob: None,
                    top_logprobs: Vec::new(),
                    prompt_logprobs: Vec::new(),
                    hidden: None,
                }
            })
            .collect())
    }
    fn release(&mut self, _: u64) {}
}
