//! Draft verification checked the same way on every backend: decode one token per step for a
//! reference, then decode again feeding drafts built from that reference (a right prefix of a
//! chosen length, then a wrong token) and check that the backend keeps exactly the right
//! prefix and that the outputs equal the reference.

use std::sync::Arc;

use switchyard_gpu::backend::{Backend, Batch, SamplingParams, SeqInput};

/// Blocks of each sequence's table.
pub const BLOCKS_PER_SEQ: u32 = 12;

fn entry(
    id: u64,
    computed: usize,
    tokens: Vec<u32>,
    i: usize,
    p: &Arc<SamplingParams>,
) -> SeqInput {
    SeqInput {
        seq_id: id,
        num_computed_tokens: computed,
        tokens,
        block_table: (0..BLOCKS_PER_SEQ)
            .map(|k| i as u32 * BLOCKS_PER_SEQ + k)
            .collect(),
        sample: true,
        num_drafts: 0,
        sampling: p.clone(),
        adapter: None,
        cached_prompt: None,
    }
}

/// Every prompt in one chunk, sampling.
fn prefills(prompts: &[Vec<u32>], params: &[Arc<SamplingParams>], first_id: u64) -> Vec<SeqInput> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| entry(first_id + i as u64, 0, p.clone(), i, &params[i]))
        .collect()
}

/// Every prompt prefilled in one step, then `steps` tokens each, one per step, all batched.
pub fn one_per_step(
    b: &mut dyn Backend,
    prompts: &[Vec<u32>],
    params: &[Arc<SamplingParams>],
    steps: usize,
    first_id: u64,
) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); prompts.len()];
    let mut seqs = prefills(prompts, params, first_id);
    while !seqs.is_empty() {
        for o in b.execute(&Batch { seqs }).expect("execute") {
            out[(o.seq_id - first_id) as usize].push(o.token.expect("a token"));
        }
        seqs = (0..prompts.len())
            .filter(|&i| out[i].len() < steps)
            .map(|i| {
                let at = prompts[i].len() + out[i].len() - 1;
                let last = *out[i].last().expect("a token");
                entry(first_id + i as u64, at, vec![last], i, &params[i])
            })
            .collect();
    }
    for i in 0..prompts.len() {
        b.release(first_id + i as u64);
    }
    out
}

/// The same decoding with drafts: at each step sequence `i` gets a varying number of drafts
/// (up to `k`) whose first `right` are `reference`'s next tokens and the next one is wrong.
/// Checks that each step keeps exactly the right drafts and returns the outputs and the
/// number of drafts accepted.
pub fn with_drafts(
    b: &mut dyn Backend,
    prompts: &[Vec<u32>],
    params: &[Arc<SamplingParams>],
    reference: &[Vec<u32>],
    k: usize,
    vocab: u32,
    first_id: u64,
) -> (Vec<Vec<u32>>, usize) {
    let steps = reference[0].len();
    let mut out = vec![Vec::new(); prompts.len()];
    let mut seqs = prefills(prompts, params, first_id);
    let mut expected = vec![0usize; prompts.len()];
    let (mut step, mut accepted) = (0usize, 0usize);
    while !seqs.is_empty() {
        let ids: Vec<u64> = seqs.iter().map(|s| s.seq_id).collect();
        for (o, id) in b.execute(&Batch { seqs }).expect("execute").iter().zip(ids) {
            let i = (id - first_id) as usize;
            assert_eq!(o.accepted.len(), expected[i], "sequence {i} at step {step}");
            accepted += o.accepted.len();
            if let Some(n) = params[i].logprobs {
                for a in &o.accepted {
                    assert!(a.logprob.is_some_and(|l| l <= 0.0), "{a:?}");
                    assert_eq!(a.top_logprobs.len(), n as usize);
                }
                assert!(o.logprob.is_some());
            }
            out[i].extend(o.accepted.iter().map(|a| a.token));
            out[i].push(o.token.expect("a token"));
        }
        step += 1;
        seqs = (0..prompts.len())
            .filter(|&i| out[i].len() < steps)
            .map(|i| {
                let done = out[i].len();
                let at = prompts[i].len() + done - 1;
                // Drafts never run past the reference (its last token is sampled, not fed).
                let room = steps - done - 1;
                let n = ((step + i) % (k + 1)).min(room);
                let right = if n == 0 { 0 } else { (step * 7 + i) % (n + 1) };
                let mut tokens = vec![*out[i].last().expect("a token")];
                for j in 0..n {
                    let t = reference[i][done + j];
                    tokens.push(if j < right { t } else { (t + 1) % vocab });
                }
                expected[i] = right;
                let mut s = entry(first_id + i as u64, at, tokens, i, &params[i]);
                s.num_drafts = n;
                s
            })
            .collect();
    }
    for i in 0..prompts.len() {
        b.release(first_id + i as u64);
    }
    (out, accepted)
}
