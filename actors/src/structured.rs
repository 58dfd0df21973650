//! Structured output: JSON schemas, JSON objects, regular expressions, choices and Lark
//! grammars compiled by llguidance into per-sequence [`Constraint`]s that the backends apply
//! before each draw (see `switchyard_gpu::constraint`).
//!
//! One [`GrammarCompiler`] per model holds llguidance's view of the tokenizer (a token trie of
//! every token's bytes, special tokens marked so grammars never produce them); it is built on
//! the first structured request, not at start. Compiling a request's grammar checks it (a bad
//! schema or regex is the client's error, and so is one with no finite sentence, and one whose
//! first token mask fails: it is unsatisfiable, or beyond llguidance's limits from the start)
//! and yields one fresh matcher per choice. A grammar whose first token is forced is also
//! refused when forcing the output that follows outgrows llguidance's per-step limits
//! (`start: a0`, `a0: a1 a1`, ... 24 times over: a finite but huge forced output), which
//! llguidance reports only when that token is consumed: the compile consumes it on a copy.
//!
//! At run time a matcher that fails later allows only the end ids from then on, so its sequence
//! ends as a finished one would rather than sampling unconstrained; the detokenizer then reads
//! [`Constraint::failure`] and ends the request with an error instead of the finish. Every
//! sampled token comes from its own mask, so what a grammar can fail on is one of llguidance's
//! parser limits, which some grammars reach only once an output is under way: a forced stretch after a free
//! choice outgrows a step's items (`start: ("a" | "b") a0`, the doubling above), a right
//! recursion as deep as the output outgrows a row's items (`s: "x" s | "x"`, 2,000 items), a
//! regex whose automaton is exponential (`/(a|b)*a(a|b){20}/`) can outgrow the lexer's states
//! (250,000, counted over the whole output) or its fuel for one step. Such a failure
//! ([`exceeded_limits`]) is the request's grammar's doing, a 400 naming its field (an error
//! event in a stream). Any other failure is the server's, a 500: a token outside the mask (a
//! backend's bug), a mask that allows nothing while generating, an error or a panic inside
//! llguidance. What a grammar bounds itself (a rule's `max_tokens`, a `stop`) is no failure:
//! llguidance ends that lexeme or sub-grammar there, and the output goes on.
//! A stretch past the limits after a free choice is not looked for when the grammar compiles:
//! see [`GrammarCompiler::compile`].
//!
//! Speculative decoding (CUDA backend) computes the mask after each draft with the drafts
//! committed, then takes them back ([`Constraint::allowed_through`]). A parser limit reached
//! only along drafts goes with them: the matcher is rebuilt from the tokens before the drafts
//! (it cannot take tokens back once failed), and the failure is the request's only should the
//! same tokens be kept, so the outcome is that of one token per step. A limit of llguidance's
//! lexer (its states, counted over the whole output; its fuel for one step) is reached in an
//! automaton that every copy of a matcher shares (`Matcher::clone`; only
//! [`Matcher::deep_clone`] copies it), that stays in error once it is, and that keeps the
//! states built for drafts taken back. So each constraint keeps the compile's matcher, never
//! advanced, whose deep copy starts a lexer of its own; after a lexer limit that drafts may
//! have caused (reached along drafts, or while the lexer holds states of drafts taken back),
//! the constraint replays one token per step on such a copy (the tokens kept, the mask
//! before each, which builds states too), and fails only where that fails: the same tokens,
//! sets and failure as one token per step. A replay costs about what the masks so far did
//! (4,000 tokens: 4 ms for a JSON schema, 105 ms for an exponential regex); replays coming
//! faster than the output doubles isolate the constraint: drafts would go through a deep
//! copy of the matcher (its lexer never sees them), which costs about what the lexer holds
//! (0.1 ms for that JSON schema, 5 ms for that regex at 4,000 tokens, 95 ms near the 250,000
//! states of the default limit) inside the backend's step, which every sequence of the batch
//! waits for. So an isolated constraint asks for no more drafts
//! ([`TokenConstraint::wants_drafts`]): the engine plans none for its sequence from the next
//! step on (the backend still verifies drafts for it: its draft verifier's answer does not
//! change), and the copy is paid at most once over the sequence, by the step in flight; the
//! sequence then goes one token per step. See `GrammarConstraint::replayed`. One
//! difference stays: a lexer warmed by drafts taken back spends less fuel on states it built
//! for them, so a step that one token per step fails for its fuel may pass (never the other
//! way). The CPU backend commits only sampled tokens.
//!
//! Grammars compile on a [`CompilePool`] of their own ([`LazyGrammarCompiler::compile_then`]),
//! never on the threads that encode prompts, and the work of one compile is bounded: by
//! llguidance's limits, by [`MAX_INTERSECTED_PATTERNS`] (checked before compiling: one step of
//! llguidance's check of an intersection of patterns grows exponentially with their number,
//! and its fuel is only counted between steps), and by [`COMPILE_DEADLINE`].

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use llguidance::api::{ParserLimits, StopReason, TopLevelGrammar};
use llguidance::earley::ParserError;
use llguidance::{Matcher, ParserFactory};
use switchyard_gpu::model::Tokenizer;
use switchyard_gpu::{Constraint, TokenConstraint};
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::metric_names as names;
use crate::productive::check_finite_sentence;

/// Most bytes of a schema, regex, grammar or all choices together in one request.
pub const MAX_SPEC_BYTES: usize = 64 * 1024;
/// The `param` a refusal of a request's structured-output specification names (it does not
/// compile, or no output satisfies it): vLLM's field for it, which the HTTP layer replaces
/// with the field the request carried it in (`api::engine::STRUCTURED_OUTPUT_PARAM`).
pub const STRUCTURED_OUTPUT_PARAM: &str = "structured_outputs";
/// Most alternatives of a choice.
pub const MAX_CHOICES: usize = 1024;

/// Most JSON-schema `pattern`s and string `format`s that may meet in one intersection (through
/// `allOf`, `anyOf` / `oneOf` inside it, and `$ref`s with their siblings), counted before
/// compiling (over-approximated: the counts of branches merged by `allOf` add up whatever
/// they constrain). llguidance checks every intersection of patterns for emptiness; one step
/// of that check grows exponentially with the number of patterns (20 patterns like
/// `.*a.*b.*`, a 953-byte schema, took 45 s) and its fuel is only counted between steps. Eight
/// take about a millisecond; llguidance itself gives up on most intersections of more than
/// three patterns ("unable to determine if regex is empty").
pub const MAX_INTERSECTED_PATTERNS: usize = 8;
/// Most `%json` schemas looked into in one Lark grammar (a tool-call grammar has one per tool).
pub const MAX_EMBEDDED_SCHEMAS: usize = 256;
/// Most schema nodes visited when counting patterns (a schema is at most [`MAX_SPEC_BYTES`]).
const MAX_COUNT_STEPS: usize = 1 << 20;
/// Deepest nesting of schemas followed when counting patterns; deeper counts as every pattern
/// of the document.
const MAX_COUNT_DEPTH: usize = 256;

/// Longest output a regex may force from its start ([`forced_start`]) before it compiles.
/// llguidance walks a forced stretch byte by byte when the first mask is computed, and fails
/// one past its lexer's fuel ("too many expressions constructed") only after seconds of work
/// (`a{1000}{1000}`: 4 to 10 s). Its own limit lies near 275,000 bytes for the cheapest
/// stretch there is, one byte repeated (`a{250000}` compiles, `a{300000}` does not; `(ab)`
/// repeated and nested repetitions give out sooner), so a start of more than this bound
/// (about twice that) never compiled: it is refused at once, in llguidance's words. The
/// test `llguidance_refuses_a_forced_start_of_the_bound` holds llguidance to it.
pub const MAX_FORCED_START_BYTES: u64 = 1 << 19;

/// Refuses a specification whose compile would do unbounded work that llguidance's own limits
/// do not cover: JSON schemas (their own, or a Lark grammar's `%json` ones) whose patterns meet
/// in an intersection of more than [`MAX_INTERSECTED_PATTERNS`]; and one whose compile would
/// take seconds to reach llguidance's limits: a regex that forces more than
/// [`MAX_FORCED_START_BYTES`] from its start.
pub fn check_work(spec: &StructuredOutput) -> Result<(), String> {
    match spec {
        StructuredOutput::Regex(r) => check_forced_start(r),
        StructuredOutput::JsonSchema(schema) => check_patterns(schema),
        StructuredOutput::Grammar(g) | StructuredOutput::ToolCalls(g) => {
            let mut seen = 0;
            let mut from = 0;
            while let Some(at) = g[from..].find("%json") {
                let start = from + at + "%json".len();
                seen += 1;
                if seen > MAX_EMBEDDED_SCHEMAS {
                    return Err(format!(
                        "the grammar has more than {MAX_EMBEDDED_SCHEMAS} %json schemas"
                    ));
                }
                let rest = &g[start..];
                let skipped = rest.len() - rest.trim_start().len();
                let mut values = serde_json::Deserializer::from_str(rest.trim_start())
                    .into_iter::<serde_json::Value>();
                from = match values.next() {
                    Some(Ok(schema)) => {
                        check_patterns(&schema)?;
                        start + skipped + values.byte_offset()
                    }
                    // Not JSON after all: llguidance says what is wrong.
                    _ => start,
                };
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Refuses a regex whose output starts with more than [`MAX_FORCED_START_BYTES`] forced
/// bytes, worded as llguidance's own refusal of it after its walk. A regex llguidance's
/// parser (regex-syntax, with its defaults) does not read is left to llguidance.
fn check_forced_start(regex: &str) -> Result<(), String> {
    let Ok(hir) = regex_syntax::Parser::new().parse(regex) else {
        return Ok(());
    };
    let (n, _) = forced_start(&hir);
    if n > MAX_FORCED_START_BYTES {
        return Err(format!(
            "the output it forces from its start exceeds the parser's limits (it forces at \
             least {n} bytes; at most {MAX_FORCED_START_BYTES} are followed)"
        ));
    }
    Ok(())
}

/// How many bytes every match of `hir` starts with that no choice precedes (a lower bound on
/// what llguidance forces: an alternation, a class of more than one character, an optional
/// or open-ended count, and an assertion all stop it), and whether that is the whole match.
/// Saturating: a count of counts never overflows.
fn forced_start(hir: &regex_syntax::hir::Hir) -> (u64, bool) {
    use regex_syntax::hir::{Class, HirKind};
    match hir.kind() {
        HirKind::Empty => (0, true),
        HirKind::Literal(l) => (l.0.len() as u64, true),
        HirKind::Class(Class::Unicode(c)) => match c.ranges() {
            [r] if r.start() == r.end() => (r.start().len_utf8() as u64, true),
            _ => (0, false),
        },
        HirKind::Class(Class::Bytes(c)) => match c.ranges() {
            [r] if r.start() == r.end() => (1, true),
            _ => (0, false),
        },
        HirKind::Look(_) | HirKind::Alternation(_) => (0, false),
        HirKind::Capture(c) => forced_start(&c.sub),
        HirKind::Repetition(r) => {
            let (n, whole) = forced_start(&r.sub);
            if whole {
                let exact = r.max == Some(r.min) || n == 0;
                (n.saturating_mul(u64::from(r.min)), exact)
            } else if r.min > 0 {
                (n, false)
            } else {
                (0, false)
            }
        }
        HirKind::Concat(parts) => {
            let mut total = 0u64;
            for part in parts {
                let (n, whole) = forced_start(part);
                total = total.saturating_add(n);
                if !whole {
                    return (total, false);
                }
            }
            (total, true)
        }
    }
}

fn check_patterns(schema: &serde_json::Value) -> Result<(), String> {
    let mut counter = PatternCounter {
        root: schema,
        total: count_all_patterns(schema),
        references: HashMap::new(),
        steps: 0,
    };
    let n = counter.count(schema, 0);
    if counter.steps > MAX_COUNT_STEPS {
        return Err(format!(
            "the JSON schema is too complex to check: its references reach more than {MAX_COUNT_STEPS} subschemas"
        ));
    }
    if n > MAX_INTERSECTED_PATTERNS {
        return Err(format!(
            "the JSON schema intersects up to {n} string patterns or formats (through allOf or \
             $ref); at most {MAX_INTERSECTED_PATTERNS} may meet, since checking such an \
             intersection takes time exponential in their number"
        ));
    }
    Ok(())
}

/// `pattern`s and `format`s anywhere in `v`: what a reference that cannot be followed may
/// bring.
fn count_all_patterns(v: &serde_json::Value) -> usize {
    let mut n = 0;
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            serde_json::Value::Object(o) => {
                n += o
                    .iter()
                    .filter(|(k, v)| (*k == "pattern" || *k == "format") && v.is_string())
                    .count();
                stack.extend(o.values());
            }
            serde_json::Value::Array(a) => stack.extend(a),
            _ => {}
        }
    }
    n
}

/// Counts, for a schema, the most patterns that can meet in one intersection (see
/// [`MAX_INTERSECTED_PATTERNS`]).
struct PatternCounter<'a> {
    root: &'a serde_json::Value,
    /// Every pattern and format of the document.
    total: usize,
    /// Counts of the references followed (0 while one is being counted: a recursive schema
    /// does not intersect itself).
    references: HashMap<&'a str, usize>,
    steps: usize,
}

impl<'a> PatternCounter<'a> {
    /// Keywords whose subschemas constrain other values (properties, items, ...): each is an
    /// intersection of its own.
    const NESTED: [&'static str; 11] = [
        "additionalProperties",
        "items",
        "additionalItems",
        "contains",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "not",
        "if",
        "then",
        "else",
    ];
    /// Keywords holding maps or lists of such subschemas.
    const NESTED_MAPS: [&'static str; 4] = [
        "properties",
        "patternProperties",
        "prefixItems",
        "dependentSchemas",
    ];

    fn count(&mut self, schema: &'a serde_json::Value, depth: usize) -> usize {
        self.steps += 1;
        let Some(obj) = schema.as_object() else {
            return 0;
        };
        if depth > MAX_COUNT_DEPTH || self.steps > MAX_COUNT_STEPS {
            return self.total;
        }
        let mut own = ["pattern", "format"]
            .iter()
            .filter(|k| obj.get(**k).is_some_and(serde_json::Value::is_string))
            .count();
        if let Some(serde_json::Value::String(r)) = obj.get("$ref") {
            own += self.reference(r, depth);
        }
        if let Some(serde_json::Value::Array(all)) = obj.get("allOf") {
            for branch in all {
                own += self.count(branch, depth + 1);
            }
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(serde_json::Value::Array(any)) = obj.get(key) {
                let most = any.iter().map(|b| self.count(b, depth + 1)).max();
                own += most.unwrap_or(0);
            }
        }
        // What nested values get is counted as if merged with this schema's own (an allOf of
        // objects merges their properties): an over-approximation.
        let mut nested = 0;
        for key in Self::NESTED {
            if let Some(v) = obj.get(key) {
                let n = match v {
                    serde_json::Value::Array(items) => {
                        items.iter().map(|i| self.count(i, depth + 1)).max()
                    }
                    other => Some(self.count(other, depth + 1)),
                };
                nested = nested.max(n.unwrap_or(0));
            }
        }
        for key in Self::NESTED_MAPS {
            let children: Vec<&'a serde_json::Value> = match obj.get(key) {
                Some(serde_json::Value::Object(m)) => m.values().collect(),
                Some(serde_json::Value::Array(a)) => a.iter().collect(),
                _ => continue,
            };
            for c in children {
                nested = nested.max(self.count(c, depth + 1));
            }
        }
        own + nested
    }

    /// The count of the schema `r` refers to: a JSON pointer into the document is followed
    /// (once); any other reference (an anchor, an `$id`) counts every pattern of the document.
    fn reference(&mut self, r: &'a str, depth: usize) -> usize {
        if let Some(&n) = self.references.get(r) {
            return n;
        }
        let Some(target) = resolve_pointer(self.root, r) else {
            return self.total;
        };
        self.references.insert(r, 0);
        let n = self.count(target, depth + 1);
        self.references.insert(r, n);
        n
    }
}

/// The subschema a local reference (`#`, `#/$defs/a`) points at.
fn resolve_pointer<'a>(root: &'a serde_json::Value, r: &str) -> Option<&'a serde_json::Value> {
    let pointer = r.strip_prefix('#')?;
    if pointer.is_empty() {
        return Some(root);
    }
    let pointer = percent_decode(pointer)?;
    if !pointer.starts_with('/') {
        return None;
    }
    root.pointer(&pointer)
}

/// `s` with its `%XX` escapes decoded (a URI fragment); `None` when they are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).copied(), b.get(i + 2).copied()) {
            (b'%', Some(h), Some(l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h)? * 16 + hex(l)?) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

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
            // The schema `true` (anything) is `{}`, which can carry the options.
            if schema == serde_json::Value::Bool(true) {
                schema = serde_json::json!({});
            }
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

/// How llguidance (1.9) words the one limit error it reports only as text: a row of the
/// Earley parser that outgrows `max_items_in_row` (2,000: a right recursion as deep as the
/// output so far, `s: "x" s | "x"`) when a token is consumed. Its token parser wraps every
/// error of consuming a token's bytes as `Parser Error: ...` with the stop reason
/// `ParserTooComplex`, a token the grammar does not allow (a backend's bug) included, so only
/// the text tells this one apart.
const ROW_LIMIT_ERROR: &str = "Parser Error: Current row has ";

/// How llguidance's matcher begins the text of an error its parser reported as a
/// [`ParserError`] that stands for one of its limits: the variants whose stop reason is
/// `LexerTooComplex` (the lexer's fuel for one step, `step_lexer_fuel`, or its states,
/// `max_lexer_states`, counted over the whole output: its automaton is built as the output
/// explores it) or `ParserTooComplex` (the Earley items of one step, `step_max_items`: its
/// mask, or the bytes it forces). The prefixes are llguidance's own
/// ([`ParserError::message`]), not copies of its wording.
fn limit_error_prefixes() -> impl Iterator<Item = String> {
    [
        ParserError::LexerError(String::new()),
        ParserError::ParserError(String::new()),
    ]
    .into_iter()
    .filter(|e| {
        matches!(
            e.stop_reason(),
            StopReason::LexerTooComplex | StopReason::ParserTooComplex
        )
    })
    .map(|e| e.message())
}

/// How a [`GrammarConstraint`]'s failure past llguidance's limits begins
/// ([`exceeded_limits`]).
const LIMITS_EXCEEDED: &str = "the grammar exceeded the parser's limits";

/// Whether `e`, an error of llguidance's matcher, says that the grammar went past one of its
/// parser limits: a [`ParserError`] of a limit ([`limit_error_prefixes`]), or a row past its
/// items ([`ROW_LIMIT_ERROR`]). The matcher keeps only an error's text (its stop reason is
/// then `InternalError`, whatever the parser's was), so the text is what is read.
fn is_limit_error(e: &str) -> bool {
    let line = first_line(e);
    line.starts_with(ROW_LIMIT_ERROR) || limit_error_prefixes().any(|p| line.starts_with(&p))
}

/// Whether `failure`, a [`Constraint::failure`], is a grammar that went past llguidance's
/// parser limits while generating: the request's own doing (a 400), where any other
/// failure is the server's (a 500).
pub fn exceeded_limits(failure: &str) -> bool {
    failure.starts_with(LIMITS_EXCEEDED)
}

/// The first line of an error, at most 300 bytes of it.
fn first_line(e: &str) -> &str {
    let line = e.lines().next().unwrap_or("");
    let mut end = line.len().min(300);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    &line[..end]
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
            let ids = self.tokenizer.encode(text, false).unwrap_or_default();
            // Text the grammar forces is text, even where it spells a special token
            // (`<|im_end|>`, Mistral's `[TOOL_CALLS]`): the tokenizer would read that as the
            // special id, whose bytes the grammar does not have, and only the end could follow.
            if ids.iter().any(|&id| self.tokenizer.is_special(id)) {
                self.trie.greedy_tokenize(text.as_bytes())
            } else {
                ids
            }
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
        Self::with_limits(tokenizer, ParserLimits::default())
    }

    /// [`GrammarCompiler::new`] with llguidance's `limits` (tests lower them to reach each
    /// one with a small grammar).
    fn with_limits(tokenizer: Arc<Tokenizer>, limits: ParserLimits) -> Result<Self, String> {
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
            ..limits
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
        Ok(self
            .grammar_constraints(spec, end_ids, n)?
            .into_iter()
            .map(Constraint::new)
            .collect())
    }

    /// [`GrammarCompiler::compile`]'s constraints, before they are wrapped.
    fn grammar_constraints(
        &self,
        spec: &StructuredOutput,
        end_ids: &[u32],
        n: usize,
    ) -> Result<Vec<GrammarConstraint>, String> {
        spec.check_bounds()?;
        check_work(spec).map_err(|e| format!("invalid structured output specification: {e}"))?;
        let t0 = std::time::Instant::now();
        let parser = self
            .factory
            .create_parser(spec.grammar())
            .map_err(|e| format!("invalid structured output specification: {e}"))?;
        // A grammar with no finite sentence passes its first tokens and fails later, when the
        // output it forces outgrows llguidance's limits: refused now.
        check_finite_sentence(parser.parser.grammar())
            .map_err(|e| format!("invalid structured output specification: {e}"))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(format!("invalid structured output specification: {e}"));
        }
        // The first mask: a grammar that no output satisfies (a reference that only refers to
        // itself), or whose first step is already beyond llguidance's limits, is the client's
        // error now rather than an empty answer later.
        match matcher.compute_mask_or_eos() {
            Ok(mask) if mask.is_zero() => {
                return Err(
                    "invalid structured output specification: no output satisfies it".into(),
                )
            }
            Ok(mask) => {
                // A forced first token: computing its mask forced the output that follows,
                // and a forced stretch past llguidance's limits is reported only when the
                // token is consumed (the mask of the forced token comes first), a token or two
                // into the answer. Consuming it on a copy reports it now, for one step's work
                // (bounded by the same limits). The copy shares the lexer's cache, which the
                // step only extends as the first token's would.
                //
                // Where the first mask allows more than one token nothing is probed: a forced
                // stretch past the limits may follow any of them, and any later free choice
                // too (the 2nd token or the 100th), in states exponentially many in the
                // depth. Probing the first choice alone would cost a consumed token and a
                // mask per allowed token (a JSON string's first character allows most of the
                // 49,152 tokens of SmolLM2's vocabulary; a mask takes tens of microseconds to
                // milliseconds: seconds per compile against its 10 s deadline) and still miss
                // the later ones; a row's items and the lexer's states grow with the output
                // itself, which no probe of the start sees. Nor does the grammar's text tell:
                // the doubling's 2^23 bytes are a failure when forced (`a23: "x"`) and an
                // output served up to `max_tokens` when not (`a23: "x" | "y"`). Those are
                // the request's error when they happen ([`exceeded_limits`]).
                if mask.num_set() == 1 {
                    if let Some(t) = mask.first_bit_set() {
                        let mut probe = matcher.clone();
                        if let Err(e) = probe.consume_token(t as u32) {
                            let e = e.to_string();
                            if is_limit_error(&e) {
                                return Err(format!(
                                    "invalid structured output specification: the output it \
                                     forces from its start exceeds the parser's limits ({})",
                                    first_line(&e)
                                ));
                            }
                        }
                    }
                }
            }
            Err(e) => {
                let e = e.to_string();
                let why = match first_line(&e) {
                    // llguidance's word for "no token can extend the output and it cannot end".
                    r if r == StopReason::NoExtensionBias.to_string() => "no output satisfies it",
                    other => other,
                };
                return Err(format!(
                    "invalid structured output specification: it fails at the first token ({why})"
                ));
            }
        }
        metrics::histogram!(names::STRUCTURED_COMPILE).record(t0.elapsed().as_secs_f64());
        metrics::counter!(names::STRUCTURED_REQUESTS, "kind" => spec.kind()).increment(1);
        let end_ids: Arc<[u32]> = end_ids.into();
        // Each choice's matcher has a lexer of its own; this one is never advanced again
        // (`GrammarConstraint::pristine`).
        let pristine = Arc::new(matcher);
        Ok((0..n)
            .map(|_| {
                GrammarConstraint::new(pristine.deep_clone(), end_ids.clone(), pristine.clone())
            })
            .collect())
    }
}

/// Threads that compile grammars: at most this many compiles run at once, whatever the load,
/// beside (never on) the threads that encode prompts.
pub const COMPILE_THREADS: usize = 2;
/// Most compiles waiting for a thread; more are refused as an overload (503).
pub const MAX_WAITING_COMPILES: usize = 64;
/// How long a compile may take, and how long one may wait for a thread. A compile past it
/// gets its request a 400 (it was beyond the bounds on work) while its thread finishes it in
/// the background (a thread cannot be stopped; llguidance's limits and
/// [`MAX_INTERSECTED_PATTERNS`] bound what it can do), its result then dropped; one that
/// waited that long gets a 503.
pub const COMPILE_DEADLINE: Duration = Duration::from_secs(10);

/// Why a structured-output specification was not compiled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    /// The specification is the client's error: invalid, unsatisfiable or beyond the bounds
    /// on the work of one compile.
    #[error("{0}")]
    Invalid(String),
    /// Structured output cannot be served for this model (no end-of-sequence token).
    #[error("structured output is unavailable for this model: {0}")]
    Unavailable(String),
    /// Every compile thread is taken and too many compiles wait, or one waited
    /// [`COMPILE_DEADLINE`] for a thread.
    #[error("{0}")]
    Busy(String),
}

/// What a compile yields.
pub type CompileResult = Result<Vec<Constraint>, CompileError>;

/// Where a compile's result goes.
pub trait CompileReply: Send {
    /// Delivers the result.
    fn send(self: Box<Self>, result: CompileResult);
    /// Whether nobody waits for the result any more (the compile is then not started).
    fn is_closed(&self) -> bool {
        false
    }
}

/// A compile's reply, answered once: by the compile, or by the watchdog at the deadline.
struct Pending(parking_lot::Mutex<Option<Box<dyn CompileReply>>>);

impl Pending {
    fn answer(&self, result: CompileResult) -> bool {
        let reply = self.0.lock().take();
        reply.map(|r| r.send(result)).is_some()
    }

    fn answered(&self) -> bool {
        self.0.lock().is_none()
    }

    /// Answered already, or nobody waits for the answer.
    fn gone(&self) -> bool {
        self.0.lock().as_ref().is_none_or(|r| r.is_closed())
    }
}

struct CompileJob {
    run: Box<dyn FnOnce() -> CompileResult + Send>,
    pending: Arc<Pending>,
    queued_at: Instant,
}

#[derive(Default)]
struct PoolState {
    queue: VecDeque<CompileJob>,
    /// Compiles running: when each started, and its reply.
    running: Vec<(Instant, Arc<Pending>)>,
    /// Whether the threads were started (on the first compile).
    started: bool,
}

/// The threads that compile grammars, a bounded queue before them and a watchdog that answers
/// requests whose compile (or wait) passes the deadline.
pub struct CompilePool {
    state: parking_lot::Mutex<PoolState>,
    /// Signals the compile threads: a job was queued.
    work: parking_lot::Condvar,
    /// Signals the watchdog: a deadline was added.
    watch: parking_lot::Condvar,
    threads: usize,
    max_waiting: usize,
    deadline: Duration,
}

impl Default for CompilePool {
    fn default() -> Self {
        Self::new(COMPILE_THREADS, MAX_WAITING_COMPILES, COMPILE_DEADLINE)
    }
}

impl CompilePool {
    /// A pool of `threads` compile threads (started on the first compile), `max_waiting`
    /// compiles queued at most, each given `deadline` to wait and then to compile.
    pub fn new(threads: usize, max_waiting: usize, deadline: Duration) -> Self {
        Self {
            state: parking_lot::Mutex::new(PoolState::default()),
            work: parking_lot::Condvar::new(),
            watch: parking_lot::Condvar::new(),
            threads: threads.max(1),
            max_waiting,
            deadline,
        }
    }

    /// Queues `run`; its result (or the deadline's error) goes to `reply`.
    pub fn submit(
        self: &Arc<Self>,
        run: Box<dyn FnOnce() -> CompileResult + Send>,
        reply: Box<dyn CompileReply>,
    ) {
        let mut state = self.state.lock();
        if state.queue.len() >= self.max_waiting {
            // Compiles nobody waits for any more do not count.
            state.queue.retain(|j| !j.pending.gone());
        }
        if state.queue.len() >= self.max_waiting {
            drop(state);
            reply.send(Err(CompileError::Busy(format!(
                "{} structured output specifications are waiting to compile; retry shortly",
                self.max_waiting
            ))));
            return;
        }
        if !state.started {
            if let Err(e) = self.start_threads() {
                drop(state);
                tracing::error!(error = %e, "structured output: no compile thread started");
                reply.send(Err(CompileError::Unavailable(format!(
                    "no compile thread could be started: {e}"
                ))));
                return;
            }
            state.started = true;
        }
        state.queue.push_back(CompileJob {
            run,
            pending: Arc::new(Pending(parking_lot::Mutex::new(Some(reply)))),
            queued_at: Instant::now(),
        });
        drop(state);
        self.work.notify_one();
        self.watch.notify_one();
    }

    fn start_threads(self: &Arc<Self>) -> std::io::Result<()> {
        for i in 0..self.threads {
            let pool = self.clone();
            std::thread::Builder::new()
                .name(format!("grammar-{i}"))
                // Schemas nest (serde_json allows 128 levels) and llguidance recurses over them.
                .stack_size(16 << 20)
                .spawn(move || pool.compile_loop())?;
        }
        let pool = self.clone();
        std::thread::Builder::new()
            .name("grammar-watchdog".into())
            .spawn(move || pool.watchdog_loop())?;
        Ok(())
    }

    fn compile_loop(&self) {
        loop {
            let job = {
                let mut state = self.state.lock();
                loop {
                    match state.queue.pop_front() {
                        // Nobody waits for it (the requester went away, or the watchdog
                        // answered it): not started.
                        Some(job) if job.pending.gone() => continue,
                        Some(job) => {
                            state.running.push((Instant::now(), job.pending.clone()));
                            break job;
                        }
                        None => self.work.wait(&mut state),
                    }
                }
            };
            self.watch.notify_one();
            let result = std::panic::catch_unwind(AssertUnwindSafe(job.run)).unwrap_or_else(|_| {
                Err(CompileError::Invalid(
                    "invalid structured output specification: the grammar compiler failed on it"
                        .into(),
                ))
            });
            self.state
                .lock()
                .running
                .retain(|(_, p)| !Arc::ptr_eq(p, &job.pending));
            if !job.pending.answer(result) {
                tracing::warn!(
                    waited_ms = job.queued_at.elapsed().as_millis() as u64,
                    "structured output: a compile finished after its deadline; its request was refused"
                );
            }
        }
    }

    fn watchdog_loop(&self) {
        let mut state = self.state.lock();
        loop {
            let now = Instant::now();
            let mut waited = Vec::new();
            let deadline = self.deadline;
            state.queue.retain(|j| {
                let late = now >= j.queued_at + deadline;
                if late {
                    waited.push(j.pending.clone());
                }
                !late
            });
            let late: Vec<Arc<Pending>> = state
                .running
                .iter()
                .filter(|(started, p)| now >= *started + deadline && !p.answered())
                .map(|(_, p)| p.clone())
                .collect();
            let next = state
                .queue
                .iter()
                .map(|j| j.queued_at + deadline)
                .chain(
                    state
                        .running
                        .iter()
                        .filter(|(started, p)| *started + deadline > now && !p.answered())
                        .map(|(started, _)| *started + deadline),
                )
                .min();
            if !waited.is_empty() || !late.is_empty() {
                parking_lot::MutexGuard::unlocked(&mut state, || {
                    for p in waited {
                        p.answer(Err(CompileError::Busy(format!(
                            "no grammar compiler was free within {} s; retry shortly",
                            deadline.as_secs_f32()
                        ))));
                    }
                    for p in late {
                        metrics::counter!(names::STRUCTURED_FAILURES).increment(1);
                        tracing::warn!(
                            "structured output: a compile passed its deadline; refusing its request"
                        );
                        p.answer(Err(CompileError::Invalid(format!(
                            "invalid structured output specification: it did not compile within \
                             {} s (a grammar that costly is refused; on a heavily loaded server a \
                             retry may succeed)",
                            deadline.as_secs_f32()
                        ))));
                    }
                });
                continue;
            }
            match next {
                Some(at) => {
                    self.watch.wait_until(&mut state, at);
                }
                None => self.watch.wait(&mut state),
            }
        }
    }
}

/// A [`GrammarCompiler`] built on first use (on a compile thread), and the [`CompilePool`]
/// that compiles with it.
#[derive(Clone, Default)]
pub struct LazyGrammarCompiler {
    compiler: Arc<OnceLock<Result<GrammarCompiler, String>>>,
    pool: Arc<CompilePool>,
}

impl LazyGrammarCompiler {
    /// Compiles on `pool` (see [`CompilePool::new`]).
    pub fn with_pool(pool: CompilePool) -> Self {
        Self {
            compiler: Arc::default(),
            pool: Arc::new(pool),
        }
    }

    /// The compiler for `tokenizer`, built now if this is the first call.
    pub fn get(&self, tokenizer: &Arc<Tokenizer>) -> Result<&GrammarCompiler, String> {
        get_compiler(&self.compiler, tokenizer)
    }

    /// Compiles `spec` on the compile pool (see [`GrammarCompiler::compile`]); the result goes
    /// to `reply`.
    pub fn compile_then(
        &self,
        tokenizer: &Arc<Tokenizer>,
        spec: StructuredOutput,
        end_ids: Vec<u32>,
        n: usize,
        reply: Box<dyn CompileReply>,
    ) {
        let compiler = self.compiler.clone();
        let tokenizer = tokenizer.clone();
        self.submit(
            Box::new(move || {
                get_compiler(&compiler, &tokenizer)
                    .map_err(CompileError::Unavailable)?
                    .compile(&spec, &end_ids, n)
                    .map_err(CompileError::Invalid)
            }),
            reply,
        );
    }

    /// Runs `run` on the compile pool.
    pub fn submit(
        &self,
        run: Box<dyn FnOnce() -> CompileResult + Send>,
        reply: Box<dyn CompileReply>,
    ) {
        self.pool.submit(run, reply);
    }
}

fn get_compiler<'a>(
    cell: &'a OnceLock<Result<GrammarCompiler, String>>,
    tokenizer: &Arc<Tokenizer>,
) -> Result<&'a GrammarCompiler, String> {
    cell.get_or_init(|| {
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

/// One sequence's grammar state.
///
/// Against llguidance's lexer limits (see the module's doc) it keeps the lexer of `matcher`
/// to what one token per step builds, or knows that it does not, in one of three states:
/// - clean (neither `polluted` nor `isolated`): the lexer holds the states of the kept tokens
///   and of the drafts being committed (one path). A lexer limit is one token per step's:
///   along drafts it goes with them ([`GrammarConstraint::back_before`] rebuilds the state
///   before them on a lexer of its own), on kept tokens it is the request's.
/// - `polluted` (drafts were taken back through `matcher`, [`TokenConstraint::rollback`]): a
///   lexer limit may be the drafts', so it is first checked one token per step on a lexer of
///   its own ([`GrammarConstraint::recheck`]), which leaves the constraint clean, and fails
///   only where that fails.
/// - `isolated` (replays came faster than the output doubles, [`GrammarConstraint::replayed`]):
///   it wants no more drafts ([`TokenConstraint::wants_drafts`]); those of a step already
///   planned go through a deep copy ([`Drafts::saved`]), so `matcher` stays clean for the
///   rest of the sequence and needs no replay.
///
/// In the clean and isolated states `masked` keeps the masks one token per step computes
/// (they build lexer states too): a commit that comes without one computes it first.
struct GrammarConstraint {
    matcher: Matcher,
    end_ids: Arc<[u32]>,
    /// What failed, once something did: the sequence then ends.
    failure: Option<String>,
    /// Whether each of the latest commits (at most [`ROLLBACK_WINDOW`]) reached the matcher
    /// (end ids and commits after the grammar stopped do not), so a rollback takes back
    /// exactly what was consumed.
    recent: VecDeque<bool>,
    /// The matcher before the first token: a copy sharing the grammar and the lexer (whose
    /// cache of states only grows), from which the state before drafts is rebuilt should they
    /// fail it (see [`TokenConstraint::rollback`] below).
    origin: Matcher,
    /// The compile's matcher, never advanced after the compile: a deep copy of it is a matcher
    /// before the first token with a lexer of its own, holding only the states the compile
    /// built, from which [`replay`] rebuilds the state of one token per step after a limit of
    /// the lexer (shared by `matcher` and `origin`, and left in error once reached).
    pristine: Arc<Matcher>,
    /// The tokens the matcher consumed, in order (at most the request's `max_tokens`).
    consumed: Vec<u32>,
    /// While drafts are committed ([`TokenConstraint::begin_drafts`]): the state before them.
    drafts: Option<Drafts>,
    /// A failure that drafts led to, taken back with them; the constraint's own should the
    /// same tokens be committed.
    pending: Option<PendingFailure>,
    /// Whether the lexer of `matcher` holds states built for drafts that were taken back
    /// (drafts that went through `matcher` itself): one token per step would not have built
    /// them, so a limit of the lexer reached now may be theirs ([`GrammarConstraint::recheck`]).
    polluted: bool,
    /// Whether drafts go through a copy of the matcher ([`Drafts::saved`]), so that the lexer
    /// of `matcher` holds what one token per step builds, no more: set for the rest of the
    /// sequence when a [`replay`] comes less than twice as far into the output as the one
    /// before it (see [`GrammarConstraint::replayed`]). The constraint then wants no more
    /// drafts ([`TokenConstraint::wants_drafts`]).
    isolated: bool,
    /// How many tokens the last [`replay`] from a fresh lexer went through.
    replayed_at: Option<usize>,
    /// How many tokens every [`replay`] so far went through, together (their bound is tested).
    #[cfg(test)]
    replayed_tokens: usize,
    /// How many draft rounds went through a deep copy of the matcher (isolated).
    #[cfg(test)]
    draft_copies: usize,
    /// Whether the mask where `matcher` stands was computed. One token per step computes the
    /// mask before each token, which builds lexer states of its own; where commits come
    /// without one (the accepted drafts, committed again after they were taken back) while
    /// the lexer is to hold what one token per step builds (isolated, or not polluted), the
    /// mask is computed before the token is consumed.
    masked: bool,
}

/// A [`GrammarConstraint`]'s state before its drafts, to go back to should they lead to a
/// failure (a failed llguidance matcher cannot take tokens back). It holds no copy of the
/// matcher unless the constraint is isolated: a copy takes the parser's whole history (about
/// 0.1 ms per step at 4,000 tokens of JSON), where rebuilding it from
/// [`GrammarConstraint::origin`] (about 2 ms at 4,000) happens only after such a failure.
struct Drafts {
    /// Tokens consumed before the drafts.
    read: usize,
    recent: VecDeque<bool>,
    /// The tokens committed since.
    commits: Vec<u32>,
    /// The failure they led to, and after how many of them.
    failed: Option<(usize, DraftFailure)>,
    /// Where the drafts go through a copy of the matcher (an isolated constraint's, or those
    /// that a [`GrammarConstraint::recheck`] replayed): the matcher before the first draft it
    /// consumed, and its [`GrammarConstraint::masked`], which taking them back puts back.
    saved: Option<(Matcher, bool)>,
}

/// A failure that drafts led to.
struct DraftFailure {
    /// As [`GrammarConstraint::failure`] words it.
    failure: String,
    /// Whether it came from the mask after the last token (else from committing it).
    in_mask: bool,
    /// Whether it was a limit of the lexer, which leaves the lexer of the matcher in error.
    lexer: bool,
}

/// A failure taken back with the drafts that led to it ([`GrammarConstraint::pending`]).
struct PendingFailure {
    /// The tokens, from the state the drafts were taken back to, that led to it.
    path: Vec<u32>,
    /// How many of them were committed since.
    matched: usize,
    what: DraftFailure,
}

/// Most commits a [`GrammarConstraint`] can take back (drafts per step are at most 16).
const ROLLBACK_WINDOW: usize = 32;

/// Whether `e`, an error of llguidance's matcher, comes from its lexer: its states or its fuel
/// for one step, in an automaton that every copy of the matcher shares and that stays in error.
fn is_lexer_error(e: &str) -> bool {
    first_line(e).starts_with(&ParserError::LexerError(String::new()).message())
}

/// Where one token per step failed in a [`replay`].
struct Replayed {
    /// llguidance's error.
    error: String,
    /// How many generated tokens the failure comes after, as [`GrammarConstraint::fail`]
    /// counts them (the token whose consuming failed included).
    read: usize,
    /// Whether it came from a mask (else from consuming a token).
    in_mask: bool,
}

/// Takes `m` through `tokens` as one token per step does: the mask before each token (but the
/// first when `masked`: it was computed), then the token. `before`: the generated tokens `m`
/// consumed already, for [`Replayed::read`].
fn replay(
    m: &mut Matcher,
    masked: &mut bool,
    tokens: &[u32],
    before: usize,
) -> Result<(), Replayed> {
    for (i, &t) in tokens.iter().enumerate() {
        if !*masked {
            m.compute_mask_or_eos().map_err(|e| Replayed {
                error: e.to_string(),
                read: before + i,
                in_mask: true,
            })?;
        }
        *masked = false;
        m.consume_token(t).map_err(|e| Replayed {
            error: e.to_string(),
            read: before + i + 1,
            in_mask: false,
        })?;
    }
    Ok(())
}

impl GrammarConstraint {
    fn new(matcher: Matcher, end_ids: Arc<[u32]>, pristine: Arc<Matcher>) -> Self {
        GrammarConstraint {
            origin: matcher.clone(),
            pristine,
            consumed: Vec::new(),
            matcher,
            end_ids,
            failure: None,
            recent: VecDeque::with_capacity(ROLLBACK_WINDOW),
            drafts: None,
            pending: None,
            polluted: false,
            isolated: false,
            replayed_at: None,
            #[cfg(test)]
            replayed_tokens: 0,
            #[cfg(test)]
            draft_copies: 0,
            masked: false,
        }
    }

    fn allow_end(&self, allowed: &mut [u32]) {
        for &t in self.end_ids.iter() {
            if let Some(w) = allowed.get_mut(t as usize / 32) {
                *w |= 1 << (t % 32);
            }
        }
    }

    /// [`GrammarConstraint::fail_after`] the tokens consumed so far.
    fn fail(&mut self, what: &str, e: impl std::fmt::Display) {
        self.fail_after(what, e, self.consumed.len());
    }

    /// Records what failed and after how many generated tokens (`read`): past llguidance's
    /// limits ([`exceeded_limits`]), with llguidance's first line; else `what` and the whole
    /// error. After a draft (`read` past the tokens before the drafts), it is held with the
    /// drafts ([`Drafts::failed`]) until they are taken back or kept; the constraint allows
    /// only the end ids meanwhile, and its [`TokenConstraint::failure`] stays `None` (read on
    /// another thread, that of the detokenizer, while drafts may be committed here).
    fn fail_after(&mut self, what: &str, e: impl std::fmt::Display, read: usize) {
        let e = e.to_string();
        let after = match read {
            1 => "after 1 generated token".to_owned(),
            n => format!("after {n} generated tokens"),
        };
        let failure = if is_limit_error(&e) {
            format!("{LIMITS_EXCEEDED} {after} ({})", first_line(&e))
        } else {
            format!("{what} failed {after}: {e}")
        };
        if let Some(d) = self
            .drafts
            .as_mut()
            .filter(|d| !d.commits.is_empty() && read > d.read)
        {
            tracing::debug!(error = %e, read, "structured output: {what} failed after a draft");
            d.failed = Some((
                d.commits.len(),
                DraftFailure {
                    failure,
                    in_mask: what == MASK,
                    lexer: is_lexer_error(&e),
                },
            ));
            return;
        }
        tracing::warn!(error = %e, read, "structured output: {what} failed; ending the sequence");
        self.failed(failure);
    }

    /// Records where one token per step failed in a [`replay`].
    fn fail_replayed(&mut self, r: Replayed) {
        let what = if r.in_mask { MASK } else { CONSUME };
        self.fail_after(what, r.error, r.read);
    }

    /// Whether the constraint allows only its end ids: it failed, or its drafts led to a
    /// failure (not its own unless they are kept).
    fn ended(&self) -> bool {
        self.failure.is_some() || self.drafts.as_ref().is_some_and(|d| d.failed.is_some())
    }

    /// Makes `failure` the constraint's.
    fn failed(&mut self, failure: String) {
        metrics::counter!(names::STRUCTURED_FAILURES).increment(1);
        self.failure = Some(failure);
    }

    /// Whether the tokens of a pending failure were all committed (it came from the mask after
    /// them: the next mask).
    fn armed(&self) -> bool {
        self.pending
            .as_ref()
            .is_some_and(|p| p.matched == p.path.len())
    }

    /// A failure from the mask after drafts that were taken back and then committed: the
    /// mask here is that one.
    fn take_armed_failure(&mut self) {
        if self.armed() {
            if let Some(p) = self.pending.take() {
                tracing::warn!("structured output: the token mask failed; ending the sequence");
                self.failed(p.what.failure);
            }
        }
    }

    /// Follows a pending failure's path with a committed token; true when the failure came
    /// from committing this very token (it is then the constraint's).
    fn follow_pending(&mut self, token: u32) -> bool {
        let Some(p) = self.pending.as_mut() else {
            return false;
        };
        if p.path.get(p.matched) != Some(&token) {
            self.pending = None;
            return false;
        }
        p.matched += 1;
        if p.matched < p.path.len() || p.what.in_mask {
            return false;
        }
        if let Some(p) = self.pending.take() {
            tracing::warn!("structured output: consuming a token failed; ending the sequence");
            self.failed(p.what.failure);
        }
        true
    }

    /// The mask where the matcher stands; `None` when it failed (recorded by
    /// [`GrammarConstraint::fail_after`]).
    fn mask(&mut self) -> Option<SimpleVob> {
        match self.matcher.compute_mask_or_eos() {
            Ok(mask) => {
                self.masked = true;
                Some(mask)
            }
            Err(e) if self.polluted && is_lexer_error(&e.to_string()) => match self.recheck(true) {
                Ok(mask) => mask,
                Err(r) => {
                    self.fail_replayed(r);
                    None
                }
            },
            Err(e) => {
                self.fail(MASK, e);
                None
            }
        }
    }

    /// A limit of the lexer reached while its automaton holds states built for drafts that
    /// were taken back ([`GrammarConstraint::polluted`]): one token per step may not reach it.
    /// Builds the state one token per step reaches with a lexer of its own (a deep copy of
    /// [`GrammarConstraint::pristine`]): through the tokens consumed before the drafts, the
    /// mask before each; the drafts consumed since, on a copy kept apart as the state before
    /// them ([`Drafts::saved`]); then the step that failed (the mask after the last token when
    /// `then_mask`, which is returned; else consuming it). `Err`: one token per step fails
    /// too, where it says.
    ///
    /// Cost: a mask and a token per generated token, the masks building every lexer state
    /// again (as much as one token per step did so far), and a deep copy of the matcher when
    /// drafts are committed; at most once per such failure, and bounded over the sequence by
    /// [`GrammarConstraint::replayed`].
    fn recheck(&mut self, then_mask: bool) -> Result<Option<SimpleVob>, Replayed> {
        let t0 = Instant::now();
        self.replayed();
        self.polluted = false;
        let read = self.drafts.as_ref().map_or(self.consumed.len(), |d| d.read);
        let origin = self.pristine.deep_clone();
        let mut m = origin.clone();
        self.origin = origin;
        let mut masked = false;
        let r = replay(&mut m, &mut masked, &self.consumed[..read], 0);
        let drafted = self.consumed[read..].to_vec();
        let r = r.and_then(|()| {
            if drafted.is_empty() {
                return Ok(());
            }
            if !masked {
                m.compute_mask_or_eos().map_err(|e| Replayed {
                    error: e.to_string(),
                    read,
                    in_mask: true,
                })?;
                masked = true;
            }
            let copy = m.deep_clone();
            let before = std::mem::replace(&mut m, copy);
            if let Some(d) = self.drafts.as_mut() {
                d.saved = Some((before, true));
            }
            replay(&mut m, &mut masked, &drafted, read)
        });
        let r = r.and_then(|()| {
            if !then_mask {
                return Ok(None);
            }
            let mask = m.compute_mask_or_eos().map_err(|e| Replayed {
                error: e.to_string(),
                read: self.consumed.len(),
                in_mask: true,
            })?;
            masked = true;
            Ok(Some(mask))
        });
        self.matcher = m;
        self.masked = masked;
        tracing::debug!(
            tokens = self.consumed.len(),
            ok = r.is_ok(),
            elapsed_us = t0.elapsed().as_micros() as u64,
            "structured output: a lexer limit after drafts, checked one token per step"
        );
        r
    }

    /// Notes a [`replay`] through the tokens consumed so far. Each costs about what one token
    /// per step spent on masks so far (measured at 4,000 tokens: 4 ms for a JSON schema's
    /// output, 105 ms for an exponential regex's). One less than twice as far into the output
    /// as the one before it isolates the constraint: drafts would then go through a deep copy
    /// of the matcher, whose lexer never holds a draft's states, so none of its limits needs a
    /// replay again. So the tokens replayed over a sequence add up to at most three times its
    /// output (the replays before isolation at least double each time). A copy costs about
    /// what the lexer holds (measured: 0.1 ms for that JSON schema's lexer, 5 ms for that
    /// regex's at 4,000 tokens, 95 ms near the 250,000 states of llguidance's default limit),
    /// paid inside the backend's step that every sequence of the batch waits for; so an
    /// isolated constraint wants no more drafts ([`TokenConstraint::wants_drafts`]) and the
    /// engine plans none for it: at most the step in flight pays a copy, and the sequence
    /// goes one token per step (measured on a loaded 2-core machine, `/(a|b)*a(a|b){20}/` at
    /// 4,000 tokens: a round of three drafts through a copy 14-15 ms, a step of one token 45-60
    /// us; at 12,000 tokens 53 ms against 49 us). Isolation is not the first answer: it gives
    /// up the sequence's drafts, which replays that come rarely keep.
    fn replayed(&mut self) {
        let at = self.consumed.len();
        if self.replayed_at.is_some_and(|before| at < 2 * before) {
            self.isolated = true;
        }
        self.replayed_at = Some(at);
        #[cfg(test)]
        {
            self.replayed_tokens += at;
        }
    }

    /// Puts back the state before the drafts `d`, which led to a failure (the matcher may be
    /// in error); false when that fails (then the constraint's failure).
    fn back_before(&mut self, d: &mut Drafts, lexer: bool) -> bool {
        let drafted = self.consumed.len() > d.read;
        self.recent = std::mem::take(&mut d.recent);
        self.consumed.truncate(d.read);
        if let Some((m, masked)) = d.saved.take() {
            // The drafts went through a copy (isolated, or since a recheck among them).
            self.matcher = m;
            self.masked = masked;
            return true;
        }
        if lexer {
            // The lexer of `matcher` and `origin` is in error: a lexer of its own, which
            // holds what one token per step builds.
            self.replayed();
            self.polluted = false;
            let origin = self.pristine.deep_clone();
            self.matcher = origin.clone();
            self.origin = origin;
            self.masked = false;
            let t0 = Instant::now();
            let r = replay(&mut self.matcher, &mut self.masked, &self.consumed, 0);
            tracing::debug!(
                tokens = self.consumed.len(),
                elapsed_us = t0.elapsed().as_micros() as u64,
                "structured output: a lexer limit on drafts; the state before them rebuilt"
            );
            return match r {
                Ok(()) => true,
                Err(r) => {
                    self.fail_replayed(r);
                    false
                }
            };
        }
        // The lexer keeps the states the drafts built.
        self.polluted |= drafted;
        self.matcher = self.origin.clone();
        self.masked = false;
        match self.matcher.consume_tokens(&self.consumed) {
            Ok(()) => true,
            Err(e) => {
                self.fail("rebuilding the state before drafts", e);
                false
            }
        }
    }
}

/// What [`GrammarConstraint::fail`] calls a failed mask.
const MASK: &str = "the token mask";
/// What [`GrammarConstraint::fail`] calls a token that failed to be consumed.
const CONSUME: &str = "consuming a token";

impl TokenConstraint for GrammarConstraint {
    fn fill_allowed(&mut self, allowed: &mut [u32]) {
        self.take_armed_failure();
        if !self.ended() {
            if let Some(mask) = self.mask() {
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
                self.fail(MASK, "no token is allowed");
            }
        }
        allowed.fill(0);
        self.allow_end(allowed);
    }

    fn commit(&mut self, token: u32) {
        // The mask this token was sampled from failed (on drafts, then taken back).
        self.take_armed_failure();
        if let Some(d) = self.drafts.as_mut() {
            d.commits.push(token);
        }
        if self.recent.len() == ROLLBACK_WINDOW {
            self.recent.pop_front();
        }
        // An end id ends the request wherever it is sampled (the scheduler ends a sequence at
        // one even before `min_tokens`: the sampler lets one through that early only where the
        // grammar allows nothing else), so the grammar never reads one as text.
        if self.ended()
            || self.matcher.is_stopped()
            || self.end_ids.contains(&token)
            || self.follow_pending(token)
        {
            self.recent.push_back(false);
            return;
        }
        // The mask one token per step computed before this token, where the lexer is to hold
        // what one token per step builds.
        if (self.isolated || !self.polluted) && !self.masked && self.mask().is_none() {
            self.recent.push_back(false);
            return;
        }
        if self.isolated {
            // The first draft consumed: the drafts go through a copy.
            if let Some(d) = self.drafts.as_mut().filter(|d| d.saved.is_none()) {
                let copy = self.matcher.deep_clone();
                d.saved = Some((std::mem::replace(&mut self.matcher, copy), self.masked));
                #[cfg(test)]
                {
                    self.draft_copies += 1;
                }
            }
        }
        self.recent.push_back(true);
        self.consumed.push(token);
        self.masked = false;
        match self.matcher.consume_token(token) {
            Ok(()) => {}
            Err(e) if self.polluted && is_lexer_error(&e.to_string()) => {
                if let Err(r) = self.recheck(false) {
                    self.fail_replayed(r);
                }
            }
            Err(e) => self.fail(CONSUME, e),
        }
    }

    fn can_roll_back(&self) -> bool {
        true
    }

    fn failure(&self) -> Option<String> {
        self.failure.clone()
    }

    /// Not once isolated: each round's drafts would go through a deep copy of the matcher,
    /// which costs about what its lexer holds (see [`GrammarConstraint::replayed`]) inside the
    /// backend's step, for every sequence of it. The engine then plans no more drafts for the
    /// sequence; those of a step already planned still go through a copy.
    fn wants_drafts(&self) -> bool {
        !self.isolated
    }

    fn begin_drafts(&mut self) {
        // A failure from the mask after tokens already committed stays (the mask about to be
        // computed is that one); any other is not followed further: masks through these
        // drafts find it again should they follow its path.
        if !self.armed() {
            self.pending = None;
        }
        // Nothing to go back to where nothing can change: after a failure, or once the
        // grammar stopped (commits no longer reach the matcher).
        self.drafts = (self.failure.is_none() && !self.matcher.is_stopped()).then(|| Drafts {
            read: self.consumed.len(),
            recent: self.recent.clone(),
            commits: Vec::new(),
            failed: None,
            saved: None,
        });
    }

    fn rollback(&mut self, mut n: usize) -> bool {
        if let Some(mut d) = self.drafts.take() {
            let kept = d.commits.len().checked_sub(n);
            if let Some((at, what)) = d.failed.take() {
                let Some(kept) = kept.filter(|&k| k < at) else {
                    // Not taken back: the failure is the constraint's.
                    tracing::warn!("structured output: a failure after drafts was kept");
                    self.failed(what.failure);
                    return false;
                };
                if !self.back_before(&mut d, what.lexer) {
                    return false;
                }
                for &t in &d.commits[..kept] {
                    self.commit(t);
                }
                self.pending = Some(PendingFailure {
                    path: d.commits[kept..at].to_vec(),
                    matched: 0,
                    what,
                });
                return self.failure.is_none();
            }
            if d.saved.is_some() {
                // The drafts went through a copy (isolated, or since a recheck among them):
                // the matcher before them goes back, then the commits before the `n` taken
                // back (any taken back from before the drafts are taken back from it).
                let commits = std::mem::take(&mut d.commits);
                if !self.back_before(&mut d, false) {
                    return false;
                }
                for &t in &commits[..kept.unwrap_or(0)] {
                    self.commit(t);
                }
                if n <= commits.len() {
                    return self.failure.is_none();
                }
                n -= commits.len();
            }
        }
        if n == 0 {
            return true;
        }
        if n > self.recent.len() || self.failure.is_some() {
            return false;
        }
        let consumed = (0..n)
            .filter_map(|_| self.recent.pop_back())
            .filter(|&c| c)
            .count();
        if consumed == 0 {
            return true;
        }
        let left = self.consumed.len().saturating_sub(consumed);
        self.consumed.truncate(left);
        // The lexer keeps the states that the tokens taken back built.
        self.polluted = true;
        self.masked = false;
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
        Arc::new(
            load_model(&path, &switchyard_gpu::progress::NoProgress)
                .expect("SmolLM2 loads")
                .tokenizer,
        )
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
    fn the_schema_true_is_formatted_as_the_empty_schema() {
        // `true` and `{}` both mean any JSON value; both come out as json.dumps writes it
        // (`true` took the parser's free whitespace: newlines after `{`).
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let end = tok.eos_token_ids()[0];
        let vocab = tok.vocab_size();
        let one = |schema: Value| {
            compiler
                .compile(&StructuredOutput::JsonSchema(schema), &[end], 1)
                .expect("compiles")
                .pop()
                .expect("one")
        };
        let (any, empty) = (one(json!(true)), one(json!({})));
        let open = tok.encode("{", false).expect("ids")[0];
        for c in [&any, &empty] {
            c.commit(open);
        }
        let newline = tok.encode("\n", false).expect("ids")[0];
        assert!(!is_allowed(&empty.allowed(vocab), newline as usize));
        assert_eq!(any.allowed(vocab), empty.allowed(vocab));
    }

    #[test]
    fn an_end_id_is_never_read_as_text() {
        // A stop id ends the request wherever it is sampled (before min_tokens too, where the
        // sampler lets one through only when the grammar allows nothing else): the grammar
        // does not read it, and what it allows stays as it was.
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let id = |s: &str| tok.encode(s, false).expect("ids")[0];
        let (end, x, three) = (tok.eos_token_ids()[0], id("x"), id("3"));
        let c = compiler
            .compile(&StructuredOutput::Regex("x3y".into()), &[end, three], 1)
            .expect("compiles")
            .pop()
            .expect("one");
        let vocab = tok.vocab_size();
        c.commit(x);
        let before = c.allowed(vocab);
        assert!(is_allowed(&before, three as usize));
        c.commit(three);
        assert_eq!(c.allowed(vocab), before, "the grammar read the stop id");
        // A finished grammar allows only the end ids, and committing one changes nothing.
        let c = compiler
            .compile(&StructuredOutput::Regex("abc".into()), &[end, x], 1)
            .expect("compiles")
            .pop()
            .expect("one");
        c.commit_all(&tok.encode("abc", false).expect("ids"));
        let ends = |c: &Constraint| -> Vec<usize> {
            let a = c.allowed(vocab);
            (0..vocab).filter(|&t| is_allowed(&a, t)).collect()
        };
        let mut want = vec![end as usize, x as usize];
        want.sort_unstable();
        assert_eq!(ends(&c), want);
        c.commit(x);
        assert_eq!(ends(&c), want);
    }

    /// A grammar whose text spells a special token (SmolLM2's `<|im_start|>`) is written as
    /// text: the forced text was tokenized into the special id, whose bytes the grammar does
    /// not have, so nothing but the end could follow.
    #[test]
    fn forced_text_that_spells_a_special_token_is_written_as_text() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let special = tok.encode("<|im_start|>", false).expect("ids");
        assert!(
            special.len() == 1 && tok.is_special(special[0]),
            "{special:?}"
        );
        let end = tok.eos_token_ids()[0];
        let c = compiler
            .compile(
                &StructuredOutput::Regex(r"<\|im_start\|>[a-z]{2,3}".into()),
                &[end],
                1,
            )
            .expect("compiles")
            .pop()
            .expect("one");
        let vocab = tok.vocab_size();
        // Write the text with the longest allowed token at each step.
        let text = b"<|im_start|>abc";
        let mut at = 0;
        while at < text.len() {
            let allowed = c.allowed(vocab);
            assert!(!is_allowed(&allowed, special[0] as usize), "the special id");
            let (len, t) = (0..vocab)
                .filter(|&t| is_allowed(&allowed, t))
                .filter_map(|t| {
                    let b = tok.token_bytes(t as u32)?;
                    (!b.is_empty() && text[at..].starts_with(b)).then_some((b.len(), t as u32))
                })
                .max()
                .unwrap_or_else(|| panic!("nothing allowed writes the text at byte {at}"));
            c.commit(t);
            at += len;
        }
        assert!(is_allowed(&c.allowed(vocab), end as usize), "the end");
    }

    /// A token the grammar cannot read (a backend that sampled past the mask) fails the
    /// constraint: it says what failed, and allows only the end ids from then on.
    #[test]
    fn a_grammar_that_fails_while_generating_says_so() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let id = |s: &str| tok.encode(s, false).expect("ids")[0];
        let end = tok.eos_token_ids()[0];
        let c = compiler
            .compile(&StructuredOutput::Regex("abc".into()), &[end], 1)
            .expect("compiles")
            .pop()
            .expect("one");
        c.commit(id("a"));
        assert_eq!(c.failure(), None);
        // Drafts taken back are not counted among the generated tokens.
        let vocab = tok.vocab_size();
        assert_eq!(c.allowed_through(vocab, &[id("b")]).len(), 2);
        c.commit(id("z"));
        let failure = c.failure().expect("the grammar failed");
        assert!(
            failure.starts_with("consuming a token failed after 2 generated tokens: "),
            "{failure}"
        );
        // Not a limit of llguidance's: a backend's bug, the server's error.
        assert!(!exceeded_limits(&failure), "{failure}");
        let allowed = c.allowed(vocab);
        let ids: Vec<usize> = (0..vocab).filter(|&t| is_allowed(&allowed, t)).collect();
        assert_eq!(ids, vec![end as usize]);
    }

    /// A Lark grammar of `rules` rules that each double the next (`a0: a1 a1`, ...), the last
    /// `"x"`: 2^(rules - 1) forced `x`s after `prefix`.
    fn doubling(prefix: &str, rules: usize) -> StructuredOutput {
        let mut g = format!("start: {prefix} a0\n");
        for i in 0..rules - 1 {
            g.push_str(&format!("a{i}: a{0} a{0}\n", i + 1));
        }
        g.push_str(&format!("a{}: \"x\"\n", rules - 1));
        StructuredOutput::Grammar(g)
    }

    /// A grammar whose first token is forced and whose forced output then outgrows
    /// llguidance's per-step limits (24 doubling rules: 2^23 `x`s) is refused when it
    /// compiles, not a token into the answer; 11 rules (1,024 `x`s, within the limits) are
    /// followed to their end.
    #[test]
    fn a_forced_start_past_the_parser_limits_is_refused() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let end = [tok.eos_token_ids()[0]];
        let e = compiler
            .compile(&doubling("", 24), &end, 1)
            .expect_err("refused");
        assert!(
            e.starts_with("invalid structured output specification: the output it forces from its start exceeds the parser's limits (parser error: Too many items"),
            "{e}"
        );
        let c = compiler
            .compile(&doubling("", 11), &end, 1)
            .expect("compiles")
            .pop()
            .expect("one");
        let text = walk(&c, &tok, &end, 1, 2000).expect("ends");
        assert_eq!(text, "x".repeat(1024));
        assert_eq!(c.failure(), None);
    }

    /// What a regex forces from its start, as [`check_forced_start`] counts it: a lower
    /// bound that stops at any choice.
    #[test]
    fn forced_starts_are_counted_up_to_the_first_choice() {
        let forced = |r: &str| forced_start(&regex_syntax::Parser::new().parse(r).unwrap());
        assert_eq!(forced("a{1000}{1000}"), (1_000_000, true));
        assert_eq!(forced("(ab){3}c"), (7, true));
        assert_eq!(forced("x(a{1000}){525}y?"), (525_001, false));
        assert_eq!(forced("a{3}b*c{9}"), (3, false));
        assert_eq!(forced("x{2,5}y"), (2, false));
        assert_eq!(forced("(a|b)a{524288}"), (0, false));
        assert_eq!(forced("[a]{4}[\\x{e9}]"), (6, true));
        assert_eq!(forced("^a{9}"), (0, false));
        assert_eq!(forced("(?:){9}a"), (1, true));
        assert_eq!(
            forced("a{4294967295}{4294967295}{4294967295}"),
            (u64::MAX, true)
        );
        for legit in [
            r"\d{1,3}(\.\d{1,3}){3}",
            "[a-z]{1,64}",
            r#"[^"\\]{0,1000}"#,
            "(0|[1-9][0-9]{0,17})",
            "[ab]{1000}{1000}",
        ] {
            assert_eq!(forced(legit).0, 0, "{legit}");
        }
    }

    /// A regex forcing more than [`MAX_FORCED_START_BYTES`] from its start is refused before
    /// llguidance sees it (`a{1000}{1000}` took it 4 to 10 s to refuse), in its words; one
    /// with a choice first, and the patterns clients send, compile.
    #[test]
    fn a_regex_forcing_a_long_start_is_refused_at_once() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let end = [tok.eos_token_ids()[0]];
        // The words "it forces at least" are this check's, not llguidance's: the regex was
        // refused before llguidance compiled it (which took seconds for the first).
        for regex in ["a{1000}{1000}", "(ab){262145}", "x(a{1000}){525}y?"] {
            let e = compiler
                .compile(&StructuredOutput::Regex(regex.into()), &end, 1)
                .expect_err(regex);
            assert!(
                e.starts_with("invalid structured output specification: the output it forces from its start exceeds the parser's limits (it forces at least "),
                "{regex}: {e}"
            );
        }
        for regex in [
            r"\d{1,3}(\.\d{1,3}){3}",
            "[a-z]{1,64}",
            "[ab]{1000}{1000}",
            "(a|b)a{1000}{1000}",
            "a{1000}",
        ] {
            compiler
                .compile(&StructuredOutput::Regex(regex.into()), &end, 1)
                .unwrap_or_else(|e| panic!("{regex}: {e}"));
        }
    }

    /// [`MAX_FORCED_START_BYTES`] is past llguidance's own limit: a forced start one byte
    /// longer, of the cheapest stretch (one byte repeated), fails in llguidance too (given as
    /// a Lark grammar's regex, which the check does not read). Should a later llguidance
    /// follow it, the bound would refuse what compiles: this test says so.
    #[test]
    fn llguidance_refuses_a_forced_start_of_the_bound() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let end = [tok.eos_token_ids()[0]];
        let grammar = format!("start: /a{{{}}}/\n", MAX_FORCED_START_BYTES + 1);
        let e = compiler
            .compile(&StructuredOutput::Grammar(grammar), &end, 1)
            .expect_err("refused by llguidance");
        assert!(
            e.starts_with("invalid structured output specification: the output it forces from its start exceeds the parser's limits (lexer error: too many expressions constructed"),
            "{e}"
        );
    }

    /// A forced stretch past llguidance's limits after a free first token (`"a" | "b"`) cannot
    /// be seen when the grammar compiles; it fails the constraint a token or two in, as a
    /// failure past the parser's limits ([`exceeded_limits`]): the request's error, not the
    /// server's. From then on only the end ids are allowed.
    #[test]
    fn a_grammar_past_the_parser_limits_while_generating_says_so() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let end = tok.eos_token_ids()[0];
        let c = compiler
            .compile(&doubling("(\"a\" | \"b\")", 24), &[end], 1)
            .expect("compiles")
            .pop()
            .expect("one");
        let vocab = tok.vocab_size();
        let mut steps = 0;
        while c.failure().is_none() && steps < 4 {
            let allowed = c.allowed(vocab);
            let t = (0..vocab)
                .find(|&t| is_allowed(&allowed, t) && t != end as usize)
                .expect("a token to go on with");
            c.commit(t as u32);
            steps += 1;
        }
        let failure = c.failure().expect("the grammar failed");
        assert!(exceeded_limits(&failure), "{failure}");
        assert!(steps >= 2, "it failed only after the first token: {steps}");
        assert!(
            failure.starts_with(&format!(
                "the grammar exceeded the parser's limits after {steps} generated tokens \
                 (parser error: Too many items (limit"
            )),
            "{failure}"
        );
        let allowed = c.allowed(vocab);
        let ids: Vec<usize> = (0..vocab).filter(|&t| is_allowed(&allowed, t)).collect();
        assert_eq!(ids, vec![end as usize]);
    }

    /// Commits allowed tokens other than `end`, picked with a seeded generator, until `c`
    /// fails or `steps` went by; the failure, and how many tokens were committed.
    fn walk_until_failure(
        c: &Constraint,
        vocab: usize,
        end: u32,
        seed: u64,
        steps: usize,
    ) -> (Option<String>, usize) {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        for n in 0..steps {
            let allowed = c.allowed(vocab);
            if let Some(f) = c.failure() {
                return (Some(f), n);
            }
            let ids: Vec<u32> = (0..vocab as u32)
                .filter(|&t| t != end && is_allowed(&allowed, t as usize))
                .collect();
            assert!(!ids.is_empty(), "only the end is allowed after {n} tokens");
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            c.commit(ids[(state % ids.len() as u64) as usize]);
        }
        (c.failure(), steps)
    }

    /// Each of llguidance's limits that a grammar can reach only while generating, reached with
    /// llguidance's own parser (each limit lowered so that a small grammar gets there in a few
    /// tokens): a right recursion as deep as the output (a row's items), a regex whose
    /// automaton is exponential (the lexer's states over the output, its fuel for one step).
    /// Each failure is one past the parser's limits ([`exceeded_limits`]: the request's error)
    /// with llguidance's words for it, so a version of llguidance that words them otherwise
    /// fails here. With the default limits the same walks go on.
    #[test]
    fn each_parser_limit_reached_while_generating_is_the_requests_error() {
        let tok = tokenizer();
        let vocab = tok.vocab_size();
        let end = tok.eos_token_ids()[0];
        let recursion = "start: (\"a\" | \"b\") s\ns: \"x\" s | \"x\"\n";
        let exponential = "start: (\"a\" | \"b\") /(a|b)*a(a|b){12}/\n";
        let default = GrammarCompiler::new(tok.clone()).expect("compiler");
        for (limits, grammar, words) in [
            (
                ParserLimits {
                    max_items_in_row: 40,
                    ..ParserLimits::default()
                },
                recursion,
                "Parser Error: Current row has 4",
            ),
            (
                ParserLimits {
                    max_lexer_states: 100,
                    ..ParserLimits::default()
                },
                exponential,
                "lexer error: too many states: 100 >= 100",
            ),
            (
                ParserLimits {
                    step_lexer_fuel: 500,
                    ..ParserLimits::default()
                },
                exponential,
                "lexer error: too many expressions constructed",
            ),
        ] {
            let spec = StructuredOutput::Grammar(grammar.into());
            let compiler = GrammarCompiler::with_limits(tok.clone(), limits).expect("compiler");
            let c = compiler
                .compile(&spec, &[end], 1)
                .expect("compiles")
                .remove(0);
            let (failure, n) = walk_until_failure(&c, vocab, end, 1, 400);
            let failure = failure.unwrap_or_else(|| panic!("{grammar:?} did not fail"));
            assert!(exceeded_limits(&failure), "{failure}");
            assert!(n >= 2, "{failure}");
            assert!(
                failure.starts_with(&format!(
                    "the grammar exceeded the parser's limits after {n} generated tokens ({words}"
                )),
                "{failure}"
            );
            let c = default
                .compile(&spec, &[end], 1)
                .expect("compiles")
                .remove(0);
            assert_eq!(walk_until_failure(&c, vocab, end, 1, n + 1).0, None);
        }
        // The doubling's huge output is a failure only where it is forced: with a choice at
        // its end it is served (up to `max_tokens`).
        let StructuredOutput::Grammar(g) = doubling("(\"a\" | \"b\")", 24) else {
            unreachable!()
        };
        let free = StructuredOutput::Grammar(g.replace("a23: \"x\"", "a23: \"x\" | \"y\""));
        let c = default
            .compile(&free, &[end], 1)
            .expect("compiles")
            .remove(0);
        assert_eq!(walk_until_failure(&c, vocab, end, 1, 64), (None, 64));
    }

    /// llguidance's matcher keeps only the text of an error: its stop reason is then
    /// `InternalError` whatever the parser's was, so a limit is told by the text, from the
    /// prefixes llguidance gives its parser's limit errors (its lexer's and its parser's
    /// `ParserError`s, both "too complex"). Should a later llguidance keep the reason, this
    /// fails, and the reason should be read instead.
    #[test]
    fn the_matcher_keeps_only_the_text_of_a_limit_error() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        assert_eq!(
            limit_error_prefixes().collect::<Vec<_>>(),
            ["lexer error: ", "parser error: "]
        );
        let parser = compiler
            .factory
            .create_parser(doubling("", 24).grammar())
            .expect("parses");
        let mut matcher = Matcher::new(Ok(parser));
        let mask = matcher.compute_mask_or_eos().expect("the first mask");
        assert_eq!(mask.num_set(), 1);
        let t = mask.first_bit_set().expect("the forced token") as u32;
        let e = matcher
            .consume_token(t)
            .expect_err("past the limits")
            .to_string();
        assert!(is_limit_error(&e), "{e}");
        assert!(
            e.starts_with("parser error: Too many items (limit 50000"),
            "{e}"
        );
        assert!(matcher.is_error());
        assert_eq!(matcher.stop_reason(), StopReason::InternalError);
        assert_eq!(matcher.get_error().as_deref(), Some(e.as_str()));
        // A token outside the mask fails with the same stop reason and other words.
        assert!(!is_limit_error(
            "Parser Error: token \"z\" doesn't satisfy the grammar; byte 'z' fails parse"
        ));
    }

    /// The reviewer's schema: 20 intersected patterns took llguidance 45 s before it gave up.
    fn intersected_patterns(n: usize) -> Value {
        let letters: Vec<char> = ('a'..='z').collect();
        let mut all = vec![json!({"type": "string", "pattern": ".*a.*b.*"})];
        for i in 1..n {
            all.push(json!({"pattern": format!(".*{}.*{}.*", letters[i], letters[i + 1])}));
        }
        json!({"allOf": all})
    }

    #[test]
    fn intersections_of_many_patterns_are_refused_before_compiling() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let end = [tok.eos_token_ids()[0]];
        let refused = |spec: StructuredOutput| {
            let e = compiler.compile(&spec, &end, 1).expect_err("refused");
            assert!(
                e.contains(&format!("at most {MAX_INTERSECTED_PATTERNS} may meet")),
                "{e}"
            );
        };
        refused(StructuredOutput::JsonSchema(intersected_patterns(20)));
        refused(StructuredOutput::JsonSchema(intersected_patterns(
            MAX_INTERSECTED_PATTERNS + 1,
        )));
        // Through references, anyOf branches and nested values.
        let defs: serde_json::Map<String, Value> = (0..12)
            .map(|i| (format!("p{i}"), json!({"pattern": format!(".*{i}.*")})))
            .collect();
        let refs: Vec<Value> = (0..12)
            .map(|i| json!({"$ref": format!("#/$defs/p{i}")}))
            .collect();
        refused(StructuredOutput::JsonSchema(
            json!({"$defs": defs, "type": "object",
                   "properties": {"a": {"anyOf": [{"type": "integer"}, {"allOf": refs}]}}}),
        ));
        // A reference the count cannot follow counts every pattern of the document.
        refused(StructuredOutput::JsonSchema(
            json!({"$defs": {"x": {"$anchor": "x", "allOf": intersected_patterns(10)["allOf"]}},
                   "allOf": [{"$ref": "#x"}]}),
        ));
        // A tool's parameters inside the tool-call grammar, and a client's %json.
        let schema = intersected_patterns(20).to_string();
        refused(StructuredOutput::ToolCalls(format!(
            "start: \"<tool_call>\" body\nbody: \"{{\\\"arguments\\\": \" %json{schema} \"}}\"\n"
        )));
        refused(StructuredOutput::Grammar(format!(
            "start: a\na: %json {schema}\n"
        )));
        // What schemas use: a few patterns meeting, many apart, a recursive reference.
        let few = json!({"allOf": [{"type": "string", "pattern": "^[a-z]+$"},
                                   {"pattern": "^.{2,8}$"}]});
        let apart: serde_json::Map<String, Value> = (0..40)
            .map(|i| {
                (
                    format!("f{i}"),
                    json!({"type": "string", "pattern": format!("^[a-z]{{{i}}}$")}),
                )
            })
            .collect();
        let tree = json!({"$defs": {"node": {"type": "object", "properties": {
            "name": {"type": "string", "pattern": "^[a-z]+$"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"});
        for ok in [few, json!({"type": "object", "properties": apart}), tree] {
            check_work(&StructuredOutput::JsonSchema(ok.clone()))
                .unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        let ok = compiler.compile(
            &StructuredOutput::JsonSchema(json!({"allOf": [
                {"type": "string", "pattern": "^[a-z]+$"}, {"pattern": "^.{2,8}$"}]})),
            &end,
            1,
        );
        assert!(ok.is_ok(), "{:?}", ok.err());
    }

    #[test]
    fn grammars_that_fail_at_the_first_token_are_refused() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let end = [tok.eos_token_ids()[0]];
        for (spec, why) in [
            // A reference that only refers to itself: no output satisfies it.
            (
                StructuredOutput::JsonSchema(json!({"$defs": {"a": {"$ref": "#/$defs/a"}},
                                                    "$ref": "#/$defs/a"})),
                "no finite output satisfies it",
            ),
            (
                StructuredOutput::Grammar("start: A\nA: /a/ & /b/\n".into()),
                "no output satisfies it",
            ),
            // Beyond llguidance's lexer limits from the first token.
            (
                StructuredOutput::Regex("(.{1,1000}){1,1000}".into()),
                "lexer error",
            ),
        ] {
            let e = compiler.compile(&spec, &end, 1).expect_err("refused");
            assert!(
                e.starts_with("invalid structured output specification") && e.contains(why),
                "{spec:?}: {e}"
            );
        }
    }

    /// A grammar with no finite sentence (every rule of `start` needs `start` again, directly
    /// or through other rules) is refused when it compiles, naming `start`; recursions with a
    /// way out (an alternative, an optional or repeated part, a `%json` schema) compile.
    #[test]
    fn grammars_with_no_finite_sentence_are_refused() {
        let tok = tokenizer();
        let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
        let end = [tok.eos_token_ids()[0]];
        for grammar in [
            "start: \"{\" start \"}\"",
            "start: a\na: \"(\" b \")\"\nb: \"[\" a \"]\" | a \"x\"",
            "start: \"x\" a\na: \"y\" start",
            "start: a+\na: \"<\" a \">\"",
            "start: \"a\" start | start \"b\"",
        ] {
            let spec = StructuredOutput::Grammar(grammar.to_string());
            let e = compiler.compile(&spec, &end, 1).expect_err(grammar);
            assert!(
                e.starts_with("invalid structured output specification: no finite output"),
                "{grammar}: {e}"
            );
        }
        let e = compiler
            .compile(
                &StructuredOutput::Grammar("start: \"{\" start \"}\"".into()),
                &end,
                1,
            )
            .expect_err("refused");
        assert!(e.contains("every rule of `start`"), "{e}");
        for grammar in [
            "start: \"{\" start \"}\" | \"x\"",
            "start: a\na: \"(\" a \")\" | b\nb: \"[\" b? \"]\"",
            "start: \"<\" start* \">\"",
            "start: \"{\" (start \",\")* \"}\"",
            "start: %json {\"type\": \"object\"}",
            "start: x\nx: /[a-z]+/ x?",
        ] {
            let spec = StructuredOutput::Grammar(grammar.to_string());
            let r = compiler.compile(&spec, &end, 1);
            assert!(r.is_ok(), "{grammar}: {:?}", r.err());
        }
    }

    /// A reply that hands the result to a channel.
    struct ToChannel(std::sync::mpsc::Sender<CompileResult>, bool);

    impl CompileReply for ToChannel {
        fn send(self: Box<Self>, result: CompileResult) {
            let _ = self.0.send(result);
        }
        fn is_closed(&self) -> bool {
            self.1
        }
    }

    /// A job that waits until `release` is dropped or sent to, and says when it started.
    fn blocker(
        started: std::sync::mpsc::Sender<()>,
    ) -> (
        std::sync::mpsc::Sender<()>,
        Box<dyn FnOnce() -> CompileResult + Send>,
    ) {
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let job = Box::new(move || {
            let _ = started.send(());
            let _ = wait.recv();
            Ok(Vec::new())
        });
        (release, job)
    }

    #[test]
    fn the_compile_pool_bounds_its_queue_and_skips_requests_nobody_waits_for() {
        let pool = Arc::new(CompilePool::new(1, 1, Duration::from_secs(3600)));
        let (started_tx, started) = std::sync::mpsc::channel();
        let (release, job) = blocker(started_tx);
        let (tx, first) = std::sync::mpsc::channel();
        pool.submit(job, Box::new(ToChannel(tx, false)));
        started.recv().expect("the first compile started");
        // The thread is busy. A compile nobody waits for is never started and takes no room.
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ran.clone();
        let (gone_tx, _gone) = std::sync::mpsc::channel();
        pool.submit(
            Box::new(move || {
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
                Ok(Vec::new())
            }),
            Box::new(ToChannel(gone_tx, true)),
        );
        // One compile may wait; the next is refused as an overload, at once.
        let (tx, waiting) = std::sync::mpsc::channel();
        pool.submit(
            Box::new(|| Err(CompileError::Invalid("bad".into()))),
            Box::new(ToChannel(tx, false)),
        );
        let (busy_tx, busy) = std::sync::mpsc::channel();
        pool.submit(
            Box::new(|| Ok(Vec::new())),
            Box::new(ToChannel(busy_tx, false)),
        );
        assert!(matches!(busy.recv(), Ok(Err(CompileError::Busy(_)))));
        drop(release);
        assert_eq!(first.recv().expect("answered"), Ok(Vec::new()));
        assert_eq!(
            waiting.recv().expect("answered"),
            Err(CompileError::Invalid("bad".into()))
        );
        assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    fn a_compile_past_its_deadline_is_refused_and_finishes_in_the_background() {
        let pool = Arc::new(CompilePool::new(1, 4, Duration::from_millis(50)));
        let (started_tx, started) = std::sync::mpsc::channel();
        let (release, job) = blocker(started_tx);
        let (tx, slow) = std::sync::mpsc::channel();
        pool.submit(job, Box::new(ToChannel(tx, false)));
        started.recv().expect("started");
        // Queued behind it: refused as an overload once it waited past the deadline.
        let (tx, waiting) = std::sync::mpsc::channel();
        pool.submit(Box::new(|| Ok(Vec::new())), Box::new(ToChannel(tx, false)));
        // The compile is still blocked when its request is refused.
        match slow.recv().expect("answered at the deadline") {
            Err(CompileError::Invalid(m)) => assert!(m.contains("did not compile within"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            waiting.recv().expect("answered"),
            Err(CompileError::Busy(_))
        ));
        // It finishes in the background; its late result goes nowhere, and the thread serves
        // the next compile.
        drop(release);
        let (tx, next) = std::sync::mpsc::channel();
        pool.submit(Box::new(|| Ok(Vec::new())), Box::new(ToChannel(tx, false)));
        assert_eq!(next.recv().expect("answered"), Ok(Vec::new()));
        assert!(slow.try_recv().is_err(), "answered twice");
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

    /// Walks `c` one token at a time along `path` (each token as it comes: the first, then
    /// `next` over and over) until it fails, at most `most` tokens; the allowed sets before
    /// each token and after the last (the one after the failure allows only the end ids),
    /// the tokens committed, the failure, and the failure as it stood right after the last
    /// commit (`None` when it came from the mask after it).
    fn one_at_a_time_until_failure(
        c: &Constraint,
        vocab: usize,
        first: u32,
        next: u32,
        most: usize,
    ) -> (Vec<Vec<u32>>, Vec<u32>, String, Option<String>) {
        let mut sets = Vec::new();
        let mut path = Vec::new();
        let mut after_commit = None;
        loop {
            sets.push(c.allowed(vocab));
            if c.failure().is_some() {
                break;
            }
            assert!(path.len() < most, "no failure within {most} tokens");
            let t = if path.is_empty() { first } else { next };
            assert!(
                is_allowed(sets.last().expect("a set"), t as usize),
                "{path:?}"
            );
            c.commit(t);
            path.push(t);
            after_commit = c.failure();
            if after_commit.is_some() {
                sets.push(c.allowed(vocab));
                break;
            }
        }
        let failure = c.failure().expect("failed");
        (sets, path, failure, after_commit)
    }

    /// Speculative decoding computes the mask after each draft with the drafts committed, then
    /// takes them back. A grammar that goes past llguidance's parser limits only along the
    /// drafts (`"a"` then a right recursion: past a row's items when a token is committed, or
    /// past a step's items in the mask after one; `"a"` then an exponential regex: past the
    /// lexer's states or its fuel for one step, in a mask, which leaves the lexer that every
    /// copy of the matcher shares in error; each limit lowered to be reached within the
    /// drafts) while the accepted path (`"b"` then `x`s) never does is no failure:
    /// the outcome is that of decoding one token at a time. The sets through the drafts are
    /// still those of one token at a time, the one after the failure allowing only the end.
    /// Should the drafts be accepted after all, the failure is the constraint's, with the words
    /// one token at a time gives it: at the token whose commit failed, or at the mask after
    /// the last one (not before: a sequence that stops at that token did not fail). The same
    /// through an [`Intersection`] (`bad_words` beside the grammar).
    #[test]
    fn a_limit_reached_only_on_drafts_goes_with_them() {
        let tok = tokenizer();
        let vocab = tok.vocab_size();
        let end = tok.eos_token_ids()[0];
        let id = |s: &str| {
            let ids = tok.encode(s, false).expect("ids");
            assert_eq!(ids.len(), 1, "{s:?}");
            ids[0]
        };
        let (a, b, x) = (id("a"), id("b"), id("x"));
        let exponential = "start: \"a\" s | \"b\" t\ns: /(a|b)*a(a|b){12}/\nt: /x+/\n";
        let mut kinds = Vec::new();
        for (limits, grammar, next) in [
            (
                ParserLimits {
                    max_items_in_row: 12,
                    ..ParserLimits::default()
                },
                "start: \"a\" s | \"b\" t\ns: \"x\" s | \"x\"\nt: /x+/\n",
                x,
            ),
            (
                ParserLimits {
                    step_max_items: 40,
                    ..ParserLimits::default()
                },
                "start: \"a\" s | \"b\" t\ns: \"a\" s | \"a\"\nt: /x+/\n",
                a,
            ),
            (
                ParserLimits {
                    max_lexer_states: 60,
                    ..ParserLimits::default()
                },
                exponential,
                a,
            ),
            (
                ParserLimits {
                    step_lexer_fuel: 200,
                    ..ParserLimits::default()
                },
                exponential,
                a,
            ),
        ] {
            let compiler = GrammarCompiler::with_limits(tok.clone(), limits).expect("compiler");
            let spec = StructuredOutput::Grammar(grammar.into());
            let fresh = || {
                compiler
                    .compile(&spec, &[end], 1)
                    .expect("compiles")
                    .remove(0)
            };
            let (mut sets, path, failure, after_commit) =
                one_at_a_time_until_failure(&fresh(), vocab, a, next, 12);
            assert!(exceeded_limits(&failure), "{failure}");
            assert!(path.len() >= 2, "{grammar:?} failed at {path:?}");
            kinds.push(after_commit.is_some());
            // One more draft, after the failure: not allowed, its set repeats.
            let mut drafts = path.clone();
            drafts.push(next);
            sets.push(sets.last().expect("sets").clone());
            let wrappers: [fn(Constraint) -> Constraint; 2] = [
                |g| g,
                |g| {
                    let words: Arc<[Vec<u32>]> = vec![vec![7, 7]].into();
                    Constraint::new(switchyard_gpu::Intersection::new(
                        vec![Box::new(g), Box::new(switchyard_gpu::BadWords::new(words))],
                        vec![0].into(),
                    ))
                },
            ];
            // Before the drafts, a round of drafts rejected at once (nothing is committed)
            // or none. Those take the lexer into states that one token at a time never builds.
            let start = |pollute: bool| {
                let g = fresh();
                if pollute {
                    g.allowed_through(vocab, &[a, b, b, a, b, b, b]);
                }
                g
            };
            for (wrap, pollute) in wrappers.into_iter().flat_map(|w| [(w, false), (w, true)]) {
                // Rejected: the accepted path goes on as if the drafts had never been.
                let (g, plain) = (start(pollute), fresh());
                let c = wrap(g.clone());
                assert_eq!(c.allowed_through(vocab, &drafts), sets, "{grammar:?}");
                assert_eq!(
                    g.failure(),
                    None,
                    "{grammar:?}: a failure on rejected drafts"
                );
                for i in 0..20 {
                    let want = plain.allowed(vocab);
                    assert_eq!(g.allowed(vocab), want, "{grammar:?}: token {i}");
                    let t = if i == 0 { b } else { x };
                    assert!(is_allowed(&want, t as usize));
                    g.commit(t);
                    plain.commit(t);
                }
                assert_eq!(g.failure(), None);
                // Accepted, then the end sampled from the set after the failure.
                let g = start(pollute);
                let c = wrap(g.clone());
                assert_eq!(c.allowed_through(vocab, &drafts), sets);
                assert_eq!(g.failure(), None);
                c.commit_all(&path);
                assert_eq!(g.failure(), after_commit, "{grammar:?}");
                c.commit(end);
                assert_eq!(g.failure(), Some(failure.clone()), "{grammar:?}");
                // Accepted up to the failure, then a token the grammar allows there: the
                // failure stands where it came from the commit; from the mask, the mask after
                // the drafts was never computed on this path, so it is not one.
                let g = start(pollute);
                assert_eq!(g.allowed_through(vocab, &drafts), sets);
                g.commit_all(&path[..path.len() - 1]);
                assert_eq!(g.failure(), None);
                // A draft round on the accepted path reaches the same failure.
                let through = g.allowed_through(vocab, &path[path.len() - 1..]);
                assert_eq!(through, sets[path.len() - 1..=path.len()]);
                assert_eq!(g.failure(), None);
                // Its state rebuilt from the tokens before the drafts.
                assert_eq!(g.allowed(vocab), sets[path.len() - 1]);
                g.commit(path[path.len() - 1]);
                g.commit(end);
                assert_eq!(g.failure(), Some(failure.clone()), "{grammar:?}");
            }
        }
        assert_eq!(
            kinds,
            [true, false, false, false],
            "a failed commit, then failed masks"
        );
    }

    /// While drafts are committed, a failure they led to is not the constraint's: its
    /// `failure()` stays `None` until they are taken back (then none) or kept. The detokenizer
    /// reads `failure()` on its own thread when a choice finishes (a stop string) while the
    /// backend may be between the locked calls of `allowed_through` for a later step of that
    /// sequence; a failure seen there failed a request that had none. A part of an
    /// [`Intersection`] beside the grammar reads it at each of those calls here.
    #[test]
    fn a_failure_on_drafts_is_not_seen_while_they_are_committed() {
        struct Spy {
            grammar: Constraint,
            seen: Arc<std::sync::Mutex<Vec<Option<String>>>>,
        }
        impl TokenConstraint for Spy {
            fn fill_allowed(&mut self, allowed: &mut [u32]) {
                self.seen.lock().expect("seen").push(self.grammar.failure());
                allowed.fill(!0);
            }
            fn commit(&mut self, _: u32) {
                self.seen.lock().expect("seen").push(self.grammar.failure());
            }
            fn can_roll_back(&self) -> bool {
                true
            }
            fn rollback(&mut self, _: usize) -> bool {
                true
            }
        }
        let tok = tokenizer();
        let vocab = tok.vocab_size();
        let end = tok.eos_token_ids()[0];
        let id = |s: &str| tok.encode(s, false).expect("ids")[0];
        let (a, x) = (id("a"), id("x"));
        let limits = ParserLimits {
            max_items_in_row: 12,
            ..ParserLimits::default()
        };
        let compiler = GrammarCompiler::with_limits(tok.clone(), limits).expect("compiler");
        let spec = StructuredOutput::Grammar(
            "start: \"a\" s | \"b\" t\ns: \"x\" s | \"x\"\nt: /x+/\n".into(),
        );
        let fresh = || {
            compiler
                .compile(&spec, &[end], 1)
                .expect("compiles")
                .remove(0)
        };
        let (_, path, failure, _) = one_at_a_time_until_failure(&fresh(), vocab, a, x, 12);
        let g = fresh();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let c = Constraint::new(switchyard_gpu::Intersection::new(
            vec![
                Box::new(g.clone()),
                Box::new(Spy {
                    grammar: g.clone(),
                    seen: seen.clone(),
                }),
            ],
            vec![end].into(),
        ));
        c.allowed_through(vocab, &path);
        let seen = seen.lock().expect("seen").clone();
        assert_eq!(seen.len(), 2 * path.len() + 1, "every draft committed");
        assert!(seen.iter().all(Option::is_none), "{seen:?}");
        assert_eq!(g.failure(), None);
        // Kept after all: the failure is the constraint's.
        c.commit_all(&path);
        c.commit(end);
        assert_eq!(g.failure(), Some(failure));
    }

    /// A [`GrammarConstraint`] that the test can look into while a [`Constraint`] drives it.
    #[derive(Clone)]
    struct Shared(Arc<parking_lot::Mutex<GrammarConstraint>>);

    impl Shared {
        /// The `n` constraints (choices) [`GrammarCompiler::compile`] gives for `spec`.
        fn compile(
            compiler: &GrammarCompiler,
            spec: &StructuredOutput,
            end: u32,
            n: usize,
        ) -> Vec<Self> {
            let gs = compiler
                .grammar_constraints(spec, &[end], n)
                .expect("compiles");
            gs.into_iter()
                .map(|g| Shared(Arc::new(parking_lot::Mutex::new(g))))
                .collect()
        }

        /// A [`Constraint`] driving it.
        fn constraint(&self) -> Constraint {
            Constraint::new(self.clone())
        }
    }

    impl TokenConstraint for Shared {
        fn fill_allowed(&mut self, allowed: &mut [u32]) {
            self.0.lock().fill_allowed(allowed);
        }
        fn commit(&mut self, token: u32) {
            self.0.lock().commit(token);
        }
        fn can_roll_back(&self) -> bool {
            self.0.lock().can_roll_back()
        }
        fn rollback(&mut self, n: usize) -> bool {
            self.0.lock().rollback(n)
        }
        fn begin_drafts(&mut self) {
            self.0.lock().begin_drafts();
        }
        fn failure(&self) -> Option<String> {
            self.0.lock().failure()
        }
        fn wants_drafts(&self) -> bool {
            self.0.lock().wants_drafts()
        }
    }

    /// One token per step along `path` until it fails: the allowed set before each token, and
    /// after a failure the one after it (only the end ids); and the failure.
    fn one_token_per_step(
        c: &Constraint,
        vocab: usize,
        path: &[u32],
    ) -> (Vec<Vec<u32>>, Option<String>) {
        let mut sets = Vec::new();
        for &t in path {
            sets.push(c.allowed(vocab));
            if c.failure().is_some() {
                break;
            }
            c.commit(t);
            if c.failure().is_some() {
                sets.push(c.allowed(vocab));
                break;
            }
        }
        (sets, c.failure())
    }

    /// Speculative decoding along `path` as the CUDA backend drives a constraint: round `r`
    /// drafts the next `r % 3` tokens of `path`, then `junk(r, next)` (whose first token is
    /// not the path's `next`: rejected, but committed while the masks through the drafts are
    /// computed), takes the sets through them ([`Constraint::allowed_through`]), and commits
    /// the accepted drafts and the token sampled after them: the path's next, or the end where
    /// the set allows only it. Each row used (up to the first rejected draft) must equal one token per
    /// step's (`plain`, from [`one_token_per_step`]); returns the failure in the end.
    /// `engine_stops`: as the engine plans, a round after the constraint stopped wanting drafts
    /// ([`Constraint::wants_drafts`], read between rounds) has none (the set where it stands,
    /// as the backend asks it for a row without drafts); else every round drafts whatever
    /// the constraint wants (a backend verifies every draft it is given).
    fn speculate(
        c: &Constraint,
        vocab: usize,
        end: u32,
        path: &[u32],
        plain: &(Vec<Vec<u32>>, Option<String>),
        junk: impl Fn(usize, u32) -> Vec<u32>,
        engine_stops: bool,
    ) -> Option<String> {
        let (want, failure) = plain;
        let fail_row = failure.as_ref().map(|_| want.len() - 1);
        let (mut i, mut round) = (0, 0);
        while i < want.len() {
            let drafting = !engine_stops || c.wants_drafts();
            let accepted = if drafting {
                (round % 3).min(path.len() - 1 - i)
            } else {
                0
            };
            let mut drafts = path[i..i + accepted].to_vec();
            if drafting {
                let junk = junk(round, path[i + accepted]);
                assert_ne!(
                    junk.first(),
                    Some(&path[i + accepted]),
                    "junk that is not rejected"
                );
                drafts.extend(junk);
            }
            let sets = if drafts.is_empty() {
                vec![c.allowed(vocab)]
            } else {
                c.allowed_through(vocab, &drafts)
            };
            for (j, set) in sets.iter().enumerate().take(accepted + 1) {
                let row = i + j;
                assert_eq!(set, &want[row], "round {round}, row {row}");
                if Some(row) == fail_row {
                    c.commit_all(&path[i..row]);
                    c.commit(end);
                    return c.failure();
                }
                assert_eq!(c.failure(), None, "round {round}, row {row}");
            }
            c.commit_all(&path[i..=i + accepted]);
            i += accepted + 1;
            round += 1;
        }
        c.failure()
    }

    /// A limit of llguidance's lexer (its states, counted over the whole output; its fuel for
    /// one step) is reached in an automaton that every copy of the matcher shares and that
    /// stays in error, and the states it builds for drafts stay when they are taken back. With
    /// an exponential regex and the lexer's limits lowered, speculative decoding whose drafts
    /// are rejected each round ([`speculate`]: the tokens of the drafts that the model rejects
    /// take the lexer into states one token per step never visits) sees the same sets and the
    /// same outcome as one token per step: no failure where the tokens kept do not reach the
    /// limit (the drafts' states would: this failed before the constraint replayed the tokens
    /// kept on a lexer of its own after such a limit), and the same failure, after as many
    /// tokens and in the same words, where they do. Kept paths of `a`s (few states) and of
    /// random `a`s and `b`s (many), rejected drafts of random tokens of `a`s and `b`s; the
    /// replays go from the first (the drafts then go on through the matcher) to isolation
    /// (through a copy) along the way. The same again as the engine plans: once isolated, the
    /// constraint wants no drafts and gets none (at most one round through a copy), with the
    /// same outcome.
    #[test]
    fn lexer_limits_with_rejected_drafts_give_the_outcome_of_one_token_per_step() {
        let tok = tokenizer();
        let vocab = tok.vocab_size();
        let end = tok.eos_token_ids()[0];
        let ab: Vec<u32> = (0..vocab as u32)
            .filter(|&t| {
                let b = tok.token_bytes(t).unwrap_or_default();
                !tok.is_special(t) && !b.is_empty() && b.iter().all(|c| b"ab".contains(c))
            })
            .collect();
        assert!(ab.len() >= 4, "{ab:?}");
        let a = tok.encode("a", false).expect("ids")[0];
        let random = |seed: u64, n: usize, not_first: u32| {
            let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut out = Vec::with_capacity(n);
            while out.len() < n {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let t = ab[(state % ab.len() as u64) as usize];
                if !(out.is_empty() && t == not_first) {
                    out.push(t);
                }
            }
            out
        };
        let spec = StructuredOutput::Grammar("start: /(a|b)*a(a|b){12}/\n".into());
        let mut outcomes = Vec::new();
        let mut replays = Vec::new();
        // Draft rounds through a copy of the matcher: drafting on, and as the engine plans.
        let mut copies = Vec::new();
        let states = |n| ParserLimits {
            max_lexer_states: n,
            ..ParserLimits::default()
        };
        let fuel = |n| ParserLimits {
            step_lexer_fuel: n,
            ..ParserLimits::default()
        };
        for limits in [
            states(60),
            states(100),
            states(200),
            states(400),
            states(800),
        ]
        .into_iter()
        .chain([fuel(400), fuel(800)])
        {
            let words = if limits.max_lexer_states < ParserLimits::default().max_lexer_states {
                "lexer error: too many states"
            } else {
                "lexer error: too many expressions constructed"
            };
            let compiler =
                GrammarCompiler::with_limits(tok.clone(), limits.clone()).expect("compiler");
            let fresh = || {
                compiler
                    .compile(&spec, &[end], 1)
                    .expect("compiles")
                    .remove(0)
            };
            for path in [vec![a; 96], random(7, 96, u32::MAX)] {
                let plain = one_token_per_step(&fresh(), vocab, &path);
                if let Some(f) = &plain.1 {
                    assert!(exceeded_limits(f), "{f}");
                    assert!(f.contains(words), "{f}");
                }
                let junk = |round: usize, next: u32| random(round as u64 + 100, 4, next);
                // Two choices of one request: the first's drafts, replays and limits leave
                // the second's lexer as it was (each has its own), so it then goes one token
                // per step as a fresh constraint does.
                let choices = Shared::compile(&compiler, &spec, end, 2);
                let (g, other) = (&choices[0], &choices[1]);
                let got = speculate(&g.constraint(), vocab, end, &path, &plain, junk, false);
                assert_eq!(got, plain.1, "{limits:?} along {path:?}");
                let second = one_token_per_step(&other.constraint(), vocab, &path);
                assert!(
                    second == plain,
                    "{limits:?}: the second choice ends {:?}, not {:?}",
                    second.1,
                    plain.1
                );
                outcomes.push(plain.1.is_some());
                // What the replays cost: at most three times the output (the tokens kept).
                let g = g.0.lock();
                assert!(
                    g.replayed_tokens <= 3 * g.consumed.len(),
                    "{limits:?}: {} tokens replayed for {}",
                    g.replayed_tokens,
                    g.consumed.len()
                );
                replays.push((g.replayed_at.is_some(), g.isolated, plain.1.is_some()));
                // As the engine plans: the same rounds until the constraint isolates itself;
                // from then on it wants no drafts and gets none, so only the round that
                // isolated it went through a copy of the matcher, where drafting on makes a
                // copy every round; the outcome is one token per step's either way.
                let stopped = &Shared::compile(&compiler, &spec, end, 1)[0];
                let c = stopped.constraint();
                let got = speculate(&c, vocab, end, &path, &plain, junk, true);
                assert_eq!(got, plain.1, "{limits:?} along {path:?}, drafts stopped");
                let s = stopped.0.lock();
                assert_eq!(s.isolated, g.isolated, "{limits:?}");
                assert_eq!(c.wants_drafts(), !s.isolated, "{limits:?}");
                assert!(
                    s.draft_copies <= 1,
                    "{limits:?}: {} draft rounds through a copy",
                    s.draft_copies
                );
                copies.push((g.draft_copies, s.draft_copies));
            }
        }
        // Drafting on after isolation copies the matcher round after round.
        assert!(
            copies.iter().any(|&(on, stopped)| on > 10 * stopped.max(1)),
            "{copies:?}"
        );
        // Whether one token per step fails, per limit (along `a`s, then along the random
        // path): both outcomes, under each kind of limit.
        assert_eq!(
            outcomes,
            [
                true, true, false, true, false, true, false, true, false, false, true, true, false,
                false
            ]
        );
        // The paths went through both states of a constraint that replays: drafts through
        // the matcher after a replay, and isolated (drafts through a copy), each with and
        // without a failure in the end.
        for (isolated, failed) in [(false, false), (false, true), (true, false), (true, true)] {
            assert!(
                replays.contains(&(true, isolated, failed)),
                "isolated {isolated}, failed {failed}: {replays:?}"
            );
        }
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
