//! Structured output: JSON schemas, JSON objects, regular expressions, choices and Lark
//! grammars compiled by llguidance into per-sequence [`Constraint`]s that the backends apply
//! before each draw (see `switchyard_gpu::constraint`).
//!
//! One [`GrammarCompiler`] per model holds llguidance's view of the tokenizer (a token trie of
//! every token's bytes, special tokens marked so grammars never produce them); it is built on
//! the first structured request, not at start. Compiling a request's grammar checks it (a bad
//! schema or regex is the client's error) and yields one fresh matcher per choice. At run
//! time a matcher that fails (it should not: every sampled token comes from its own mask)
//! ends its sequence through the end-of-sequence tokens rather than sampling unconstrained.

use std::sync::{Arc, OnceLock};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use switchyard_gpu::model::Tokenizer;
use switchyard_gpu::{Constraint, TokenConstraint};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::metric_names as names;

/// Most bytes of a schema, regex, grammar or all choices together in one request.
pub const MAX_SPEC_BYTES: usize = 64 * 1024;
/// Most alternatives of a choice.
pub const MAX_CHOICES: usize = 1024;

/// What a request's output must follow.
#[derive(Debug, Clone, PartialEq)]
pub enum StructuredOutput {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under a JSON Schema (`json_schema`).
    JsonSchema(serde_json::Value),
    /// Text matching a regular expression (whole output).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect.
    Grammar(String),
    /// Tool calls (chat with tools): a grammar in llguidance's Lark dialect, counted apart.
    ToolCalls(String),
}

impl StructuredOutput {
    /// Checks the sizes; the grammar itself is checked when it is compiled.
    pub fn check_bounds(&self) -> Result<(), String> {
        let bytes = match self {
            StructuredOutput::JsonObject => 0,
            StructuredOutput::JsonSchema(v) => v.to_string().len(),
            StructuredOutput::Regex(r) => r.len(),
            StructuredOutput::Grammar(g) | StructuredOutput::ToolCalls(g) => g.len(),
            StructuredOutput::Choice(c) => {
                if c.is_empty() || c.len() > MAX_CHOICES {
                    return Err(format!("a choice needs 1 to {MAX_CHOICES} alternatives"));
                }
                if c.iter().any(String::is_empty) {
                    return Err("choice alternatives must not be empty".into());
                }
                c.iter().map(String::len).sum()
            }
        };
        if bytes > MAX_SPEC_BYTES {
            return Err(format!(
                "the structured output specification has {bytes} bytes; at most {MAX_SPEC_BYTES} are allowed"
            ));
        }
        Ok(())
    }

    /// The kind, as the `kind` label of the requests metric.
    pub fn kind(&self) -> &'static str {
        match self {
            StructuredOutput::JsonObject => "json_object",
            StructuredOutput::JsonSchema(_) => "json_schema",
            StructuredOutput::Regex(_) => "regex",
            StructuredOutput::Choice(_) => "choice",
            StructuredOutput::Grammar(_) => "grammar",
            StructuredOutput::ToolCalls(_) => "tool_calls",
        }
    }

    fn grammar(&self) -> TopLevelGrammar {
        // Output formatted as Python's json.dumps (", " and ": "), with no free whitespace: a
        // small model cannot wander into endless newlines, and the text is what clients
        // expect. A schema's own "x-guidance" options win.
        let with_format = |mut schema: serde_json::Value| {
            if let Some(obj) = schema.as_object_mut() {
                obj.entry("x-guidance").or_insert_with(|| {
                    serde_json::json!({
                        "whitespace_flexible": false,
                        "item_separator": ", ",
                        "key_separator": ": ",
                    })
                });
            }
            schema
        };
        match self {
            StructuredOutput::JsonObject => TopLevelGrammar::from_json_schema(with_format(
                serde_json::json!({"type": "object"}),
            )),
            StructuredOutput::JsonSchema(s) => {
                TopLevelGrammar::from_json_schema(with_format(s.clone()))
            }
            StructuredOutput::Regex(r) => TopLevelGrammar::from_regex(r),
            StructuredOutput::Choice(c) => {
                let alternatives: Vec<String> = c.iter().map(|s| escape_regex(s)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
            StructuredOutput::Grammar(g) | StructuredOutput::ToolCalls(g) => {
                TopLevelGrammar::from_lark(g.clone())
            }
        }
    }
}

/// `s` as a regular expression matching exactly `s`.
fn escape_regex(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// llguidance's view of our tokenizer.
struct TokenizerView {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for TokenizerView {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer.encode(text, false).unwrap_or_default()
        })
    }
}

/// Compiles requests' structured-output specifications for one model.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl GrammarCompiler {
    /// Builds the token trie of `tokenizer` (its end-of-sequence tokens end a grammar).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, String> {
        let vocab = tokenizer.vocab_size();
        let eos: Vec<u32> = tokenizer
            .eos_token_ids()
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        let Some(&first_eos) = eos.first() else {
            return Err("structured output needs a model with an end-of-sequence token".into());
        };
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                if tokenizer.is_special(id) {
                    // Marked so that no grammar produces them from text.
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(
                        tokenizer
                            .id_to_token(id)
                            .unwrap_or_else(|| format!("<[{id}]>"))
                            .as_bytes(),
                    );
                    w
                } else {
                    tokenizer.token_bytes(id).unwrap_or_default().to_vec()
                }
            })
            .collect();
        let info = TokRxInfo::new(vocab as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(TokenizerView { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            // Errors name the problem, not the whole grammar and token history.
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Self { factory, vocab })
    }

    /// Compiles `spec` into `n` constraints (one per choice). `end_ids`: the tokens that end
    /// the request (its end-of-sequence and stop ids); they are allowed wherever the grammar
    /// may end, and only there.
    pub fn compile(
        &self,
        spec: &StructuredOutput,
        end_ids: &[u32],
        n: usize,
    ) -> Result<Vec<Constraint>, String> {
        spec.check_bounds()?;
        let t0 = std::time::Instant::now();
        let parser = self
            .factory
            .create_parser(spec.grammar())
            .map_err(|e| format!("invalid structured output specification: {e}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(format!("invalid structured output specification: {e}"));
        }
        metrics::histogram!(names::STRUCTURED_COMPILE).record(t0.elapsed().as_secs_f64());
        metrics::counter!(names::STRUCTURED_REQUESTS, "kind" => spec.kind()).increment(1);
        let end_ids: Arc<[u32]> = end_ids.into();
        Ok((0..n)
            .map(|_| {
                Constraint::new(GrammarConstraint {
                    matcher: matcher.deep_clone(),
                    end_ids: end_ids.clone(),
                    failed: false,
                    recent: std::collections::VecDeque::with_capacity(ROLLBACK_WINDOW),
                })
            })
            .collect())
    }
}

/// A [`GrammarCompiler`] built on first use.
#[derive(Clone, Default)]
pub struct LazyGrammarCompiler(Arc<OnceLock<Result<GrammarCompiler, String>>>);

impl LazyGrammarCompiler {
    /// The compiler for `tokenizer`, built now if this is the first call.
    pub fn get(&self, tokenizer: &Arc<Tokenizer>) -> Result<&GrammarCompiler, String> {
        self.0
            .get_or_init(|| {
                let t0 = std::time::Instant::now();
                let c = GrammarCompiler::new(tokenizer.clone());
                tracing::info!(
                    elapsed_ms = t0.elapsed().as_millis() as u64,
                    "structured output: token trie built"
                );
                c
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// One sequence's grammar state.
struct GrammarConstraint {
    matcher: Matcher,
    end_ids: Arc<[u32]>,
    failed: bool,
    /// Whether each of the latest commits (at most [`ROLLBACK_WINDOW`]) reached the matcher
    /// (end ids and commits after the grammar stopped do not), so a rollback takes back
    /// exactly what was consumed.
    recent: std::collections::VecDeque<bool>,
}

/// Most commits a [`GrammarConstraint`] can take back (drafts per step are at most 16).
const ROLLBACK_WINDOW: usize = 32;

impl GrammarConstraint {
    fn allow_end(&self, allowed: &mut [u32]) {
        for &t in self.end_ids.iter() {
            if let Some(w) = allowed.get_mut(t as usize / 32) {
                *w |= 1 << (t % 32);
            }
        }
    }

    /// Whether the grammar takes end id `token` as text: a request's `stop_token_ids` are end
    /// ids, but one sampled before `min_tokens` does not end the request and is part of the
    /// output, so the grammar must read it (the tokenizer's end-of-sequence tokens never are).
    fn takes_as_text(&mut self, token: u32) -> bool {
        let eos = self
            .matcher
            .tok_env()
            .map_or(true, |env| env.tok_trie().eos_tokens().contains(&token));
        !eos && matches!(self.matcher.validate_tokens(&[token]), Ok(1))
    }

    fn fail(&mut self, what: &str, e: impl std::fmt::Display) {
        tracing::warn!(error = %e, "structured output: {what} failed; ending the sequence");
        metrics::counter!(names::STRUCTURED_FAILURES).increment(1);
        self.failed = true;
    }
}

impl TokenConstraint for GrammarConstraint {
    fn fill_allowed(&mut self, allowed: &mut [u32]) {
        if !self.failed {
            match self.matcher.compute_mask_or_eos() {
                Ok(mask) => {
                    let src = mask.as_slice();
                    let n = src.len().min(allowed.len());
                    allowed[..n].copy_from_slice(&src[..n]);
                    // The grammar may end where it allows the tokenizer's end-of-sequence
                    // tokens; what ends this request are its own end ids.
                    let mut may_end = false;
                    if let Ok(env) = self.matcher.tok_env() {
                        for &t in env.tok_trie().eos_tokens() {
                            may_end |= mask.is_allowed(t);
                            if let Some(w) = allowed.get_mut(t as usize / 32) {
                                *w &= !(1 << (t % 32));
                            }
                        }
                    }
                    if may_end {
                        self.allow_end(allowed);
                    }
                    if allowed.iter().any(|&w| w != 0) {
                        return;
                    }
                    self.fail("the token mask", "no token is allowed");
                }
                Err(e) => self.fail("the token mask", e),
            }
        }
        allowed.fill(0);
        self.allow_end(allowed);
    }

    fn commit(&mut self, token: u32) {
        if self.recent.len() == ROLLBACK_WINDOW {
            self.recent.pop_front();
        }
        if self.failed
            || self.matcher.is_stopped()
            || (self.end_ids.contains(&token) && !self.takes_as_text(token))
        {
            self.recent.push_back(false);
            return;
        }
        self.recent.push_back(true);
        if let Err(e) = self.matcher.consume_token(token) {
            self.fail("consuming a token", e);
        }
    }

    fn can_roll_back(&self) -> bool {
        true
    }

    fn rollback(&mut self, n: usize) -> bool {
        if n > self.recent.len() || self.failed {
            return false;
        }
        let consumed = (0..n)
            .filter_map(|_| self.recent.pop_back())
            .filter(|&c| c)
            .count();
        if consumed == 0 {
            return true;
        }
        match self.matcher.rollback(consumed) {
            Ok(()) => true,
            Err(e) => {
                self.fail("taking back drafts", e);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};
    use switchyard_gpu::constraint::is_allowed;
    use switchyard_gpu::model::{default_model_path, load_model};

    fn tokenizer() -> Arc<Tokenizer> {
        let path = default_model_path("smollm2-135m");
        assert!(
            path.is_file(),
            "{} is missing: run `switchyard model fetch smollm2-135m`",
            path.display()
        );
        Arc::new(load_model(&path, false).expect("SmolLM2 loads").tokenizer)
    }

    /// Walks `c` by picking allowed tokens with a seeded generator (ending with probability
    /// 1/2 wherever an end id is allowed; `ends[0]` then) and returns the text, or `None` when
    /// the walk did not end within `max_steps`.
    fn walk(
        c: &Constraint,
        tok: &Tokenizer,
        ends: &[u32],
        seed: u64,
        max_steps: usize,
    ) -> Option<String> {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let vocab = tok.vocab_size();
        let mut out = Vec::new();
        for _ in 0..max_steps {
            let allowed = c.allowed(vocab);
            let ids: Vec<u32> = (0..vocab)
                .filter(|&t| is_allowed(&allowed, t))
                .map(|t| t as u32)
                .collect();
            assert!(!ids.is_empty(), "an empty allowed set after {out:?}");
            let choices: Vec<u32> = ids.iter().copied().filter(|t| !ends.contains(t)).collect();
            if ids.contains(&ends[0]) && (choices.is_empty() || next() % 2 == 0) {
                c.commit(ends[0]);
                return Some(tok.decode(&out, true).expect("decode"));
            }
            let t = choices[(next() % choices.len() as u64) as usize];
            c.commit(t);
            out.push(t);
        }
        None
    }

    #[test]
    fn random_walks_through_a_schema_give_valid_json() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let end = tok.eos_token_ids()[0];
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                "ok": {"type": "boolean"}
            },
            "required": ["name", "age", "tags", "ok"],
            "additionalProperties": false
        });
        let spec = StructuredOutput::JsonSchema(schema);
        let constraints = compiler.compile(&spec, &[end], 24).expect("compiles");
        for (seed, c) in constraints.iter().enumerate() {
            // A random walk can wander into long strings; what it must never do is leave the
            // schema.
            let text = walk(c, &tok, &[end], seed as u64, 400).expect("the walk ended");
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            let o = v.as_object().expect("an object");
            assert_eq!(o.len(), 4, "{text}");
            assert!(
                o["name"].as_str().is_some_and(|s| s.chars().count() <= 8),
                "{text}"
            );
            assert!(o["age"].as_u64().is_some_and(|a| a <= 150), "{text}");
            let tags = o["tags"].as_array().expect("tags");
            assert!(
                tags.len() <= 3
                    && tags
                        .iter()
                        .all(|t| ["a", "b", "c"].contains(&t.as_str().unwrap_or(""))),
                "{text}"
            );
            assert!(o["ok"].is_boolean(), "{text}");
        }
    }

    #[test]
    fn a_stop_id_the_grammar_reads_as_text_moves_it_on() {
        // A stop id sampled before min_tokens is output, not an end: the grammar reads it.
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let id = |s: &str| tok.encode(s, false).expect("ids")[0];
        let (end, x, three, y) = (tok.eos_token_ids()[0], id("x"), id("3"), id("y"));
        let c = compiler
            .compile(&StructuredOutput::Regex("x3y".into()), &[end, three], 1)
            .expect("compiles")
            .pop()
            .expect("one");
        let vocab = tok.vocab_size();
        assert!(is_allowed(&c.allowed(vocab), x as usize));
        c.commit(x);
        assert!(is_allowed(&c.allowed(vocab), three as usize));
        c.commit(three);
        let allowed = c.allowed(vocab);
        assert!(
            is_allowed(&allowed, y as usize),
            "the grammar moved on past 3"
        );
        assert!(!is_allowed(&allowed, three as usize));
    }

    #[test]
    fn regexes_choices_and_objects_hold_and_end_where_they_may() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        // A stop id of the request ends it too, but only where the grammar may end.
        let (end, stop) = (
            tok.eos_token_ids()[0],
            tok.encode("!", false).expect("ids")[0],
        );
        let spec = StructuredOutput::Regex(r"[a-c]{2,4}-[0-9]{2}".into());
        for (seed, c) in compiler
            .compile(&spec, &[end, stop], 16)
            .expect("compiles")
            .iter()
            .enumerate()
        {
            let allowed = c.allowed(tok.vocab_size());
            assert!(!is_allowed(&allowed, end as usize) && !is_allowed(&allowed, stop as usize));
            let text = walk(c, &tok, &[end, stop], seed as u64, 64).expect("ended");
            let (letters, digits) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
            assert!(
                (2..=4).contains(&letters.len())
                    && letters.chars().all(|ch| ('a'..='c').contains(&ch)),
                "{text:?}"
            );
            assert!(
                digits.len() == 2 && digits.chars().all(|ch| ch.is_ascii_digit()),
                "{text:?}"
            );
        }
        let spec =
            StructuredOutput::Choice(vec!["red".into(), "green (dark)".into(), "a|b".into()]);
        for (seed, c) in compiler
            .compile(&spec, &[end, stop], 16)
            .expect("compiles")
            .iter()
            .enumerate()
        {
            let text = walk(c, &tok, &[end, stop], seed as u64, 64).expect("ended");
            assert!(
                ["red", "green (dark)", "a|b"].contains(&text.as_str()),
                "{text:?}"
            );
            // Finished: only the end ids.
            let allowed = c.allowed(tok.vocab_size());
            let left: Vec<usize> = (0..tok.vocab_size())
                .filter(|&t| is_allowed(&allowed, t))
                .collect();
            assert_eq!(left, vec![end.min(stop) as usize, end.max(stop) as usize]);
        }
        for (seed, c) in compiler
            .compile(&StructuredOutput::JsonObject, &[end], 8)
            .expect("compiles")
            .iter()
            .enumerate()
        {
            if let Some(text) = walk(c, &tok, &[end], seed as u64, 400) {
                let v: Value =
                    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
                assert!(v.is_object(), "{text}");
            }
        }
    }

    /// Speculative decoding on the GPU computes the mask after each draft with the drafts
    /// committed, then takes them back: the masks equal those of committing one token at a
    /// time, the state is as before, and an end id or a disallowed draft is handled.
    #[test]
    fn masks_through_drafts_equal_one_token_at_a_time_and_leave_the_state() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let end = tok.eos_token_ids()[0];
        let spec = StructuredOutput::Regex(r"[a-z]+ [0-9]+ [a-z]+".into());
        let mut cs = compiler.compile(&spec, &[end], 2).expect("compiles");
        let (a, b) = (cs.remove(0), cs.remove(0));
        assert!(a.can_roll_back());
        let vocab = tok.vocab_size();
        let drafts = tok.encode("hello 42 world", false).expect("ids");
        assert!(drafts.len() >= 3, "{drafts:?}");
        // One at a time on `b`.
        let mut one_by_one = Vec::new();
        for &d in &drafts {
            one_by_one.push(b.allowed(vocab));
            b.commit(d);
        }
        one_by_one.push(b.allowed(vocab));
        let before = a.allowed(vocab);
        let through = a.allowed_through(vocab, &drafts);
        assert_eq!(through, one_by_one);
        assert_eq!(a.allowed(vocab), before, "the drafts were not taken back");
        // A draft the grammar does not allow stops the commits there; the sets after it repeat.
        let bad = tok.encode("hello !!", false).expect("ids");
        let through = a.allowed_through(vocab, &bad);
        let stuck = bad
            .iter()
            .zip(&through)
            .position(|(&d, set)| !is_allowed(set, d as usize));
        let k = stuck.expect("a disallowed draft");
        assert!(through[k + 1..].iter().all(|s| *s == through[k]));
        assert_eq!(a.allowed(vocab), before);
        // And the constraint goes on as if nothing happened.
        for (&d, want) in drafts.iter().zip(&one_by_one) {
            assert_eq!(&a.allowed(vocab), want);
            a.commit(d);
        }
        assert_eq!(&a.allowed(vocab), one_by_one.last().expect("sets"));
    }

    #[test]
    fn bad_specifications_are_refused_with_a_reason() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let end = [tok.eos_token_ids()[0]];
        for spec in [
            StructuredOutput::Regex("(unclosed".into()),
            StructuredOutput::JsonSchema(json!({"type": "no-such-type"})),
            StructuredOutput::JsonSchema(json!({"$ref": "https://example.com/remote.json"})),
            StructuredOutput::Grammar("start: undefined_rule".into()),
            StructuredOutput::Choice(Vec::new()),
            StructuredOutput::Regex("a".repeat(MAX_SPEC_BYTES + 1)),
        ] {
            let e = compiler.compile(&spec, &end, 1).expect_err("refused");
            assert!(!e.is_empty(), "{spec:?}");
        }
    }
}
