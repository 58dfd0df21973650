//! Reading a JSON request body under the size limit, with errors that name the field at fault.

use actix_web::http::header;
use actix_web::{web, HttpRequest};
use bytes::BytesMut;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;

use crate::auth::ApiConfig;
use crate::error::ApiError;
use crate::objects_only::ObjectsOnly;

/// Reads the whole body (at most `max_body_bytes`, else 413; within `body_timeout`, else 408:
/// a client that stops sending would hold its connection and its place in the drain) and
/// parses it as JSON, whatever the `Content-Type` (as `curl -d` sends form encoding). Type
/// errors name the field's path as `param`; a missing required field is named too.
pub(crate) async fn read_json<T: DeserializeOwned>(
    req: &HttpRequest,
    payload: web::Payload,
    config: &ApiConfig,
) -> Result<T, ApiError> {
    check_content_encoding(req)?;
    let timeout = config.body_timeout;
    let body =
        actix_web::rt::time::timeout(timeout, read_body(req, payload, config.max_body_bytes))
            .await
            .map_err(|_| ApiError::BodyTimeout(timeout))??;
    parse_json(&body)
}

/// Refuses a body sent in a content coding (`Content-Encoding: gzip`, ...): the server decodes
/// none, and parsing the coded bytes as JSON would answer "Invalid JSON body" about a body the
/// client wrote as valid JSON. A 415 names the coding and says that only `identity` is read
/// (RFC 9110, 15.5.16: the response's `Accept-Encoding` says so too).
fn check_content_encoding(req: &HttpRequest) -> Result<(), ApiError> {
    for value in req.headers().get_all(header::CONTENT_ENCODING) {
        let Ok(value) = value.to_str() else {
            return Err(ApiError::UnsupportedContentEncoding(
                "(not visible ASCII)".to_owned(),
            ));
        };
        for coding in value.split(',').map(str::trim) {
            if !coding.is_empty() && !coding.eq_ignore_ascii_case("identity") {
                return Err(ApiError::UnsupportedContentEncoding(
                    coding.chars().take(64).collect(),
                ));
            }
        }
    }
    Ok(())
}

/// Reads the whole body, at most `limit` bytes (else 413).
async fn read_body(
    req: &HttpRequest,
    mut payload: web::Payload,
    limit: usize,
) -> Result<BytesMut, ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > u64::try_from(limit).unwrap_or(u64::MAX)) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    let mut body = BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::InvalidRequest {
            message: format!("Could not read the request body: {e}"),
            param: None,
        })?;
        if body.len().saturating_add(chunk.len()) > limit {
            return Err(ApiError::PayloadTooLarge { limit });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The deepest nesting of arrays and objects a body may have, the body's own object or array
/// counted: what serde_json's recursion limit (128) lets through (checked by
/// `a_body_nested_past_the_limit_says_so`).
pub(crate) const MAX_JSON_DEPTH: usize = 127;

/// Parses JSON, naming the offending field in the error. A UTF-8 byte order mark before the
/// JSON text is skipped, as RFC 8259 (section 8.1) lets a parser do and vLLM's does (Python's
/// `json.loads` of bytes reads it as `utf-8-sig`): editors on Windows write one at the start
/// of a file sent with `curl -d @file.json`, and serde_json would refuse it as "expected value
/// at line 1 column 1", a body that reads as valid JSON to whoever sent it. A struct is read
/// only from a JSON object ([`ObjectsOnly`]): serde would read an array as its fields in order.
pub(crate) fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    let mut de = serde_json::Deserializer::from_slice(body);
    let value =
        serde_path_to_error::deserialize(ObjectsOnly(&mut de)).map_err(|e| json_error(e, body))?;
    de.end().map_err(|e| ApiError::InvalidRequest {
        message: format!("Invalid JSON body: {e}"),
        param: None,
    })?;
    Ok(value)
}

/// Reads an already parsed body as `T`, with [`parse_json`]'s errors (and its refusal of an
/// array where an object belongs).
pub(crate) fn from_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(ObjectsOnly(value)).map_err(|e| json_error(e, &[]))
}

/// The 400 of a body that does not deserialize: data errors (wrong type, missing field) name
/// their field, and so do the syntax errors that are a field's value's own ([`bad_string`],
/// [`not_a_json_number`]); a body nested past serde_json's recursion limit says so rather than
/// reading like malformed JSON. `body` is the text parsed (empty for a parsed value).
fn json_error(e: serde_path_to_error::Error<serde_json::Error>, body: &[u8]) -> ApiError {
    let path = e.path().to_string();
    let mut message = e.inner().to_string();
    if let Some(at) = message.strip_prefix("recursion limit exceeded") {
        return ApiError::InvalidRequest {
            message: format!(
                "Invalid JSON body: it nests arrays and objects deeper than the limit of \
                 {MAX_JSON_DEPTH} levels{at}"
            ),
            param: None,
        };
    }
    // Data errors (wrong type, missing field) belong to a field, and so does a number too
    // large for any type (serde_json's lexer refuses it, as a syntax error, while reading
    // that field's value); serde_path_to_error writes "." for the root and "?" where it lost
    // track.
    use serde_json::error::Category;
    let out_of_range = message.starts_with("number out of range");
    let not_a_number = not_a_json_number(e.inner(), body);
    if not_a_number {
        message.push_str(" (NaN and Infinity are not JSON numbers)");
    }
    let bad_value = out_of_range || not_a_number || bad_string(&message);
    let duplicate = duplicate_field(&message);
    let param = match (e.inner().classify(), path.as_str()) {
        // serde refuses a key given twice at the object that holds it: the path names the
        // object, the message the key.
        (Category::Data, p) if !p.contains('?') && duplicate.is_some() => {
            duplicate.map(|field| match p {
                "." | "" => field.to_owned(),
                _ => format!("{p}.{field}"),
            })
        }
        (Category::Data, ".") => missing_field(&message),
        (_, "." | "") => None,
        (Category::Data, p) if !p.contains('?') => Some(path),
        (Category::Syntax, p) if bad_value && !p.contains('?') => Some(path),
        _ => None,
    };
    ApiError::InvalidRequest {
        message: format!("Invalid JSON body: {}", in_json_terms(&message)),
        param,
    }
}

/// serde's data error `message` in JSON's words where serde wrote Rust's: what was expected
/// (`struct MessageField`, `u32`, `f32`, `a sequence`, `a map`) and what was found
/// (`sequence`, `map`) name JSON's types, and an integer type its range, so a client reads
/// about the JSON it sent, never about the server's types. serde writes "invalid type:
/// {found}, expected {what}" (and "invalid value: ...", "invalid length ..."), serde_json adds
/// " at line L column C"; a message of no such form, and an expectation of the schema's own
/// words (an untagged field's `expecting`, "one of `a`, `b`"), are kept as they are.
fn in_json_terms(message: &str) -> String {
    const EXPECTED: &str = ", expected ";
    // The last one: what was found may quote a string the client sent, never what was expected.
    let Some(at) = message.rfind(EXPECTED) else {
        return message.to_owned();
    };
    let (found, rest) = message.split_at(at);
    let rest = &rest[EXPECTED.len()..];
    let (what, position) = rest.split_at(rest.find(" at line ").unwrap_or(rest.len()));
    let what: std::borrow::Cow<'_, str> = match what {
        "a sequence" => "an array".into(),
        "a map" => "an object".into(),
        "u8" => integer_from(0, u8::MAX).into(),
        "u16" => integer_from(0, u16::MAX).into(),
        "u32" => integer_from(0, u32::MAX).into(),
        "u64" | "usize" => integer_from(0, u64::MAX).into(),
        "i8" => integer_from(i8::MIN, i8::MAX).into(),
        "i16" => integer_from(i16::MIN, i16::MAX).into(),
        "i32" => integer_from(i32::MIN, i32::MAX).into(),
        "i64" | "isize" => integer_from(i64::MIN, i64::MAX).into(),
        "f32" | "f64" => "a number".into(),
        // An enum's, where a value is neither its name nor an object naming it.
        "string or map" => "a string or an object".into(),
        w if w.starts_with("struct ")
            || w.starts_with("internally tagged enum ")
            || w.starts_with("adjacently tagged enum ") =>
        {
            "an object".into()
        }
        w => w.into(),
    };
    // serde names what it found before the expectation: "invalid type: sequence" (a struct's
    // refusal of an array, `ObjectsOnly`'s, says so too).
    let found = match found.rsplit_once(": ") {
        Some((head, "sequence")) => format!("{head}: array"),
        Some((head, "map")) => format!("{head}: object"),
        _ => found.to_owned(),
    };
    format!("{found}{EXPECTED}{what}{position}")
}

/// "an integer from MIN to MAX", the range of an integer type a field is read as.
fn integer_from(min: impl std::fmt::Display, max: impl std::fmt::Display) -> String {
    format!("an integer from {min} to {max}")
}

/// Whether serde_json refused a string for what it holds (a lone UTF-16 surrogate escape
/// such as `"\ud800"`, an unknown escape, a raw control character): the string, and so the
/// field it is the value of, is at fault, not the body's structure.
fn bad_string(message: &str) -> bool {
    [
        "lone leading surrogate in hex escape",
        "unexpected end of hex escape",
        "invalid escape",
        "invalid unicode code point",
        "control character (\\u0000-\\u001F) found while parsing a string",
    ]
    .iter()
    .any(|m| message.starts_with(m))
}

/// Whether the syntax error `e` stands at a `NaN` or `Infinity` literal (JavaScript's, which
/// JSON has not; serde_json reads "expected value" or, after a `-`, "invalid number"): a
/// field's value at fault. serde_json's column counts bytes from 1 on its line.
fn not_a_json_number(e: &serde_json::Error, body: &[u8]) -> bool {
    if !e.is_syntax() || e.line() == 0 || e.column() == 0 {
        return false;
    }
    let line_start = if e.line() == 1 {
        Some(0)
    } else {
        body.iter()
            .enumerate()
            .filter(|(_, &b)| b == b'\n')
            .nth(e.line() - 2)
            .map(|(i, _)| i + 1)
    };
    let Some(at) = line_start.and_then(|s| s.checked_add(e.column() - 1)) else {
        return false;
    };
    let rest = body.get(at..).unwrap_or_default();
    rest.starts_with(b"NaN") || rest.starts_with(b"Infinity")
}

/// The field named by serde's "duplicate field `x`" message.
fn duplicate_field(message: &str) -> Option<&str> {
    message.strip_prefix("duplicate field `")?.split('`').next()
}

/// The field named by serde's "missing field `x`" message.
fn missing_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("missing field `")?;
    rest.split('`').next().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::CompletionRequest;

    fn encoded(values: &[&str]) -> Result<(), ApiError> {
        let mut req = actix_web::test::TestRequest::default();
        for v in values {
            req = req.append_header((header::CONTENT_ENCODING, *v));
        }
        check_content_encoding(&req.to_http_request())
    }

    /// A body in a content coding is refused naming the coding (the first one not `identity`);
    /// none, or `identity` alone, is read.
    #[test]
    fn a_coded_body_is_refused_naming_its_coding() {
        for ok in [
            &[][..],
            &["identity"],
            &["Identity"],
            &["identity, identity"],
        ] {
            assert_eq!(encoded(ok), Ok(()), "{ok:?}");
        }
        for (values, coding) in [
            (&["gzip"][..], "gzip"),
            (&["br"], "br"),
            (&["identity, deflate"], "deflate"),
            (&["identity", "zstd"], "zstd"),
        ] {
            assert_eq!(
                encoded(values),
                Err(ApiError::UnsupportedContentEncoding(coding.to_owned())),
                "{values:?}"
            );
        }
    }

    fn param(body: &str) -> Option<String> {
        match parse_json::<CompletionRequest>(body.as_bytes()) {
            Err(ApiError::InvalidRequest { param, .. }) => param,
            other => panic!("expected invalid request, got {other:?}"),
        }
    }

    #[test]
    fn type_errors_name_the_field() {
        assert_eq!(
            param(r#"{"prompt":"x","temperature":"hot"}"#).as_deref(),
            Some("temperature")
        );
        assert_eq!(param(r#"{"prompt":"x","n":-1}"#).as_deref(), Some("n"));
        assert_eq!(param(r#"{"prompt":{"a":1}}"#).as_deref(), Some("prompt"));
    }

    /// serde_json's lexer refuses a number beyond an f64's range as a syntax error; it is
    /// still the field's value at fault, so the field is named (it was `null`).
    #[test]
    fn a_number_out_of_range_names_its_field() {
        assert_eq!(
            param(r#"{"prompt":"x","temperature":1e400}"#).as_deref(),
            Some("temperature")
        );
        assert_eq!(
            param(r#"{"prompt":"x","logit_bias":{"5":-1e400}}"#).as_deref(),
            Some("logit_bias.5")
        );
        assert!(message(r#"{"prompt":"x","top_p":1e999}"#).contains("number out of range"));
        // Other syntax errors inside a field's value still name none.
        assert_eq!(param(r#"{"prompt":"x","temperature":1e}"#), None);
    }

    /// A string with a lone UTF-16 surrogate escape (which no UTF-8 text can hold), a bad
    /// escape or a raw control character, and JavaScript's `NaN` and `Infinity`, are refused
    /// by serde_json's lexer as syntax errors inside a field's value: the field is named. A
    /// key of that kind, or a structural error between fields, names none.
    #[test]
    fn a_bad_string_or_a_non_number_names_its_field() {
        for (body, want) in [
            (r#"{"prompt":"\ud800"}"#, Some("prompt")),
            (r#"{"prompt":"\udc00x"}"#, Some("prompt")),
            (r#"{"prompt":"x","user":"\ud800\u0041"}"#, Some("user")),
            (r#"{"prompt":"x","user":"\q"}"#, Some("user")),
            ("{\"prompt\":\"x\",\"user\":\"a\u{1}\"}", Some("user")),
            (r#"{"prompt":"x","temperature":NaN}"#, Some("temperature")),
            (
                r#"{"prompt":"x","temperature":Infinity}"#,
                Some("temperature"),
            ),
            (r#"{"prompt":"x","top_p":-Infinity}"#, Some("top_p")),
            (
                r#"{"prompt":"x","logit_bias":{"5":NaN}}"#,
                Some("logit_bias.5"),
            ),
            (
                "{\"prompt\":\"x\",\n \"temperature\":\n NaN}",
                Some("temperature"),
            ),
            (r#"{"prompt":"x","stop":["\ud800"]}"#, Some("stop[0]")),
            (
                r#"{"prompt":"x","ignored_field":[1,NaN]}"#,
                Some("ignored_field[1]"),
            ),
            (r#"{"prompt":"x","temperature":}"#, None),
            (r#"{"prompt":"x","temperature":Nope}"#, None),
            (r#"{"prompt":"x" "n":1}"#, None),
            (r#"{"prompt":"x","\ud800":1}"#, None),
        ] {
            assert_eq!(param(body).as_deref(), want, "{body}");
        }
        assert!(message(r#"{"prompt":"x","temperature":NaN}"#).contains("not JSON numbers"));
        let chat = r#"{"messages":[{"role":"user","content":"\ud800"}]}"#;
        match parse_json::<crate::schema::ChatRequest>(chat.as_bytes()) {
            Err(ApiError::InvalidRequest { param, .. }) => {
                assert_eq!(param.as_deref(), Some("messages[0].content"))
            }
            other => panic!("expected invalid request, got {other:?}"),
        }
    }

    /// The message of a body that does not parse.
    fn message(body: &str) -> String {
        match parse_json::<CompletionRequest>(body.as_bytes()) {
            Err(ApiError::InvalidRequest { message, .. }) => message,
            other => panic!("expected invalid request, got {other:?}"),
        }
    }

    /// A body nested `depth` levels deep, the innermost in a field the request ignores.
    fn nested(depth: usize) -> String {
        // The request object is level 1, the ignored field's array level 2.
        format!(
            r#"{{"prompt":"x","x":{}{}}}"#,
            "[".repeat(depth - 1),
            "]".repeat(depth - 1)
        )
    }

    /// serde_json refuses a body nested past its recursion limit with "recursion limit
    /// exceeded", which reads like a malformed body: the message says how deep bodies may go.
    #[test]
    fn a_body_nested_past_the_limit_says_so() {
        assert!(parse_json::<CompletionRequest>(nested(MAX_JSON_DEPTH).as_bytes()).is_ok());
        let m = message(&nested(MAX_JSON_DEPTH + 1));
        assert!(
            m.contains(&format!(
                "deeper than the limit of {MAX_JSON_DEPTH} levels at line 1"
            )),
            "{m}"
        );
        assert!(!m.contains("recursion"), "{m}");
    }

    /// A key given twice is refused by serde as a data error at the object holding it, not at
    /// the key: the param named that object (`null` at the top level) rather than the field.
    #[test]
    fn a_duplicate_key_names_its_field() {
        assert_eq!(
            param(r#"{"prompt":"x","max_tokens":2,"max_tokens":100000}"#).as_deref(),
            Some("max_tokens")
        );
        assert!(message(r#"{"prompt":"x","n":1,"n":2}"#).contains("duplicate field `n`"));
        let chat = r#"{"messages":[{"role":"user","content":"a","content":"b"}]}"#;
        match parse_json::<crate::schema::ChatRequest>(chat.as_bytes()) {
            Err(ApiError::InvalidRequest { param, .. }) => {
                assert_eq!(param.as_deref(), Some("messages[0].content"))
            }
            other => panic!("expected invalid request, got {other:?}"),
        }
    }

    /// A value of the wrong type is told in JSON's words, never in the server's Rust types:
    /// what was expected is an object, an array, an integer of a stated range or a number (not
    /// `struct MessageField`, `u32`, `f32`, "a sequence", "a map"), and what was found an array
    /// or an object (not a "sequence" or a "map"). Expectations in the schema's own words stay.
    #[test]
    fn a_value_of_the_wrong_type_is_told_in_json_terms() {
        let chat = |body: &str| match parse_json::<crate::schema::ChatRequest>(body.as_bytes()) {
            Err(ApiError::InvalidRequest { message, .. }) => message,
            other => panic!("expected invalid request, got {other:?}"),
        };
        let embeddings = |body: &str| match parse_json::<crate::schema::embeddings::EmbeddingRequest>(
            body.as_bytes(),
        ) {
            Err(ApiError::InvalidRequest { message, .. }) => message,
            other => panic!("expected invalid request, got {other:?}"),
        };
        let u32_range = "an integer from 0 to 4294967295";
        let mut wrong = Vec::new();
        for (got, want) in [
            (
                message("[]"),
                "invalid type: array, expected an object at line 1 column 0".to_owned(),
            ),
            (
                embeddings("5"),
                "invalid type: integer `5`, expected an object at line 1 column 1".to_owned(),
            ),
            (
                chat(r#"{"messages": ["hi"]}"#),
                "invalid type: string \"hi\", expected an object at line 1 column 18".to_owned(),
            ),
            (
                chat(r#"{"messages": [], "stream_options": "x"}"#),
                "invalid type: string \"x\", expected an object at line 1 column 38".to_owned(),
            ),
            (
                chat(r#"{"messages": [["user", "Hi"]]}"#),
                "invalid type: array, expected an object at line 1 column 15".to_owned(),
            ),
            (
                from_value::<crate::engine::SpeculativeMethod>(serde_json::json!(5))
                    .map(drop)
                    .map_err(|e| e.to_string())
                    .unwrap_err(),
                "invalid type: integer `5`, expected a string or an object".to_owned(),
            ),
            (
                chat(r#"{"messages": {"role": "user"}}"#),
                "invalid type: object, expected an array at line 1 column 13".to_owned(),
            ),
            (
                message(r#"{"prompt": "x", "logit_bias": [1]}"#),
                "invalid type: array, expected an object at line 1 column 30".to_owned(),
            ),
            (
                message(r#"{"prompt": "x", "max_tokens": 1000000000000}"#),
                format!("invalid value: integer `1000000000000`, expected {u32_range} at line 1 column 43"),
            ),
            (
                message(r#"{"prompt": "x", "n": 1.5}"#),
                format!("invalid type: floating point `1.5`, expected {u32_range} at line 1 column 24"),
            ),
            (
                message(r#"{"prompt": "x", "seed": 9223372036854775808}"#),
                "invalid value: integer `9223372036854775808`, expected an integer from \
                 -9223372036854775808 to 9223372036854775807 at line 1 column 43"
                    .to_owned(),
            ),
            (
                message(r#"{"prompt": "x", "priority": "high"}"#),
                "invalid type: string \"high\", expected an integer from -2147483648 to \
                 2147483647 at line 1 column 34"
                    .to_owned(),
            ),
            (
                message(r#"{"prompt": "x", "temperature": "hot"}"#),
                "invalid type: string \"hot\", expected a number at line 1 column 36".to_owned(),
            ),
            // A string the client sent that reads like serde's words is quoted as it is.
            (
                message(r#"{"prompt": "x", "n": "map, expected u32 at line 9"}"#),
                format!(
                    "invalid type: string \"map, expected u32 at line 9\", expected \
                     {u32_range} at line 1 column 50"
                ),
            ),
            (
                message(r#"{"prompt": "x", "stop": 5}"#),
                "`stop` must be a string or an array of strings at line 1 column 26".to_owned(),
            ),
        ] {
            let want = format!("Invalid JSON body: {want}");
            if got != want {
                wrong.push(format!("got  {got}\nwant {want}"));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    /// A body that starts with a UTF-8 byte order mark (a file saved by a Windows editor,
    /// sent with `curl -d @file.json`) is read as the JSON after it, as vLLM reads it; its
    /// errors still name their field. One mark only, and only at the start.
    #[test]
    fn a_byte_order_mark_before_the_body_is_skipped() {
        let bom = |json: &str| [&b"\xEF\xBB\xBF"[..], json.as_bytes()].concat();
        let request = parse_json::<CompletionRequest>(&bom(r#"{"prompt":"x","max_tokens":3}"#));
        assert_eq!(request.map(|r| r.max_tokens), Ok(Some(3)));
        for (body, want) in [
            (r#"{"prompt":"x","temperature":"hot"}"#, Some("temperature")),
            (r#"{"prompt":"x","temperature":NaN}"#, Some("temperature")),
            ("{\"prompt\":\"x\",\n \"top_p\":\n Infinity}", Some("top_p")),
        ] {
            match parse_json::<CompletionRequest>(&bom(body)) {
                Err(ApiError::InvalidRequest { param, .. }) => {
                    assert_eq!(param.as_deref(), want, "{body}")
                }
                other => panic!("{body}: {other:?}"),
            }
        }
        for body in [
            bom(&String::from_utf8(bom(r#"{"prompt":"x"}"#)).unwrap()),
            [&b"{\"prompt\":\"x\"}"[..], b"\xEF\xBB\xBF"].concat(),
            [&b" "[..], &bom(r#"{"prompt":"x"}"#)].concat(),
        ] {
            assert!(
                parse_json::<CompletionRequest>(&body).is_err(),
                "{}",
                String::from_utf8_lossy(&body)
            );
        }
    }

    #[test]
    fn missing_fields_and_syntax_errors() {
        assert_eq!(param(r#"{"max_tokens":3}"#).as_deref(), Some("prompt"));
        assert_eq!(param(r#"{"prompt":"x""#), None);
        assert_eq!(param(r#"{"prompt":"x"} trailing"#), None);
        assert_eq!(param(""), None);
    }
}
