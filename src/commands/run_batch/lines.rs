//! The OpenAI Batch file format, without IO: an input file's lines read and checked, one
//! output line per input line, and the buffer that writes answers in input order.
//!
//! An input line is `{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions",
//! "body": {...}}` (OpenAI's `BatchRequestInput`); an output line is
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

/// The routes a batch line may name, as OpenAI's Batch API takes them.
pub const URLS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"];

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
/// request), refused whole when there are more than [`MAX_LINES`], none, or two with the same
/// `custom_id`. Lines that are not valid batch lines are kept: each gets its own error.
pub fn split_lines(input: &[u8]) -> Result<Vec<InputLine<'_>>, FileError> {
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
    check_unique_ids(&lines)?;
    Ok(lines)
}

/// Refuses two lines with the same `custom_id`, naming both. Lines whose `custom_id` cannot be
/// read are left to their own errors.
fn check_unique_ids(lines: &[InputLine<'_>]) -> Result<(), FileError> {
    /// Only the id: the rest of the line is not parsed into memory here.
    #[derive(Deserialize)]
    struct IdOnly {
        custom_id: String,
    }
    let mut seen: HashMap<String, usize> = HashMap::with_capacity(lines.len());
    for line in lines {
        let Ok(IdOnly { custom_id }) = serde_json::from_slice::<IdOnly>(line.bytes) else {
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
    let custom_id = match fields.remove("custom_id") {
        Some(Value::String(id)) => id,
        Some(_) => {
            return Err(error(
                None,
                "invalid_custom_id",
                "custom_id must be a string".to_owned(),
            ))
        }
        None => return Err(missing(None, "custom_id")),
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

/// Whether `body` asks for a stream (`"stream": true`): a batch answer is whole, so such a
/// line is refused with a 400 (the API's error body, `param: "stream"`).
pub fn wants_stream(body: &serde_json::Map<String, Value>) -> bool {
    body.get("stream") == Some(&Value::Bool(true))
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

    /// The tokens the answer generated (`usage.completion_tokens`; 0 for embeddings and
    /// failures).
    pub fn output_tokens(&self) -> u64 {
        match self {
            Self::Response { body, .. } if self.succeeded() => body
                .pointer("/usage/completion_tokens")
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
        check_error(
            r#"{"custom_id":5,"method":"POST","url":"/v1/completions","body":{}}"#,
            "invalid_custom_id",
            "must be a string",
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
            r#"{"custom_id":"a","method":"POST","url":"/v1/responses","body":{}}"#,
            "invalid_url",
            "/v1/responses",
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
        assert_eq!(
            split_lines(input),
            Err(FileError::DuplicateCustomId {
                custom_id: "a".into(),
                first: 1,
                second: 4,
            })
        );
        let message = split_lines(input).unwrap_err().to_string();
        assert!(message.contains("lines 1 and 4"), "{message}");
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
    fn only_a_true_stream_is_a_stream() {
        let body = |v: Value| v.as_object().cloned().unwrap();
        assert!(wants_stream(&body(json!({"stream": true}))));
        assert!(!wants_stream(&body(json!({"stream": false}))));
        assert!(!wants_stream(&body(json!({"stream": "true"}))));
        assert!(!wants_stream(&body(json!({}))));
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
