//! `bench serve --endpoint embeddings`: each request POSTs `/v1/embeddings` with the token
//! ids of one prompt, or of `--embedding-batch` prompts as a list of id lists, and is timed
//! from its sending to the last byte of the answer, on a kept-alive connection where there is
//! one (vLLM's `openai-embeddings` backend times the same request, and reports only its
//! end-to-end latency).
//!
//! Every answer is checked before it counts as a success: status 200, one vector per input,
//! each a list of finite floats, all of one length (the test request's, for the whole run).

use serde::Deserialize;
use serde_json::json;

use super::http::Pool;
use super::{
    add_traffic, capped_warning, close_report, stats, Counted, Job, Metric, PrefixReuse,
    QueueFigures, Sample, Selection,
};
use crate::cli::ServeBenchArgs;
use crate::commands::mooncake::TraceReuse;

/// Most prompts in one `/v1/embeddings` request (`--embedding-batch`), OpenAI's bound on
/// `input`.
pub(super) const MAX_EMBEDDING_BATCH: usize = 2048;
/// Largest `/v1/embeddings` answer read, in bytes: 2,048 vectors of 4,096 floats written
/// out in JSON fit (about 12 bytes a float); a larger answer fails its request.
const MAX_RESPONSE_BYTES: usize = 128 << 20;

/// The `/v1/embeddings` body for `prompts`: one prompt's ids as a list of ids, several as a
/// list of id lists. Floats are asked for, as vLLM's benchmark asks.
pub(super) fn request_body(model: &str, prompts: &[Vec<u32>]) -> String {
    let input = match prompts {
        [one] => json!(one),
        many => json!(many),
    };
    json!({"model": model, "input": input, "encoding_format": "float"}).to_string()
}

/// An embeddings answer, as far as the benchmark reads it.
#[derive(Deserialize)]
struct EmbeddingList {
    /// One entry per input.
    data: Vec<EmbeddingEntry>,
    /// The tokens the server counted.
    #[serde(default)]
    usage: Option<EmbeddingUsage>,
}

/// One vector of an answer.
#[derive(Deserialize)]
struct EmbeddingEntry {
    /// The vector (a float beyond f32's range reads as infinite, and is refused).
    embedding: Vec<f32>,
}

/// `usage` of an embeddings answer.
#[derive(Deserialize)]
struct EmbeddingUsage {
    /// The inputs' tokens.
    #[serde(default)]
    prompt_tokens: Option<usize>,
    /// What of them the server's prefix cache served (Switchyard's; vLLM's only with
    /// `--enable-prompt-tokens-details`).
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
}

/// `usage.prompt_tokens_details` of an embeddings answer.
#[derive(Deserialize)]
struct PromptTokensDetails {
    /// Prompt tokens the prefix cache served.
    #[serde(default)]
    cached_tokens: Option<usize>,
}

/// What a checked answer holds.
#[derive(Debug, PartialEq)]
struct Checked {
    /// `usage.prompt_tokens`, or the ids sent where the server sent none.
    prompt_tokens: usize,
    /// The server sent no `usage.prompt_tokens`.
    usage_missing: bool,
    /// `usage.prompt_tokens_details.cached_tokens`, where the server sent it.
    cached_tokens: Option<usize>,
    /// The length of every vector.
    dimension: usize,
}

/// Checks the body of a 200 answer to a request of `job`: one vector per input, every one a
/// non-empty list of finite floats, all of one length, that of `job.dimension` when set.
fn check_answer(body: &[u8], job: &Job) -> Result<Checked, String> {
    let list: EmbeddingList = serde_json::from_slice(body).map_err(|e| {
        let start = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        format!("not an embeddings answer ({e}): {start}")
    })?;
    if list.data.len() != job.inputs {
        return Err(format!(
            "{} vectors for {} inputs",
            list.data.len(),
            job.inputs
        ));
    }
    let dimension = list.data.first().map_or(0, |d| d.embedding.len());
    if dimension == 0 {
        return Err("an empty vector".into());
    }
    for (i, entry) in list.data.iter().enumerate() {
        if entry.embedding.len() != dimension {
            return Err(format!(
                "vector {i} has {} floats, vector 0 {dimension}",
                entry.embedding.len()
            ));
        }
        if let Some(j) = entry.embedding.iter().position(|x| !x.is_finite()) {
            return Err(format!("vector {i} holds a non-finite float at {j}"));
        }
    }
    if let Some(expected) = job.dimension.filter(|&d| d != dimension) {
        return Err(format!(
            "vectors of {dimension} floats, where the test request's had {expected}"
        ));
    }
    let cached_tokens = list
        .usage
        .as_ref()
        .and_then(|u| u.prompt_tokens_details.as_ref()?.cached_tokens);
    let usage = list.usage.and_then(|u| u.prompt_tokens);
    Ok(Checked {
        prompt_tokens: usage.unwrap_or(job.input),
        usage_missing: usage.is_none(),
        cached_tokens,
        dimension,
    })
}

/// Sends one embeddings request and checks its answer.
pub(super) fn one_request(
    pool: &Pool,
    path: &str,
    key: Option<&str>,
    job: &Job,
) -> anyhow::Result<Sample> {
    let mut head = pool.post(path, key, &job.body)?;
    let t0 = head.sent;
    let mut sample = Sample {
        prompt_tokens: job.input,
        inputs: job.inputs,
        sent: Some(t0),
        ..Sample::default()
    };
    if head.status != 200 {
        sample.error = head.error();
        head.release(pool);
        return Ok(sample);
    }
    let body = head.body(MAX_RESPONSE_BYTES)?;
    sample.latency = t0.elapsed().as_secs_f64();
    head.release(pool);
    match check_answer(&body, job) {
        Ok(c) => {
            sample.ok = true;
            sample.prompt_tokens = c.prompt_tokens;
            sample.usage_missing = c.usage_missing;
            sample.cached_tokens = c.cached_tokens;
            sample.dimension = c.dimension;
        }
        Err(e) => sample.error = e,
    }
    Ok(sample)
}

/// The warning, once per run, that the server sent no `usage.prompt_tokens` for some
/// successful requests, whose input tokens are then the ids sent.
pub(super) fn usage_warning(ok: &[&Sample]) -> Option<String> {
    let missing = ok.iter().filter(|s| s.usage_missing).count();
    (missing > 0).then(|| {
        format!(
            "warning: the server sent no usage.prompt_tokens for {missing} of {} successful \
             requests; their input tokens are the token ids sent",
            ok.len()
        )
    })
}

/// Prints the run's figures (vLLM's labels for an embeddings run, then the inputs and the
/// vectors' length, and the prefix reuse as a completions run reports it) and writes
/// `--result-file`.
pub(super) fn report(
    args: &ServeBenchArgs,
    samples: &[Sample],
    duration: f64,
    trace_reuse: Option<TraceReuse>,
    capped: bool,
) -> anyhow::Result<()> {
    let counted = Counted::of(samples);
    let ok = &counted.ok;
    if let Some(warning) = usage_warning(ok) {
        eprintln!("{warning}");
    }
    capped_warning(args, ok, capped);
    let selection = Selection::parse(args)?;
    let ps = selection.values();
    let queue = stats(ok.iter().map(|s| s.queued).collect(), &ps);
    let e2el_with_queue = stats(ok.iter().map(|s| s.queued + s.latency).collect(), &ps);
    let (failed, input) = (counted.failed, counted.input);
    let inputs: usize = ok.iter().map(|s| s.inputs).sum();
    // Every success has the test request's length (`check_answer`), so the first says it.
    let dimension = ok.first().map_or(0, |s| s.dimension);
    let e2el = stats(ok.iter().map(|s| s.latency).collect(), &ps);
    let mut measured = vec![(Metric::E2el, &e2el)];
    measured.extend(QueueFigures::of(args, capped).measured(&queue, &e2el_with_queue));
    let d = duration.max(1e-9);
    counted.print_head(args, duration);
    println!(
        "{:<40}{:.2}",
        "Request throughput (req/s):",
        ok.len() as f64 / d
    );
    println!(
        "{:<40}{:.2}",
        "Total Token throughput (tok/s):",
        input as f64 / d
    );
    println!("{:<40}{}", "Embedded inputs:", inputs);
    println!(
        "{:<40}{:.2}",
        "Input throughput (inputs/s):",
        inputs as f64 / d
    );
    println!("{:<40}{}", "Embedding dimension:", dimension);
    selection.print(&measured);
    let reuse = PrefixReuse::of(&counted, trace_reuse);
    reuse.print();
    close_report(args, samples, &counted, || {
        let mut result = json!({
            "endpoint": "embeddings", "embedding_batch": args.embedding_batch.unwrap_or(1),
            "completed": ok.len(), "failed": failed, "duration": duration,
            "total_input_tokens": input, "completed_inputs": inputs,
            "request_throughput": ok.len() as f64 / d, "total_token_throughput": input as f64 / d,
            "input_throughput": inputs as f64 / d, "embedding_dimension": dimension,
        });
        add_traffic(args, &mut result);
        selection.add_to(&measured, &mut result);
        reuse.add_to(&mut result);
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job of `inputs` prompts with `input` tokens in all.
    fn job(inputs: usize, input: usize, dimension: Option<usize>) -> Job {
        Job {
            body: String::new(),
            input,
            inputs,
            dimension,
            due: std::time::Instant::now(),
        }
    }

    fn check(answer: serde_json::Value, job: &Job) -> Result<Checked, String> {
        check_answer(answer.to_string().as_bytes(), job)
    }

    #[test]
    fn one_prompt_is_a_list_of_ids_and_several_a_list_of_lists() {
        let one: serde_json::Value =
            serde_json::from_str(&request_body("m", &[vec![1, 2, 3]])).unwrap();
        assert_eq!(
            one,
            json!({"model": "m", "input": [1, 2, 3], "encoding_format": "float"})
        );
        let two: serde_json::Value =
            serde_json::from_str(&request_body("m", &[vec![1, 2], vec![3]])).unwrap();
        assert_eq!(two["input"], json!([[1, 2], [3]]));
    }

    #[test]
    fn an_answer_counts_the_servers_tokens_or_else_the_ids_sent() {
        let answer = json!({
            "object": "list",
            "data": [{"index": 0, "embedding": [0.5, -0.25]}, {"index": 1, "embedding": [1.0, 0.0]}],
            "usage": {"prompt_tokens": 9, "total_tokens": 9},
        });
        assert_eq!(
            check(answer, &job(2, 8, None)),
            Ok(Checked {
                prompt_tokens: 9,
                usage_missing: false,
                cached_tokens: None,
                dimension: 2
            })
        );
        // The prefix cache's share, where the server reports it.
        let cached = json!({
            "data": [{"embedding": [0.5]}],
            "usage": {"prompt_tokens": 40, "total_tokens": 40,
                      "prompt_tokens_details": {"cached_tokens": 32}},
        });
        assert_eq!(
            check(cached, &job(1, 40, None)).unwrap().cached_tokens,
            Some(32)
        );
        let without = json!({"data": [{"embedding": [0.5, -0.25, 1e-3]}]});
        assert_eq!(
            check(without.clone(), &job(1, 8, Some(3))),
            Ok(Checked {
                prompt_tokens: 8,
                usage_missing: true,
                cached_tokens: None,
                dimension: 3
            })
        );
        // `usage` without `prompt_tokens` is missing too.
        let mut partial = without;
        partial["usage"] = json!({"total_tokens": 8});
        assert!(check(partial, &job(1, 8, None)).unwrap().usage_missing);
    }

    #[test]
    fn answers_that_are_not_one_vector_per_input_of_one_length_fail() {
        let cases = [
            (json!({"data": []}), "0 vectors for 1 inputs"),
            (json!({"data": [{"embedding": []}]}), "an empty vector"),
            (
                json!({"data": [{"embedding": [1.0]}, {"embedding": [1.0, 2.0]}]}),
                "vector 1 has 2 floats, vector 0 1",
            ),
            // Beyond f32's range: infinite, refused.
            (
                json!({"data": [{"embedding": [1.0, 1e39]}]}),
                "vector 0 holds a non-finite float at 1",
            ),
            (
                json!({"data": [{"embedding": "AACAPw=="}]}),
                "not an embeddings answer",
            ),
            (
                json!({"data": [{"embedding": [1.0, null]}]}),
                "not an embeddings answer",
            ),
            (
                json!({"error": {"message": "x"}}),
                "not an embeddings answer",
            ),
        ];
        for (answer, expected) in cases {
            let inputs = answer["data"].as_array().map_or(1, |d| d.len().max(1));
            let e = check(answer.clone(), &job(inputs, 4, None)).unwrap_err();
            assert!(e.contains(expected), "{answer}: {e}");
        }
        // The whole run has the test request's length.
        let e = check(
            json!({"data": [{"embedding": [1.0, 2.0]}]}),
            &job(1, 4, Some(3)),
        );
        assert_eq!(
            e.unwrap_err(),
            "vectors of 2 floats, where the test request's had 3"
        );
        assert!(check_answer(b"{\"data\": [", &job(1, 4, None)).is_err());
    }

    #[test]
    fn missing_usage_is_warned_once_per_run() {
        let with = Sample {
            ok: true,
            ..Sample::default()
        };
        let without = Sample {
            usage_missing: true,
            ..with.clone()
        };
        assert_eq!(usage_warning(&[&with]), None);
        let warning = usage_warning(&[&with, &without]).expect("a warning");
        assert!(
            warning.contains("no usage.prompt_tokens for 1 of 2"),
            "{warning}"
        );
    }
}
