//! The OpenAI Batch file format, without IO: an input file's lines read and checked, one
//! output line per input line, and the buffer that writes answers in input order.
//!
//! An input line is `{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions",
//! "body": {...}}` (OpenAI's `BatchRequestInput`; its `custom_id` a string of at most
//! [`MAX_CUSTOM_ID_BYTES`]); an output line is
//! `{"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200,
//! "request_id": "...", "body": {...}}, "error": null}` (`BatchRequestOutput`). A line that is
//! not a valid batch line gets `"response": null` and an `error` naming the line; a request
//! the API refuses gets its status and the API's error body in `response`, as OpenAI writes
//! it. What refuses the whole file (its size, its number of lines, a duplicate `custom_id`)
//! is a [`FileError`], found before any line runs.

use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;
use serde_json::{json, Value};

/// Largest input file, in bytes: OpenAI's bound on a batch input file (200 MB).
pub const MAX_FILE_BYTES: u64 = 200 * 1000 * 1000;

/// Most requests (non-blank lines) in one input file: OpenAI's bound.
pub const MAX_LINES: usize = 50_000;

/// Bytes a line may take beyond the server's body limit (`server.max_body_bytes`), for its
/// `custom_id`, `method` and `url`: a longer line is refused unread. The body itself is held
/// to the server's own limit by the server (a 413, as `serve` answers).
pub const ENVELOPE_BYTES: usize = 64 * 1024;

/// The routes a batch line may name, as OpenAI's Batch API takes them (less its
/// `/v1/moderations`, which Switchyard does not serve).
pub const URLS: [&str; 4] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
];

/// Longest `custom_id`, in bytes. OpenAI documents no bound; this one (the length OpenAI
/// allows a metadata value) keeps the ids the duplicate check holds, one per line, small.
pub const MAX_CUSTOM_ID_BYTES: usize = 512;

/// Why a whole input file is refused before anything runs.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FileError {
    /// The file is larger than [`MAX_FILE_BYTES`].
    #[error("the input is larger than {MAX_FILE_BYTES} bytes (OpenAI's bound on a batch file)")]
    TooLarge,
    /// The file holds more than [`MAX_LINES`] requests.
    #[error("the input has more than {MAX_LINES} requests (OpenAI's bound on a batch file)")]
    TooManyLines,
    /// The file holds no request.
    #[error("the input holds no request (every line is blank)")]
    Empty,
    /// Two lines share a `custom_id` (OpenAI refuses such a file).
    #[error(
        "lines {first} and {second} have the same custom_id `{custom_id}`: each must be unique"
    )]
    DuplicateCustomId {
        /// The shared id.
        custom_id: String,
        /// The first line holding it (1-based).
        first: usize,
        /// The second line holding it.
        second: usize,
    },
}

/// One non-blank line of the input: its 1-based number in the file and its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputLine<'a> {
    /// The line's number in the file, counting blank lines (1-based).
    pub number: usize,
    /// The line's bytes, without its line ending.
    pub bytes: &'a [u8],
}

/// The requests of `input`: its non-blank lines (blank ones, and a final line ending, are no
/// request), refused whole when there are more than [`MAX_LINES`] or none. Lines that are not
/// valid batch lines are kept: each gets its own error. Two lines with the same `custom_id`
/// are refused by [`check_unique_ids`], which needs the configured bound on a line. A UTF-8
/// byte order mark before the first line (a file saved by a Windows editor) is skipped, as
/// `serve` skips one before a request body (RFC 8259 section 8.1).
pub fn split_lines(input: &[u8]) -> Result<Vec<InputLine<'_>>, FileError> {
    let input = input.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(input);
    let mut lines = Vec::new();
    for (i, raw) in input.split(|&b| b == b'\n').enumerate() {
        let bytes = raw.strip_suffix(b"\r").unwrap_or(raw);
        if bytes.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if lines.len() == MAX_LINES {
            return Err(FileError::TooManyLines);
        }
        lines.push(InputLine {
            number: i + 1,
            bytes,
        });
    }
    if lines.is_empty() {
        return Err(FileError::Empty);
    }
    Ok(lines)
}

/// Refuses two lines with the same `custom_id`, naming both. A line counts when its output
/// line names its `custom_id` (see [`counted_id`]), so that no two output lines name the same
/// one: a line refused for another field counts, and a line whose id [`parse_line`] does not
/// read (not JSON, not a string, too long, or the whole line longer than `max_line_bytes`,
/// which [`parse_line`] refuses unread as `line_too_long`) is left to its own error.
pub fn check_unique_ids(lines: &[InputLine<'_>], max_line_bytes: usize) -> Result<(), FileError> {
    let mut seen: HashMap<String, usize> = HashMap::with_capacity(lines.len());
    for line in lines {
        let Some(custom_id) = counted_id(*line, max_line_bytes) else {
            continue;
        };
        if let Some(&first) = seen.get(&custom_id) {
            return Err(FileError::DuplicateCustomId {
                custom_id,
                first,
                second: line.number,
            });
        }
        seen.insert(custom_id, line.number);
    }
    Ok(())
}

/// The `custom_id` that `line`'s output line names, which [`parse_line`] reads with the same
/// `max_line_bytes`: the last `custom_id` key of an object that repeats it, a string of at
/// most [`MAX_CUSTOM_ID_BYTES`]; none for a line longer than `max_line_bytes`.
fn counted_id(line: InputLine<'_>, max_line_bytes: usize) -> Option<String> {
    if line.bytes.len() > max_line_bytes {
        return None;
    }
    let IdOnly(id) = serde_json::from_slice::<IdOnly>(line.bytes).ok()?;
    custom_id(id).ok()
}

/// A line's `custom_id` value, the rest of the line skipped unparsed (so the duplicate check
/// holds no line in memory); `None` when the line is an object without one. Not an object:
/// an error.
struct IdOnly(Option<Value>);

impl<'de> Deserialize<'de> for IdOnly {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = IdOnly;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<IdOnly, A::Error> {
                let mut id = None;
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "custom_id" {
                        // The last one wins, as in the line's `Value` (a JSON map).
                        id = Some(map.next_value::<Value>()?);
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
                Ok(IdOnly(id))
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

/// Why a line's `custom_id` is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
enum BadCustomId {
    /// There is none.
    Missing,
    /// It is not a string: the JSON type it is.
    NotAString(&'static str),
    /// It is longer than [`MAX_CUSTOM_ID_BYTES`]: its length.
    TooLong(usize),
}

/// The id a line's `custom_id` value (`None`: absent) stands for, as OpenAI's format has it:
/// a string of at most [`MAX_CUSTOM_ID_BYTES`].
fn custom_id(value: Option<Value>) -> Result<String, BadCustomId> {
    match value {
        Some(Value::String(id)) if id.len() > MAX_CUSTOM_ID_BYTES => {
            Err(BadCustomId::TooLong(id.len()))
        }
        Some(Value::String(id)) => Ok(id),
        Some(other) => Err(BadCustomId::NotAString(json_type(&other))),
        None => Err(BadCustomId::Missing),
    }
}

/// The JSON type of `value`, as an error names it.
fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A valid batch line: what to send where.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchRequest {
    /// The line's number in the file (1-based).
    pub number: usize,
    /// The caller's id for the line, echoed in its output line.
    pub custom_id: String,
    /// The route, one of [`URLS`].
    pub url: &'static str,
    /// The request's body, a JSON object sent as the HTTP API's request body.
    pub body: serde_json::Map<String, Value>,
}

/// A line that is not a valid batch line: the output line's `error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineError {
    /// The line's `custom_id` when it could be read.
    pub custom_id: Option<String>,
    /// A machine-readable code (`invalid_json_line`, `missing_required_parameter`,
    /// `invalid_method`, `invalid_url`, `invalid_body`, `line_too_long`).
    pub code: &'static str,
    /// What is wrong, naming the line.
    pub message: String,
}

/// Reads one line as a batch request. `max_line_bytes` bounds the line (see
/// [`ENVELOPE_BYTES`]).
pub fn parse_line(line: InputLine<'_>, max_line_bytes: usize) -> Result<BatchRequest, LineError> {
    let n = line.number;
    let error = |custom_id: Option<String>, code, message: String| LineError {
        custom_id,
        code,
        message: format!("line {n}: {message}"),
    };
    let missing = |custom_id: Option<String>, field: &str| {
        error(
            custom_id,
            "missing_required_parameter",
            format!("{field} is missing"),
        )
    };
    if line.bytes.len() > max_line_bytes {
        return Err(error(
            None,
            "line_too_long",
            format!(
                "{} bytes, more than the {max_line_bytes} a line may have \
                 (server.max_body_bytes for the body and {ENVELOPE_BYTES} for the rest)",
                line.bytes.len()
            ),
        ));
    }
    let value: Value = serde_json::from_slice(line.bytes)
        .map_err(|e| error(None, "invalid_json_line", format!("not valid JSON: {e}")))?;
    let Value::Object(mut fields) = value else {
        return Err(error(
            None,
            "invalid_json_line",
            "not a JSON object".to_owned(),
        ));
    };
    let custom_id = match custom_id(fields.remove("custom_id")) {
        Ok(id) => id,
        Err(BadCustomId::Missing) => return Err(missing(None, "custom_id")),
        Err(BadCustomId::NotAString(kind)) => {
            return Err(error(
                None,
                "invalid_custom_id",
                format!("custom_id must be a string, not {kind}"),
            ))
        }
        Err(BadCustomId::TooLong(len)) => {
            return Err(error(
                None,
                "invalid_custom_id",
                format!(
                    "custom_id is {len} bytes long, more than the {MAX_CUSTOM_ID_BYTES} \
                     it may have"
                ),
            ))
        }
    };
    let id = Some(custom_id.clone());
    match fields.get("method") {
        Some(Value::String(m)) if m == "POST" => {}
        Some(other) => {
            return Err(error(
                id,
                "invalid_method",
                format!("method must be \"POST\", not {}", short(other)),
            ))
        }
        None => return Err(missing(id, "method")),
    }
    let url = match fields.get("url") {
        Some(Value::String(u)) => match URLS.iter().find(|known| *known == u) {
            Some(known) => *known,
            None => {
                return Err(error(
                    id,
                    "invalid_url",
                    format!(
                        "url {} is not one a batch may name ({})",
                        short(&Value::String(u.clone())),
                        URLS.join(", ")
                    ),
                ))
            }
        },
        Some(other) => {
            return Err(error(
                id,
                "invalid_url",
                format!("url must be a string, not {}", short(other)),
            ))
        }
        None => return Err(missing(id, "url")),
    };
    let body = match fields.remove("body") {
        Some(Value::Object(body)) => body,
        Some(_) => {
            return Err(error(
                id,
                "invalid_body",
                "body must be a JSON object".to_owned(),
            ))
        }
        None => return Err(missing(id, "body")),
    };
    Ok(BatchRequest {
        number: n,
        custom_id,
        url,
        body,
    })
}

/// `value` as JSON, cut to 64 characters: what an error message quotes of a line.
fn short(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(64) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// A body field asking for an answer a batch line cannot give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unbatchable {
    /// `"stream": true`: a batch answer is whole.
    Stream,
    /// `"background": true` on `/v1/responses`: its answer would be a `queued` response whose
    /// end no output line would hold.
    Background,
}

impl Unbatchable {
    /// The field, as the 400's `param` names it.
    pub fn param(self) -> &'static str {
        match self {
            Self::Stream => "stream",
            Self::Background => "background",
        }
    }

    /// The 400's message.
    pub fn message(self) -> &'static str {
        match self {
            Self::Stream => {
                "a batch answer is whole: \"stream\": true is not supported in a batch file"
            }
            Self::Background => {
                "a batch answer is the finished response: \"background\": true is not \
                 supported in a batch file"
            }
        }
    }
}

/// The field of `body` (sent to `url`) that asks for an answer a batch cannot give, if any:
/// such a line is refused with a 400 (the API's error body, naming the field).
pub fn unbatchable(url: &str, body: &serde_json::Map<String, Value>) -> Option<Unbatchable> {
    let on = |field: &str| body.get(field) == Some(&Value::Bool(true));
    if on("stream") {
        Some(Unbatchable::Stream)
    } else if url == "/v1/responses" && on("background") {
        Some(Unbatchable::Background)
    } else {
        None
    }
}

/// What became of one line: the output line's `response` or its `error`.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The API answered (any status).
    Response {
        /// The HTTP status.
        status_code: u16,
        /// The request's id (its `x-request-id`).
        request_id: String,
        /// The JSON body the API returned.
        body: Value,
    },
    /// The line is not a valid batch line.
    Error(LineError),
}

impl Outcome {
    /// Whether the request succeeded (a 2xx answer).
    pub fn succeeded(&self) -> bool {
        matches!(self, Self::Response { status_code, .. } if (200..300).contains(status_code))
    }

    /// The tokens the answer generated (`usage.completion_tokens`, a response's
    /// `usage.output_tokens`; 0 for embeddings and failures).
    pub fn output_tokens(&self) -> u64 {
        match self {
            Self::Response { body, .. } if self.succeeded() => body
                .pointer("/usage/completion_tokens")
                .or_else(|| body.pointer("/usage/output_tokens"))
                .and_then(Value::as_u64)
                .unwrap_or(0),
            _ => 0,
        }
    }
}

/// The output line (without its line ending) for a line whose id is `id`
/// (`batch_req_<hex>`) and whose `custom_id` is `custom_id`.
pub fn output_line(id: &str, custom_id: Option<&str>, outcome: &Outcome) -> String {
    let (custom_id, response, error) = match outcome {
        Outcome::Response {
            status_code,
            request_id,
            body,
        } => (
            custom_id,
            json!({"status_code": status_code, "request_id": request_id, "body": body}),
            Value::Null,
        ),
        Outcome::Error(e) => (
            custom_id.or(e.custom_id.as_deref()),
            Value::Null,
            json!({"code": e.code, "message": e.message}),
        ),
    };
    json!({"id": id, "custom_id": custom_id, "response": response, "error": error}).to_string()
}

/// Output lines that completed out of order, held until every line before them is written:
/// at most as many as lines are in flight.
#[derive(Debug, Default)]
pub struct InOrder {
    /// The index (0-based, among the requests) of the next line to write.
    next: usize,
    /// Completed lines after `next`.
    held: BTreeMap<usize, String>,
}

impl InOrder {
    /// Takes line `index`'s output and returns the lines now writable, in order.
    pub fn push(&mut self, index: usize, line: String) -> Vec<String> {
        self.held.insert(index, line);
        let mut ready = Vec::new();
        while let Some(line) = self.held.remove(&self.next) {
            ready.push(line);
            self.next += 1;
        }
        ready
    }

    /// How many lines have been released for writing.
    pub fn written(&self) -> usize {
        self.next
    }

    /// How many completed lines wait for an earlier one.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(text: &str) -> InputLine<'_> {
        InputLine {
            number: 7,
            bytes: text.as_bytes(),
        }
    }

    /// The code and message of `text`'s error as one line 7.
    fn check_error(text: &str, code: &str, message: &str) {
        let e = parse_line(line(text), 4096).expect_err(text);
        assert_eq!(e.code, code, "{text}: {e:?}");
        assert!(e.message.starts_with("line 7: "), "{e:?}");
        assert!(e.message.contains(message), "{text}: {e:?}");
    }

    #[test]
    fn a_valid_line_is_read() {
        let r = parse_line(
            line(r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"prompt":"x"}}"#),
            4096,
        )
        .unwrap();
        assert_eq!(r.custom_id, "a");
        assert_eq!(r.url, "/v1/completions");
        assert_eq!(r.number, 7);
        assert_eq!(Value::Object(r.body), json!({"prompt": "x"}));
    }

    #[test]
    fn invalid_lines_get_their_own_errors() {
        check_error("{not json", "invalid_json_line", "not valid JSON");
        check_error("[1,2]", "invalid_json_line", "not a JSON object");
        check_error(
            r#"{"method":"POST","url":"/v1/completions","body":{}}"#,
            "missing_required_parameter",
            "custom_id is missing",
        );
        for (id, kind) in [
            ("5", "a number"),
            ("null", "null"),
            (r#"{"a":1}"#, "an object"),
            (r#"["a"]"#, "an array"),
            ("true", "a boolean"),
        ] {
            check_error(
                &format!(
                    r#"{{"custom_id":{id},"method":"POST","url":"/v1/completions","body":{{}}}}"#
                ),
                "invalid_custom_id",
                &format!("custom_id must be a string, not {kind}"),
            );
        }
        check_error(
            &format!(
                r#"{{"custom_id":"{}","method":"POST","url":"/v1/completions","body":{{}}}}"#,
                "x".repeat(MAX_CUSTOM_ID_BYTES + 1)
            ),
            "invalid_custom_id",
            "custom_id is 513 bytes long, more than the 512",
        );
        check_error(
            r#"{"custom_id":"a","method":"GET","url":"/v1/completions","body":{}}"#,
            "invalid_method",
            r#"not "GET""#,
        );
        check_error(
            r#"{"custom_id":"a","url":"/v1/completions","body":{}}"#,
            "missing_required_parameter",
            "method is missing",
        );
        check_error(
            r#"{"custom_id":"a","method":"POST","url":"/v1/moderations","body":{}}"#,
            "invalid_url",
            "/v1/moderations",
        );
        check_error(
            r#"{"custom_id":"a","method":"POST","url":"http://evil/v1/completions","body":{}}"#,
            "invalid_url",
            "not one a batch may name",
        );
        check_error(
            r#"{"custom_id":"a","method":"POST","body":{}}"#,
            "missing_required_parameter",
            "url is missing",
        );
        check_error(
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":"x"}"#,
            "invalid_body",
            "must be a JSON object",
        );
        check_error(
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions"}"#,
            "missing_required_parameter",
            "body is missing",
        );
    }

    #[test]
    fn an_error_keeps_the_custom_id_it_could_read() {
        let e = parse_line(
            line(r#"{"custom_id":"keep","method":"PUT","url":"/v1/completions","body":{}}"#),
            4096,
        )
        .unwrap_err();
        assert_eq!(e.custom_id.as_deref(), Some("keep"));
        let out: Value =
            serde_json::from_str(&output_line("batch_req_1", None, &Outcome::Error(e))).unwrap();
        assert_eq!(out["custom_id"], "keep");
        assert_eq!(out["response"], Value::Null);
        assert_eq!(out["error"]["code"], "invalid_method");
    }

    #[test]
    fn every_url_openai_batches_and_switchyard_serves_is_read() {
        for url in URLS {
            let text = format!(r#"{{"custom_id":"a","method":"POST","url":"{url}","body":{{}}}}"#);
            assert_eq!(parse_line(line(&text), 4096).unwrap().url, url);
        }
        assert!(URLS.contains(&"/v1/responses"));
    }

    #[test]
    fn a_custom_id_at_the_bound_is_read() {
        let id = "é".repeat(MAX_CUSTOM_ID_BYTES / 2);
        let text = format!(
            r#"{{"custom_id":"{id}","method":"POST","url":"/v1/completions","body":{{}}}}"#
        );
        assert_eq!(parse_line(line(&text), 4096).unwrap().custom_id, id);
    }

    #[test]
    fn a_long_line_is_refused_unread() {
        let text = format!(
            r#"{{"custom_id":"a","method":"POST","url":"/v1/completions","body":{{"prompt":"{}"}}}}"#,
            "x".repeat(100)
        );
        let e = parse_line(line(&text), 64).unwrap_err();
        assert_eq!(e.code, "line_too_long");
        assert!(parse_line(line(&text), text.len()).is_ok());
    }

    #[test]
    fn an_error_message_quotes_little_of_a_long_value() {
        let url = "/".repeat(10_000);
        let text = format!(r#"{{"custom_id":"a","method":"POST","url":"{url}","body":{{}}}}"#);
        let e = parse_line(line(&text), 1 << 20).unwrap_err();
        assert!(e.message.len() < 300, "{}", e.message);
    }

    #[test]
    fn a_byte_order_mark_before_the_first_line_is_skipped() {
        let input = b"\xEF\xBB\xBF{\"custom_id\":\"a\"}\r\n\xEF\xBB\xBF{\"custom_id\":\"b\"}\n";
        let lines = split_lines(input).unwrap();
        assert_eq!(lines[0].bytes, b"{\"custom_id\":\"a\"}");
        assert_eq!(lines[0].number, 1);
        assert_eq!(counted_id(lines[0], 4096).as_deref(), Some("a"));
        // Only the file's first: one inside the file is that line's bytes (not JSON).
        assert_eq!(
            parse_line(lines[1], 4096).unwrap_err().code,
            "invalid_json_line"
        );
        assert_eq!(split_lines(b"\xEF\xBB\xBF\n"), Err(FileError::Empty));
    }

    #[test]
    fn blank_lines_are_no_requests_and_numbers_count_them() {
        let input = b"{\"custom_id\":\"a\"}\n\n  \r\n{\"custom_id\":\"b\"}\r\n";
        let lines = split_lines(input).unwrap();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].number, 1);
        assert_eq!(lines[1].number, 4);
        assert_eq!(lines[1].bytes, b"{\"custom_id\":\"b\"}");
    }

    #[test]
    fn a_file_is_refused_whole_for_a_duplicate_id_naming_both_lines() {
        let input =
            b"{\"custom_id\":\"a\"}\nnot json\n{\"custom_id\":\"b\"}\n{\"custom_id\":\"a\"}\n";
        let lines = split_lines(input).unwrap();
        assert_eq!(
            check_unique_ids(&lines, 4096),
            Err(FileError::DuplicateCustomId {
                custom_id: "a".into(),
                first: 1,
                second: 4,
            })
        );
        let message = check_unique_ids(&lines, 4096).unwrap_err().to_string();
        assert!(message.contains("lines 1 and 4"), "{message}");
    }

    /// The duplicate `custom_id` that `input`'s lines hold, if any, as `(id, first, second)`,
    /// lines being at most `max_line_bytes`.
    fn duplicate_within(input: &str, max_line_bytes: usize) -> Option<(String, usize, usize)> {
        match check_unique_ids(&split_lines(input.as_bytes()).unwrap(), max_line_bytes) {
            Ok(()) => None,
            Err(FileError::DuplicateCustomId {
                custom_id,
                first,
                second,
            }) => Some((custom_id, first, second)),
            Err(e) => panic!("{input}: {e}"),
        }
    }

    /// [`duplicate_within`] lines of up to 4 KiB.
    fn duplicate(input: &str) -> Option<(String, usize, usize)> {
        duplicate_within(input, 4096)
    }

    /// Regression: a line too long to run counted in the duplicate check, though its output
    /// line (`line_too_long`) names no `custom_id`.
    #[test]
    fn a_line_too_long_to_run_is_no_duplicate() {
        let short = r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{}}"#;
        let long = format!(
            r#"{{"custom_id":"a","method":"POST","url":"/v1/completions","body":{{"prompt":"{}"}}}}"#,
            "x".repeat(200)
        );
        let input = format!("{short}\n{long}");
        // Within the bound, both lines run and name `a`: refused.
        assert_eq!(
            duplicate_within(&input, long.len()),
            Some(("a".into(), 1, 2))
        );
        // Past it, the long line's error names no id, and the file runs.
        let max = long.len() - 1;
        assert_eq!(duplicate_within(&input, max), None);
        let lines = split_lines(input.as_bytes()).unwrap();
        let error = parse_line(lines[1], max).unwrap_err();
        assert_eq!(error.code, "line_too_long");
        assert_eq!(error.custom_id, None);
        assert_eq!(parse_line(lines[0], max).unwrap().custom_id, "a");
    }

    /// What the duplicate check counts is exactly what the output lines name: the id of a line
    /// [`parse_line`] runs or refuses with its id, none for a line refused without one.
    #[test]
    fn the_duplicate_check_counts_the_ids_the_output_lines_name() {
        let long_id = "y".repeat(MAX_CUSTOM_ID_BYTES + 1);
        let cases = [
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":{}}"#.to_owned(),
            r#"{"custom_id":"a","method":"GET","url":"/v1/completions","body":{}}"#.to_owned(),
            r#"{"custom_id":"a","method":"POST","url":"/v1/moderations","body":{}}"#.to_owned(),
            r#"{"custom_id":"a","method":"POST","url":"/v1/completions","body":3}"#.to_owned(),
            r#"{"custom_id":"a"}"#.to_owned(),
            r#"{"custom_id":"x","custom_id":"b"}"#.to_owned(),
            r#"{"custom\u005fid":"a"}"#.to_owned(),
            r#"{"custom_id":1}"#.to_owned(),
            r#"{"custom_id":null}"#.to_owned(),
            r#"{"method":"POST"}"#.to_owned(),
            r#"["custom_id","a"]"#.to_owned(),
            r#"{"custom_id":"a","#.to_owned(),
            format!(r#"{{"custom_id":"{long_id}"}}"#),
            format!(
                r#"{{"custom_id":"a","body":{{"prompt":"{}"}}}}"#,
                "x".repeat(300)
            ),
        ];
        for text in &cases {
            let line = InputLine {
                number: 1,
                bytes: text.as_bytes(),
            };
            let named = match parse_line(line, 256) {
                Ok(request) => Some(request.custom_id),
                Err(e) => e.custom_id,
            };
            assert_eq!(counted_id(line, 256), named, "{text}");
        }
    }

    #[test]
    fn the_duplicate_check_reads_the_id_as_a_line_does() {
        // A number is no id (that line gets its own error): `1` and `"1"` are no duplicates.
        assert_eq!(duplicate("{\"custom_id\":1}\n{\"custom_id\":\"1\"}"), None);
        assert_eq!(
            duplicate("{\"custom_id\":null}\n{\"custom_id\":null}"),
            None
        );
        // A line refused for another field still holds its id.
        assert_eq!(
            duplicate("{\"custom_id\":\"a\",\"method\":\"GET\"}\n{\"custom_id\":\"a\",\"body\":3}"),
            Some(("a".into(), 1, 2))
        );
        // A repeated key: the last one is the line's id, for the check as for the line.
        let repeated = "{\"custom_id\":\"x\",\"custom_id\":\"b\"}\n{\"custom_id\":\"b\"}";
        assert_eq!(duplicate(repeated), Some(("b".into(), 1, 2)));
        let first = parse_line(
            split_lines(b"{\"custom_id\":\"x\",\"custom_id\":\"b\"}").unwrap()[0],
            4096,
        )
        .unwrap_err();
        assert_eq!(first.custom_id.as_deref(), Some("b"));
        // An escaped key is the same key.
        assert_eq!(
            duplicate("{\"custom\\u005fid\":\"a\"}\n{\"custom_id\":\"a\"}"),
            Some(("a".into(), 1, 2))
        );
        // Ids too long are each refused on their line, not compared.
        let long = "y".repeat(MAX_CUSTOM_ID_BYTES + 1);
        assert_eq!(
            duplicate(&format!(
                "{{\"custom_id\":\"{long}\"}}\n{{\"custom_id\":\"{long}\"}}"
            )),
            None
        );
    }

    #[test]
    fn an_empty_file_and_one_with_too_many_lines_are_refused() {
        assert_eq!(split_lines(b""), Err(FileError::Empty));
        assert_eq!(split_lines(b"\n \n"), Err(FileError::Empty));
        let mut input = String::new();
        for i in 0..=MAX_LINES {
            input.push_str(&format!("{{\"custom_id\":\"{i}\"}}\n"));
        }
        assert_eq!(split_lines(input.as_bytes()), Err(FileError::TooManyLines));
        let at_bound = input.lines().take(MAX_LINES).collect::<Vec<_>>().join("\n");
        assert_eq!(split_lines(at_bound.as_bytes()).unwrap().len(), MAX_LINES);
    }

    #[test]
    fn a_true_stream_and_a_background_response_are_unbatchable() {
        let check = |url: &str, v: Value| unbatchable(url, v.as_object().unwrap());
        let chat = "/v1/chat/completions";
        let responses = "/v1/responses";
        assert_eq!(
            check(chat, json!({"stream": true})),
            Some(Unbatchable::Stream)
        );
        assert_eq!(
            check(responses, json!({"stream": true})),
            Some(Unbatchable::Stream)
        );
        assert_eq!(check(chat, json!({"stream": false})), None);
        assert_eq!(check(chat, json!({"stream": "true"})), None);
        assert_eq!(check(chat, json!({})), None);
        assert_eq!(
            check(responses, json!({"background": true})),
            Some(Unbatchable::Background)
        );
        assert_eq!(check(responses, json!({"background": false})), None);
        // Another route's `background` is the route's to judge (an unknown field).
        assert_eq!(check(chat, json!({"background": true})), None);
        assert_eq!(Unbatchable::Background.param(), "background");
    }

    #[test]
    fn an_answer_is_written_as_openai_writes_it() {
        let outcome = Outcome::Response {
            status_code: 200,
            request_id: "chatcmpl-1".into(),
            body: json!({"usage": {"completion_tokens": 5}}),
        };
        assert!(outcome.succeeded());
        assert_eq!(outcome.output_tokens(), 5);
        assert_eq!(
            output_line("batch_req_ab", Some("x"), &outcome),
            r#"{"id":"batch_req_ab","custom_id":"x","response":{"status_code":200,"request_id":"chatcmpl-1","body":{"usage":{"completion_tokens":5}}},"error":null}"#
        );
        let refused = Outcome::Response {
            status_code: 400,
            request_id: "r".into(),
            body: json!({"usage": {"completion_tokens": 5}}),
        };
        assert!(!refused.succeeded());
        assert_eq!(refused.output_tokens(), 0);
        let response = Outcome::Response {
            status_code: 200,
            request_id: "resp_1".into(),
            body: json!({"object": "response", "usage": {"input_tokens": 9, "output_tokens": 4}}),
        };
        assert_eq!(response.output_tokens(), 4);
    }

    #[test]
    fn lines_are_released_in_input_order() {
        let mut order = InOrder::default();
        assert!(order.push(2, "c".into()).is_empty());
        assert!(order.push(1, "b".into()).is_empty());
        assert_eq!(order.held(), 2);
        assert_eq!(order.push(0, "a".into()), ["a", "b", "c"]);
        assert_eq!(order.written(), 3);
        assert_eq!(order.push(3, "d".into()), ["d"]);
        assert_eq!(order.held(), 0);
    }
}
