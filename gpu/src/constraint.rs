//! Structured output on the sampler's side: a sequence may carry a [`TokenConstraint`] (a
//! grammar, a JSON schema, a regular expression; vLLM's `allowed_token_ids` and `bad_words`,
//! see [`crate::token_filter`]) that says before each sampled token which
//! tokens may come next and is told the token that was sampled. Backends apply the allowed
//! set after the sampler's own logit edits (bias, `min_tokens`, penalties) and before the
//! draw, so a constrained request samples from the model's distribution restricted to what
//! the constraint allows; logprobs stay those of the raw model distribution.
//!
//! The grammar engine lives in the engine crate (`switchyard-actors`); this crate only sees
//! the trait, so backends stay free of it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// What a sequence may sample next.
pub trait TokenConstraint: Send {
    /// Sets the bits of the tokens allowed next in `allowed`: token `t` is bit `t % 32` of
    /// word `t / 32`. `allowed` arrives cleared and covers the model's whole vocabulary (a
    /// grammar never allows tokens past the tokenizer's; `bad_words` leaves them as they are
    /// without it). Never leaves it empty: a constraint that has failed or finished allows
    /// only its end-of-sequence tokens.
    fn fill_allowed(&mut self, allowed: &mut [u32]);
    /// Records the token sampled from the last allowed set.
    fn commit(&mut self, token: u32);
    /// Whether [`TokenConstraint::rollback`] works. Speculative decoding on the CUDA backend
    /// needs it: the allowed set after each draft is computed with the drafts committed,
    /// which are then taken back.
    fn can_roll_back(&self) -> bool {
        false
    }
    /// Takes back the last `n` commits (at most a few); false when it cannot. Also ends the
    /// drafts begun by [`TokenConstraint::begin_drafts`] (`n` may be 0).
    fn rollback(&mut self, n: usize) -> bool {
        n == 0
    }
    /// Says that the commits from here to the next [`TokenConstraint::rollback`] are
    /// speculative drafts ([`Constraint::allowed_through`]), all taken back by it: a failure
    /// that they lead to (a grammar past its parser's limits after a draft) must go with them,
    /// and be the constraint's only should the same tokens be committed again. Only a
    /// constraint that can fail needs it.
    fn begin_drafts(&mut self) {}
    /// What went wrong, when the constraint failed while generating (from then on it allows
    /// only the end-of-sequence tokens, so the output so far does not complete it).
    fn failure(&self) -> Option<String> {
        None
    }
    /// Whether drafts are still worth proposing to the sequence: false once taking them
    /// through the constraint ([`Constraint::allowed_through`]) costs more than they can save
    /// (a grammar whose drafts must go through a deep copy of its matcher). Drafts stay
    /// correct either way: a backend that verifies drafts for the sequence goes on doing so,
    /// and the engine only stops proposing them ([`Constraint::wants_drafts`]). Once false,
    /// it stays false.
    fn wants_drafts(&self) -> bool {
        true
    }
}

/// A sequence's constraint, shared between the engine (which creates it per choice) and the
/// backend (which asks it before each draw of that sequence).
#[derive(Clone)]
pub struct Constraint(Arc<Shared>);

/// What the copies of a [`Constraint`] share.
struct Shared {
    /// The constraint.
    inner: Mutex<Box<dyn TokenConstraint>>,
    /// Its [`TokenConstraint::wants_drafts`] as of the last call that held the lock, read
    /// without it ([`Constraint::wants_drafts`]: the scheduler's thread never waits on a
    /// mask the backend is computing).
    wants_drafts: AtomicBool,
}

impl Constraint {
    /// Wraps a constraint.
    pub fn new(c: impl TokenConstraint + 'static) -> Self {
        let wants_drafts = AtomicBool::new(c.wants_drafts());
        Constraint(Arc::new(Shared {
            inner: Mutex::new(Box::new(c)),
            wants_drafts,
        }))
    }

    /// Runs `f` on the constraint, under its lock, then notes whether it still wants drafts.
    fn locked<R>(&self, f: impl FnOnce(&mut dyn TokenConstraint) -> R) -> R {
        let mut c = self.0.inner.lock();
        let r = f(c.as_mut());
        if !c.wants_drafts() {
            self.0.wants_drafts.store(false, Ordering::Release);
        }
        r
    }

    /// The allowed set for the next token as a bitset of `vocab` bits.
    pub fn allowed(&self, vocab: usize) -> Vec<u32> {
        let mut words = vec![0u32; vocab.div_ceil(32)];
        self.locked(|c| c.fill_allowed(&mut words));
        // Bits past the vocabulary would address logits of other rows.
        if !vocab.is_multiple_of(32) {
            if let Some(last) = words.last_mut() {
                *last &= (1u32 << (vocab % 32)) - 1;
            }
        }
        words
    }

    /// Runs `f` on the constraint, under its lock.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut dyn TokenConstraint) -> R) -> R {
        self.locked(f)
    }

    /// Records a sampled token.
    pub fn commit(&self, token: u32) {
        self.locked(|c| c.commit(token));
    }

    /// Records sampled tokens, in order.
    pub fn commit_all(&self, tokens: &[u32]) {
        self.locked(|c| {
            for &t in tokens {
                c.commit(t);
            }
        });
    }

    /// What went wrong, when the constraint failed ([`TokenConstraint::failure`]).
    pub fn failure(&self) -> Option<String> {
        self.0.inner.lock().failure()
    }

    /// Whether the constraint can take commits back ([`TokenConstraint::rollback`]).
    pub fn can_roll_back(&self) -> bool {
        self.0.inner.lock().can_roll_back()
    }

    /// Whether drafts are still worth proposing to the sequence
    /// ([`TokenConstraint::wants_drafts`]), as of the constraint's last call: read without
    /// its lock. A backend's calls for a step (masks, commits, drafts taken back) come before
    /// that step's outputs, so an engine that reads this as it applies them sees what they
    /// left. It never becomes true again once false.
    pub fn wants_drafts(&self) -> bool {
        self.0.wants_drafts.load(Ordering::Acquire)
    }

    /// The allowed sets before each of `drafts` and after the last (`drafts.len() + 1` sets of
    /// `vocab` bits), as one-token steps would see them had the drafts been sampled; the
    /// constraint's state is left as it was ([`TokenConstraint::begin_drafts`]: a failure
    /// that only the drafts led to is taken back with them). A draft that its set does not
    /// allow is not committed, and the sets after it repeat the one before (its row cannot
    /// keep the draft, so those rows go unused). After a failure the sets allow only the end
    /// ids, so the drafts after it are not committed: the row after it can keep none.
    pub fn allowed_through(&self, vocab: usize, drafts: &[u32]) -> Vec<Vec<u32>> {
        let mut out: Vec<Vec<u32>> = Vec::with_capacity(drafts.len() + 1);
        let mut committed = 0;
        let mut blocked = false;
        self.locked(|c| c.begin_drafts());
        for i in 0..=drafts.len() {
            let set = match (blocked, out.last()) {
                (true, Some(last)) => last.clone(),
                _ => self.allowed(vocab),
            };
            if let Some(&d) = drafts.get(i) {
                if !blocked && is_allowed(&set, d as usize) {
                    self.commit(d);
                    committed += 1;
                } else {
                    blocked = true;
                }
            }
            out.push(set);
        }
        if !self.locked(|c| c.rollback(committed)) {
            tracing::warn!("a constraint could not take back {committed} drafts");
        }
        out
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

/// Two parameter sets are equal only when they share the very constraint (it has state).
impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Whether token `t` is set in `allowed`.
pub fn is_allowed(allowed: &[u32], t: usize) -> bool {
    allowed.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

/// Sets every logit that `allowed` does not allow to -inf. When that leaves no finite logit
/// (the sampler's own edits masked every allowed token, e.g. `min_tokens` against a grammar
/// that can only end), the allowed token with the largest `raw` logit is kept at its raw
/// value, so the grammar wins.
pub fn mask_logits(logits: &mut [f32], raw: &[f32], allowed: &[u32]) {
    let mut any = false;
    for (t, l) in logits.iter_mut().enumerate() {
        if !is_allowed(allowed, t) {
            *l = f32::NEG_INFINITY;
        } else if l.is_finite() {
            any = true;
        }
    }
    if !any {
        let best = (0..logits.len())
            .filter(|&t| is_allowed(allowed, t))
            .max_by(|&a, &b| raw[a].total_cmp(&raw[b]).then(b.cmp(&a)));
        if let Some(t) = best {
            logits[t] = if raw[t].is_finite() { raw[t] } else { 0.0 };
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Allows the tokens of a fixed list, one position after another, then only `eos`.
    pub(crate) struct Script {
        pub steps: Vec<Vec<u32>>,
        pub eos: u32,
        pub seen: Arc<Mutex<Vec<u32>>>,
    }

    impl TokenConstraint for Script {
        fn fill_allowed(&mut self, allowed: &mut [u32]) {
            let n = self.seen.lock().len();
            let set = self.steps.get(n).cloned().unwrap_or_else(|| vec![self.eos]);
            for t in set {
                allowed[t as usize / 32] |= 1 << (t % 32);
            }
        }
        fn commit(&mut self, token: u32) {
            self.seen.lock().push(token);
        }
    }

    #[test]
    fn masking_keeps_only_allowed_tokens() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let c = Constraint::new(Script {
            steps: vec![vec![1, 33]],
            eos: 0,
            seen: seen.clone(),
        });
        let allowed = c.allowed(40);
        assert_eq!(allowed.len(), 2);
        assert!(is_allowed(&allowed, 1) && is_allowed(&allowed, 33));
        assert!(!is_allowed(&allowed, 2) && !is_allowed(&allowed, 0));
        let raw: Vec<f32> = (0..40).map(|i| i as f32).collect();
        let mut l = raw.clone();
        mask_logits(&mut l, &raw, &allowed);
        let finite: Vec<usize> = (0..40).filter(|&t| l[t].is_finite()).collect();
        assert_eq!(finite, vec![1, 33]);
        c.commit(33);
        assert_eq!(*seen.lock(), vec![33]);
        // Then only eos.
        let allowed = c.allowed(40);
        assert!(is_allowed(&allowed, 0) && !is_allowed(&allowed, 1));
    }

    #[test]
    fn the_grammar_wins_when_edits_masked_every_allowed_token() {
        let allowed = vec![0b100u32];
        let raw = vec![1.0, 2.0, 0.5, 3.0];
        let mut l = vec![1.0, 2.0, f32::NEG_INFINITY, 3.0];
        mask_logits(&mut l, &raw, &allowed);
        assert_eq!(
            l,
            vec![f32::NEG_INFINITY, f32::NEG_INFINITY, 0.5, f32::NEG_INFINITY]
        );
    }

    #[test]
    fn bits_past_the_vocabulary_are_cleared() {
        struct All;
        impl TokenConstraint for All {
            fn fill_allowed(&mut self, allowed: &mut [u32]) {
                allowed.fill(u32::MAX);
            }
            fn commit(&mut self, _: u32) {}
        }
        let a = Constraint::new(All).allowed(35);
        assert_eq!(a, vec![u32::MAX, 0b111]);
    }
}
