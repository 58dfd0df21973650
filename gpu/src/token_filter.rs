//! vLLM's `allowed_token_ids` and `bad_words` as [`TokenConstraint`]s, and the [`Intersection`]
//! of constraints that a request with several of them (and structured output) samples under.
//!
//! vLLM applies both as logit processors before the draw: `allowed_token_ids` masks every
//! other token (end-of-sequence tokens included: they are not added to the list), and
//! `bad_words` bans, at each step, the last token of every banned token sequence whose earlier
//! tokens are the last tokens generated (output tokens only, never the prompt). As constraints
//! they take the same path as a grammar on both backends: applied after the sampler's own
//! edits, before the draw, with logprobs those of the raw model distribution; each choice has
//! its own state; speculative drafts are committed and taken back ([`TokenConstraint::rollback`]).

use std::sync::Arc;

use crate::constraint::{Constraint, TokenConstraint};

/// Sets token `t` in a bitset of 32-bit words, when it is inside it.
fn set(allowed: &mut [u32], t: u32) {
    if let Some(w) = allowed.get_mut(t as usize / 32) {
        *w |= 1 << (t % 32);
    }
}

/// Clears token `t` in a bitset of 32-bit words, when it is inside it.
fn clear(allowed: &mut [u32], t: u32) {
    if let Some(w) = allowed.get_mut(t as usize / 32) {
        *w &= !(1 << (t % 32));
    }
}

/// vLLM's `allowed_token_ids`: only these tokens, at every step. Stateless: the bitset is
/// built once per request and shared by its choices.
#[derive(Clone, Debug)]
pub struct AllowedTokens {
    /// Token `t` is bit `t % 32` of word `t / 32`.
    set: Arc<[u32]>,
}

impl AllowedTokens {
    /// The set of `ids` (ids at or past `vocab` are left out: the caller refuses them first).
    pub fn new(ids: &[u32], vocab: usize) -> Self {
        let mut words = vec![0u32; vocab.div_ceil(32)];
        for &t in ids.iter().filter(|&&t| (t as usize) < vocab) {
            set(&mut words, t);
        }
        AllowedTokens { set: words.into() }
    }
}

impl TokenConstraint for AllowedTokens {
    fn fill_allowed(&mut self, allowed: &mut [u32]) {
        let n = self.set.len().min(allowed.len());
        allowed[..n].copy_from_slice(&self.set[..n]);
    }

    fn commit(&mut self, _: u32) {}

    fn can_roll_back(&self) -> bool {
        true
    }

    fn rollback(&mut self, _: usize) -> bool {
        true
    }
}

/// Most commits a [`BadWords`] can take back (drafts per step are at most 16).
const BAD_WORDS_ROLLBACK: usize = 32;

/// vLLM's `bad_words`, once tokenized: before each token, the last token of every word whose
/// earlier tokens are the last tokens generated is banned (a one-token word always is). The
/// rest of the model's vocabulary stays allowed, as without the constraint.
#[derive(Clone, Debug)]
pub struct BadWords {
    /// The banned token sequences (each non-empty), shared by a request's choices.
    words: Arc<[Vec<u32>]>,
    /// The latest output tokens: at least the longest word's prefix and the rollback window.
    recent: Vec<u32>,
    /// How many of the latest tokens are kept ([`BadWords::recent`]).
    keep: usize,
}

impl BadWords {
    /// A fresh state (one per choice) over `words`; empty sequences are left out.
    pub fn new(words: Arc<[Vec<u32>]>) -> Self {
        let longest = words.iter().map(Vec::len).max().unwrap_or(0);
        BadWords {
            words,
            recent: Vec::new(),
            keep: longest + BAD_WORDS_ROLLBACK,
        }
    }
}

impl TokenConstraint for BadWords {
    fn fill_allowed(&mut self, allowed: &mut [u32]) {
        allowed.fill(u32::MAX);
        for word in self.words.iter() {
            if let Some((&last, prefix)) = word.split_last() {
                if self.recent.ends_with(prefix) {
                    clear(allowed, last);
                }
            }
        }
    }

    fn commit(&mut self, token: u32) {
        self.recent.push(token);
        // Trimmed in halves so that a commit is amortized O(1).
        if self.recent.len() >= 2 * self.keep {
            let cut = self.recent.len() - self.keep;
            self.recent.drain(..cut);
        }
    }

    fn can_roll_back(&self) -> bool {
        true
    }

    fn rollback(&mut self, n: usize) -> bool {
        if n > self.recent.len() {
            return false;
        }
        self.recent.truncate(self.recent.len() - n);
        true
    }
}

/// A sequence's constraint shared with others as a part of an [`Intersection`] (the grammar of
/// a request that also has `allowed_token_ids` or `bad_words`): each call takes its lock.
impl TokenConstraint for Constraint {
    fn fill_allowed(&mut self, allowed: &mut [u32]) {
        self.with(|c| c.fill_allowed(allowed));
    }

    fn commit(&mut self, token: u32) {
        Constraint::commit(self, token);
    }

    fn can_roll_back(&self) -> bool {
        Constraint::can_roll_back(self)
    }

    fn rollback(&mut self, n: usize) -> bool {
        self.with(|c| c.rollback(n))
    }

    fn begin_drafts(&mut self) {
        self.with(|c| c.begin_drafts());
    }

    fn failure(&self) -> Option<String> {
        Constraint::failure(self)
    }

    fn wants_drafts(&self) -> bool {
        Constraint::wants_drafts(self)
    }
}

/// Several constraints at once: a token is allowed when every part allows it; each commit
/// and rollback goes to every part. When the parts allow no token in common (a grammar that
/// wants a digit under `allowed_token_ids` of letters only), only the request's end ids are
/// allowed, as a failed grammar does, and the sequence ends there.
pub struct Intersection {
    /// The parts, the first one filling the set the others narrow.
    parts: Vec<Box<dyn TokenConstraint>>,
    /// The ids allowed when the parts have no token in common.
    end_ids: Arc<[u32]>,
    /// The set of each part after the first, reused.
    scratch: Vec<u32>,
}

impl Intersection {
    /// The intersection of `parts` (at least one), ending through `end_ids` when empty.
    pub fn new(parts: Vec<Box<dyn TokenConstraint>>, end_ids: Arc<[u32]>) -> Self {
        Intersection {
            parts,
            end_ids,
            scratch: Vec::new(),
        }
    }
}

impl TokenConstraint for Intersection {
    fn fill_allowed(&mut self, allowed: &mut [u32]) {
        let Some((first, rest)) = self.parts.split_first_mut() else {
            return;
        };
        first.fill_allowed(allowed);
        for part in rest {
            self.scratch.clear();
            self.scratch.resize(allowed.len(), 0);
            part.fill_allowed(&mut self.scratch);
            for (a, s) in allowed.iter_mut().zip(&self.scratch) {
                *a &= s;
            }
        }
        if allowed.iter().all(|&w| w == 0) {
            for &t in self.end_ids.iter() {
                set(allowed, t);
            }
        }
    }

    fn commit(&mut self, token: u32) {
        for part in &mut self.parts {
            part.commit(token);
        }
    }

    fn can_roll_back(&self) -> bool {
        self.parts.iter().all(|p| p.can_roll_back())
    }

    fn rollback(&mut self, n: usize) -> bool {
        // Every part takes back its commits, whatever another answers.
        let mut all = true;
        for part in &mut self.parts {
            all &= part.rollback(n);
        }
        all
    }

    fn begin_drafts(&mut self) {
        for part in &mut self.parts {
            part.begin_drafts();
        }
    }

    fn failure(&self) -> Option<String> {
        self.parts.iter().find_map(|p| p.failure())
    }

    /// Drafts go through every part: worth proposing only while every part wants them.
    fn wants_drafts(&self) -> bool {
        self.parts.iter().all(|p| p.wants_drafts())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::constraint::is_allowed;
    use crate::constraint::tests::Script;
    use parking_lot::Mutex;

    const VOCAB: usize = 70;

    fn allowed_ids(c: &Constraint) -> Vec<u32> {
        let set = c.allowed(VOCAB);
        (0..VOCAB as u32)
            .filter(|&t| is_allowed(&set, t as usize))
            .collect()
    }

    fn banned(c: &Constraint) -> Vec<u32> {
        let set = c.allowed(VOCAB);
        (0..VOCAB as u32)
            .filter(|&t| !is_allowed(&set, t as usize))
            .collect()
    }

    fn bad_words(words: &[&[u32]]) -> Constraint {
        let words: Vec<Vec<u32>> = words.iter().map(|w| w.to_vec()).collect();
        Constraint::new(BadWords::new(words.into()))
    }

    #[test]
    fn allowed_tokens_allow_only_their_ids_at_every_step() {
        let c = Constraint::new(AllowedTokens::new(&[3, 40, 69, 500], VOCAB));
        assert_eq!(allowed_ids(&c), [3, 40, 69]);
        c.commit(40);
        assert_eq!(allowed_ids(&c), [3, 40, 69]);
        assert!(c.can_roll_back());
    }

    #[test]
    fn a_one_token_word_is_always_banned() {
        let c = bad_words(&[&[7]]);
        assert_eq!(banned(&c), [7]);
        c.commit_all(&[1, 2]);
        assert_eq!(banned(&c), [7]);
    }

    /// The last token of a word is banned only when the output ends with the rest of it,
    /// whatever came before (tails of one, two and three tokens).
    #[test]
    fn a_words_last_token_is_banned_after_its_prefix() {
        let c = bad_words(&[&[1, 2], &[5, 6, 7], &[9, 9, 9, 4]]);
        assert_eq!(banned(&c), Vec::<u32>::new());
        c.commit(1);
        assert_eq!(banned(&c), [2]);
        c.commit(5);
        assert_eq!(banned(&c), Vec::<u32>::new());
        c.commit(6);
        assert_eq!(banned(&c), [7]);
        c.commit(1);
        assert_eq!(banned(&c), [2]);
        c.commit_all(&[9, 9]);
        assert_eq!(banned(&c), Vec::<u32>::new());
        c.commit(9);
        assert_eq!(banned(&c), [4]);
        // A longer run of the repeated token still ends with the prefix.
        c.commit(9);
        assert_eq!(banned(&c), [4]);
        c.commit(3);
        assert_eq!(banned(&c), Vec::<u32>::new());
    }

    /// Drafts taken back leave the state as if they were never committed, through the
    /// constraint's own `allowed_through` (speculative decoding's path).
    #[test]
    fn bad_words_roll_back_drafts() {
        let c = bad_words(&[&[1, 2, 3]]);
        c.commit(1);
        let sets = c.allowed_through(VOCAB, &[2, 5]);
        assert_eq!(sets.len(), 3);
        assert!(is_allowed(&sets[0], 3) && !is_allowed(&sets[1], 3));
        assert!(is_allowed(&sets[2], 3));
        // Back where it was: 1 was the last output token.
        c.commit(2);
        assert_eq!(banned(&c), [3]);
        assert!(c.can_roll_back());
    }

    /// The kept tail is trimmed, and still matches the longest word after many tokens.
    #[test]
    fn bad_words_keep_a_bounded_tail() {
        let mut w = BadWords::new(vec![vec![1, 2, 3]].into());
        for _ in 0..1000 {
            w.commit(0);
        }
        assert!(w.recent.len() < 2 * w.keep);
        w.commit(1);
        w.commit(2);
        let mut set = vec![0u32; VOCAB.div_ceil(32)];
        w.fill_allowed(&mut set);
        assert!(!is_allowed(&set, 3));
        assert!(w.rollback(2));
        assert!(!w.rollback(10_000));
    }

    fn script(steps: Vec<Vec<u32>>, seen: &Arc<Mutex<Vec<u32>>>) -> Box<Script> {
        Box::new(Script {
            steps,
            eos: 0,
            seen: seen.clone(),
        })
    }

    /// Each part narrows the set; every part sees each commit.
    #[test]
    fn an_intersection_allows_what_every_part_allows() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let grammar = Constraint::new(*script(vec![vec![1, 2, 3, 40], vec![2, 3]], &seen));
        let c = Constraint::new(Intersection::new(
            vec![
                Box::new(grammar.clone()),
                Box::new(AllowedTokens::new(&[2, 3, 40, 41], VOCAB)),
                Box::new(BadWords::new(vec![vec![40, 3], vec![2]].into())),
            ],
            Arc::from([0u32]),
        ));
        assert_eq!(allowed_ids(&c), [3, 40]);
        c.commit(40);
        assert_eq!(*seen.lock(), [40]);
        // The grammar allows 2 and 3, 2 is a bad word and 3 follows 40.
        assert_eq!(allowed_ids(&c), [0]);
    }

    /// When nothing is left in common, only the end ids are allowed (never an empty set).
    #[test]
    fn an_empty_intersection_allows_the_end_ids() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let c = Constraint::new(Intersection::new(
            vec![
                script(vec![vec![5]], &seen),
                Box::new(AllowedTokens::new(&[6], VOCAB)),
            ],
            Arc::from([0u32, 9]),
        ));
        assert_eq!(allowed_ids(&c), [0, 9]);
    }

    /// Rollback reaches every part, and the intersection rolls back only when every part can.
    #[test]
    fn an_intersection_rolls_back_every_part() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let c = Constraint::new(Intersection::new(
            vec![
                Box::new(BadWords::new(vec![vec![1, 2]].into())),
                Box::new(AllowedTokens::new(&[1, 2, 3], VOCAB)),
            ],
            Arc::from([0u32]),
        ));
        assert!(c.can_roll_back());
        let sets = c.allowed_through(VOCAB, &[1]);
        assert!(is_allowed(&sets[0], 2) && !is_allowed(&sets[1], 2));
        assert_eq!(allowed_ids(&c), [1, 2, 3]);
        // A part that cannot roll back (the test script) makes the whole unable to.
        let c = Constraint::new(Intersection::new(
            vec![
                script(vec![], &seen),
                Box::new(AllowedTokens::new(&[1], VOCAB)),
            ],
            Arc::from([0u32]),
        ));
        assert!(!c.can_roll_back());
    }

    /// Wants drafts until it has seen `after` commits (a grammar whose drafts became costly).
    struct DraftsUntil {
        after: usize,
        seen: usize,
    }

    impl TokenConstraint for DraftsUntil {
        fn fill_allowed(&mut self, allowed: &mut [u32]) {
            allowed.fill(u32::MAX);
        }
        fn commit(&mut self, _: u32) {
            self.seen += 1;
        }
        fn can_roll_back(&self) -> bool {
            true
        }
        fn rollback(&mut self, n: usize) -> bool {
            self.seen -= n.min(self.seen);
            true
        }
        fn wants_drafts(&self) -> bool {
            self.seen < self.after
        }
    }

    /// A part that stops wanting drafts makes its intersection stop, as read without the
    /// locks by the engine after the calls of a step; and a constraint that said no once
    /// says no from then on (its drafts taken back do not bring them back).
    #[test]
    fn a_part_that_wants_no_drafts_stops_them_for_the_whole() {
        let grammar = Constraint::new(DraftsUntil { after: 2, seen: 0 });
        let c = Constraint::new(Intersection::new(
            vec![
                Box::new(grammar.clone()),
                Box::new(BadWords::new(vec![vec![1, 2]].into())),
            ],
            Arc::from([0u32]),
        ));
        assert!(c.wants_drafts() && grammar.wants_drafts());
        c.commit(5);
        let sets = c.allowed_through(VOCAB, &[6, 7]);
        assert_eq!(sets.len(), 3);
        // The second draft reached the limit; taking both back does not undo the answer.
        assert!(!grammar.wants_drafts());
        assert!(!c.wants_drafts());
        c.commit(6);
        assert!(!c.wants_drafts());
        // Other constraints always want drafts.
        let plain = bad_words(&[&[1, 2]]);
        plain.commit(1);
        assert!(plain.allowed_through(VOCAB, &[3]).len() == 2 && plain.wants_drafts());
    }
}
