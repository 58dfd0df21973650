//! An array where a request body's object belongs is refused, naming the field, on every path
//! serde reads a struct by; bodies with objects read as they did.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::{json, Value};

use super::objects_only;
use crate::body::{from_value, parse_json};
use crate::engine::{PolicySpec, SpeculativeSettings};
use crate::error::ApiError;
use crate::schema::embeddings::EmbeddingRequest;
use crate::schema::responses::ResponsesRequest;
use crate::schema::tools::ToolSetup;
use crate::schema::{ChatRequest, CompletionRequest};

/// The 400's `param` and message.
fn refusal<T>(result: Result<T, ApiError>) -> (Option<String>, String) {
    match result {
        Err(ApiError::InvalidRequest { message, param }) => (param, message),
        Err(other) => panic!("expected a 400, got {other:?}"),
        Ok(_) => panic!("expected a 400, the body was accepted"),
    }
}

/// A chat body read and validated as `POST /v1/chat/completions` reads it.
fn chat(body: Value) -> Result<(), ApiError> {
    parse_json::<ChatRequest>(body.to_string().as_bytes())?
        .validate(128, ToolSetup::default())
        .map(drop)
}

/// A Responses body read and turned into a chat as `POST /v1/responses` does.
fn responses(body: Value) -> Result<(), ApiError> {
    parse_json::<ResponsesRequest>(body.to_string().as_bytes())?
        .into_chat(&[])
        .map(drop)
}

const ARRAY_NOT_OBJECT: &str = "Invalid JSON body: invalid type: array, expected an object";

/// The defect's cases, one line each: where serde read an array as a struct's fields in
/// order (`stream_options`, a message, a content part, the admin bodies) the body is now
/// refused at the array's field; where a hand-written check reads the value (`tools`,
/// `response_format`, a Responses input item) it already was, and stays so.
#[test]
fn an_array_for_an_object_is_refused_naming_its_field() {
    let user = json!([{"role": "user", "content": "hi"}]);
    let tool = |function: Value| json!([{"type": "function", "function": function}]);
    let cases: Vec<(&str, Result<(), ApiError>, &str, &str)> = vec![
        (
            "stream_options",
            chat(json!({"messages": user, "stream": true, "stream_options": [true]})),
            "stream_options",
            ARRAY_NOT_OBJECT,
        ),
        (
            "completion stream_options",
            parse_json::<CompletionRequest>(
                br#"{"prompt": "x", "stream": true, "stream_options": [true, false]}"#,
            )
            .map(drop),
            "stream_options",
            ARRAY_NOT_OBJECT,
        ),
        (
            "a message",
            chat(json!({"messages": [["user", "hi", null, null, null]]})),
            "messages[0]",
            ARRAY_NOT_OBJECT,
        ),
        (
            "a content part",
            chat(json!({"messages": [{"role": "user", "content": [["text", "hi", null]]}]})),
            "messages[0].content",
            "Invalid JSON body: `content` must be a string or an array of content parts",
        ),
        (
            "response_format",
            chat(json!({"messages": user, "response_format": ["json_object"]})),
            "response_format",
            "response_format must be an object",
        ),
        (
            "a tool",
            chat(json!({"messages": user, "tools": [["function", {"name": "f"}]]})),
            "tools[0]",
            "a tool is an object",
        ),
        (
            "a tool's function",
            chat(json!({"messages": user, "tools": tool(json!(["f", "d", {}]))})),
            "tools[0].function",
            "a tool needs a function object",
        ),
        (
            "a function's parameters",
            chat(
                json!({"messages": user, "tools": tool(json!({"name": "f", "parameters": ["object"]}))}),
            ),
            "tools[0].function.parameters",
            "parameters must be a JSON Schema object",
        ),
        (
            "a Responses input item",
            responses(json!({"input": [["user", "hi"]]})),
            "input[0]",
            "an input item is an object",
        ),
        (
            "Responses stream_options",
            responses(json!({"input": "hi", "stream": true, "stream_options": [false]})),
            "stream_options",
            "stream_options is an object",
        ),
        (
            "the admin policy body",
            from_value::<PolicySpec>(json!(["fcfs"])).map(drop),
            "",
            ARRAY_NOT_OBJECT,
        ),
        (
            "the admin speculative settings",
            from_value::<SpeculativeSettings>(json!(["ngram", 2, 1, 2, 0])).map(drop),
            "",
            ARRAY_NOT_OBJECT,
        ),
        (
            "an embeddings body",
            parse_json::<EmbeddingRequest>(br#"["x", "hi"]"#).map(drop),
            "",
            ARRAY_NOT_OBJECT,
        ),
    ];
    let mut wrong = Vec::new();
    for (case, result, param, message) in cases {
        let got = match result {
            Err(ApiError::InvalidRequest { message, param }) => (param, message),
            other => {
                wrong.push(format!("{case}: not refused: {other:?}"));
                continue;
            }
        };
        let param = (!param.is_empty()).then(|| param.to_owned());
        if got.0 != param || !got.1.starts_with(message) {
            wrong.push(format!(
                "{case}: got {got:?}, want param {param:?}, message {message:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The refusal says where the array starts: serde_json's line and column of its `[`, as its
/// other type errors point at the value's first character.
#[test]
fn the_refusal_points_at_the_array() {
    let (param, message) = refusal(parse_json::<ChatRequest>(
        br#"{"messages": [], "stream_options": [true]}"#,
    ));
    assert_eq!(param.as_deref(), Some("stream_options"));
    assert_eq!(message, format!("{ARRAY_NOT_OBJECT} at line 1 column 36"));
}

/// Valid bodies mean what they meant: each reads through [`parse_json`] exactly as serde_json
/// alone reads it (no wrapper), arrays of values and of objects, nested objects, untagged
/// fields, flattened fields and ignored fields included.
#[test]
fn bodies_with_objects_read_as_serde_json_reads_them() {
    let bodies = [
        json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": "{\"a\": [1, 2]}"}}]},
                {"role": "tool", "content": "3", "tool_call_id": "c1"},
            ],
            "stream": true,
            "stream_options": {"include_usage": true, "continuous_usage_stats": false},
            "stop": ["a", "b"],
            "logit_bias": {"5": -1.5},
            "tools": [{"type": "function", "function": {"name": "f", "parameters":
                {"type": "object", "properties": {"a": {"type": "array"}}}}}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"type": "object"}}},
            "chat_template_kwargs": {"enable_thinking": false, "list": [1, {"k": "v"}]},
            "functions": [{"name": "f"}],
            "not_a_field": [[1], {"a": []}],
        }),
        json!({"messages": [{"role": "user", "content": "hi"}], "stop": "x", "n": 2}),
    ];
    for body in &bodies {
        let text = body.to_string();
        let plain: ChatRequest = serde_json::from_str(&text).expect("serde_json reads it");
        let ours: ChatRequest = parse_json(text.as_bytes()).expect("parse_json reads it");
        assert_eq!(format!("{ours:?}"), format!("{plain:?}"));
        let ours: ChatRequest = from_value(body.clone()).expect("from_value reads it");
        assert_eq!(format!("{ours:?}"), format!("{plain:?}"));
    }
    for body in [
        json!({"prompt": [[1, 2], [3]], "stream_options": {"include_usage": true}, "x": [1]}),
        json!({"prompt": ["a", "b"], "stop_token_ids": [1, 2], "logprobs": 2}),
    ] {
        let text = body.to_string();
        let plain: CompletionRequest = serde_json::from_str(&text).expect("serde_json reads it");
        let ours: CompletionRequest = parse_json(text.as_bytes()).expect("parse_json reads it");
        assert_eq!(format!("{ours:?}"), format!("{plain:?}"));
    }
    let body = json!({"input": [[1, 2], [3]], "encoding_format": "float"});
    let plain: EmbeddingRequest = serde_json::from_value(body.clone()).expect("serde_json");
    let ours: EmbeddingRequest = from_value(body).expect("from_value");
    assert_eq!(format!("{ours:?}"), format!("{plain:?}"));
    let spec: PolicySpec =
        from_value(json!({"name": "priority", "params": {"aging_ms": 5}})).expect("policy");
    assert_eq!(spec.params, json!({"aging_ms": 5}));
}

/// A struct a test reads, of two fields.
#[derive(Debug, Deserialize, PartialEq)]
struct Point {
    x: i32,
    y: i32,
}

/// A struct under each of the shapes that nest one.
#[derive(Debug, Deserialize, PartialEq)]
struct Shapes {
    point: Option<Point>,
    list: Option<Vec<Point>>,
    map: Option<HashMap<String, Point>>,
    boxed: Option<Boxed>,
    shape: Option<Shape>,
    pair: Option<(i32, i32)>,
}

/// A newtype struct around a struct.
#[derive(Debug, Deserialize, PartialEq)]
struct Boxed(Point);

/// An externally tagged enum (serde's default): its struct variant reads its fields as a struct.
#[derive(Debug, Deserialize, PartialEq)]
enum Shape {
    Dot(Point),
    Line { from: Point, to: Point },
    Pair(i32, i32),
}

/// The param of a refused [`Shapes`] body.
fn shapes(body: &str) -> Result<Shapes, (Option<String>, String)> {
    parse_json::<Shapes>(body.as_bytes()).map_err(|e| refusal::<()>(Err(e)))
}

/// Through every way a struct nests in another (an option, a list, a map's value, a newtype,
/// an enum's newtype and struct variants), an array for a struct is refused at its path; a
/// tuple and a tuple variant are still read from arrays, and objects everywhere.
#[test]
fn a_struct_nested_any_way_refuses_an_array() {
    for (body, param) in [
        (r#"{"point": [1, 2]}"#, "point"),
        (r#"{"list": [{"x": 1, "y": 2}, [3, 4]]}"#, "list[1]"),
        (r#"{"map": {"a": [1, 2]}}"#, "map.a"),
        (r#"{"boxed": [1, 2]}"#, "boxed"),
        (r#"{"shape": {"Dot": [1, 2]}}"#, "shape.Dot"),
        (
            r#"{"shape": {"Line": [{"x": 1, "y": 2}, {"x": 3, "y": 4}]}}"#,
            "shape.Line",
        ),
        (
            r#"{"shape": {"Line": {"from": {"x": 1, "y": 2}, "to": [3, 4]}}}"#,
            "shape.Line.to",
        ),
        (r#"[null, null, null, null, null, [1, 2]]"#, ""),
    ] {
        let (got, message) = shapes(body).expect_err(body);
        assert_eq!(
            got.as_deref(),
            (!param.is_empty()).then_some(param),
            "{body}"
        );
        assert!(message.starts_with(ARRAY_NOT_OBJECT), "{body}: {message}");
    }
    let read = shapes(
        r#"{"point": {"x": 1, "y": 2}, "list": [{"x": 3, "y": 4}], "map": {"a": {"x": 5, "y": 6}},
            "boxed": {"x": 7, "y": 8}, "shape": {"Pair": [9, 10]}, "pair": [11, 12]}"#,
    )
    .expect("objects, tuples and tuple variants");
    assert_eq!(read.point, Some(Point { x: 1, y: 2 }));
    assert_eq!(read.list, Some(vec![Point { x: 3, y: 4 }]));
    assert_eq!(read.map.and_then(|m| m.get("a").map(|p| p.x)), Some(5));
    assert_eq!(read.boxed, Some(Boxed(Point { x: 7, y: 8 })));
    assert_eq!(read.shape, Some(Shape::Pair(9, 10)));
    assert_eq!(read.pair, Some((11, 12)));
    let line = shapes(r#"{"shape": {"Line": {"from": {"x": 1, "y": 2}, "to": {"x": 3, "y": 4}}}}"#)
        .expect("a struct variant of objects");
    assert!(matches!(line.shape, Some(Shape::Line { .. })));
}

/// Fields a flattened struct holds, read from serde's buffer.
#[derive(Debug, Deserialize, PartialEq)]
struct Flat {
    point: Option<Point>,
}

/// A flattened struct read as serde reads it, outside the wrapper.
#[derive(Debug, Deserialize)]
struct Unguarded {
    #[serde(flatten)]
    flat: Flat,
}

/// The same read through [`objects_only`].
#[derive(Debug, Deserialize)]
struct Guarded {
    #[serde(flatten, deserialize_with = "objects_only")]
    flat: Flat,
}

/// An untagged enum, as a request's fields of several shapes are.
#[derive(Debug, Deserialize, PartialEq)]
#[serde(untagged)]
enum Either {
    Number(i32),
    #[serde(deserialize_with = "objects_only")]
    Points(Vec<Point>),
}

/// An internally tagged enum (none of the request bodies has one).
#[derive(Debug, Deserialize, PartialEq)]
#[serde(tag = "type")]
enum Tagged {
    #[serde(deserialize_with = "objects_only")]
    Dot(Point),
}

/// serde buffers a flattened field, an untagged enum and an internally tagged one, and reads
/// the struct in it from that buffer outside the wrapper: the array is read as the struct's
/// fields there unless the field or variant reads through [`objects_only`], as the request
/// bodies' do.
#[test]
fn buffered_values_refuse_an_array_through_objects_only() {
    let unguarded = parse_json::<Unguarded>(br#"{"point": [1, 2]}"#).expect("serde's buffer");
    assert_eq!(unguarded.flat.point, Some(Point { x: 1, y: 2 }));
    refusal(parse_json::<Guarded>(br#"{"point": [1, 2]}"#));
    let guarded = parse_json::<Guarded>(br#"{"point": {"x": 1, "y": 2}}"#).expect("an object");
    assert_eq!(guarded.flat.point, Some(Point { x: 1, y: 2 }));

    refusal(parse_json::<Either>(b"[[1, 2]]"));
    assert_eq!(parse_json::<Either>(b"7"), Ok(Either::Number(7)));
    assert_eq!(
        parse_json::<Either>(br#"[{"x": 1, "y": 2}]"#),
        Ok(Either::Points(vec![Point { x: 1, y: 2 }]))
    );

    refusal(parse_json::<Tagged>(br#"["Dot", 1, 2]"#));
    assert_eq!(
        parse_json::<Tagged>(br#"{"type": "Dot", "x": 1, "y": 2}"#),
        Ok(Tagged::Dot(Point { x: 1, y: 2 }))
    );
}
