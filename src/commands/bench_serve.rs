//! `switchyard bench serve`: a load generator for any OpenAI-compatible server (ours,
//! llama-server, vLLM). Streams completions, timestamps every chunk, and prints the labels
//! `vllm bench serve` prints; `--result-file` writes the same figures as JSON.
//!
//! Plain HTTP/1.1 over `std::net` with one thread per in-flight request: the generator must not
//! be the bottleneck at the concurrencies a single server sees, and it needs no TLS.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use crate::cli::{ServeBenchArgs, ServeDataset};

/// Most prompts in one run.
const MAX_PROMPTS: usize = 1_000_000;

/// One request's measurements.
#[derive(Debug, Clone, Default)]
struct Sample {
    ok: bool,
    error: String,
    prompt_tokens: usize,
    output_tokens: usize,
    ttft: f64,
    itl: Vec<f64>,
    latency: f64,
}

struct Target {
    host: String,
    port: u16,
    prefix: String,
}

fn parse_url(url: &str) -> anyhow::Result<Target> {
    let rest = url
        .strip_prefix("http://")
        .context("--base-url must start with http:// (TLS is not supported)")?;
    let (hostport, prefix) = rest
        .split_once('/')
        .map(|(h, p)| (h, format!("/{}", p.trim_end_matches('/'))))
        .unwrap_or((rest, String::new()));
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) => (h.to_string(), p.parse().context("bad port in --base-url")?),
        None => (hostport.to_string(), 80),
    };
    let prefix = if prefix == "/" { String::new() } else { prefix };
    Ok(Target { host, port, prefix })
}

/// (prompt token count, output tokens, arrival offset in seconds if the dataset has one).
fn workload(
    args: &ServeBenchArgs,
    rng: &mut ChaCha8Rng,
) -> anyhow::Result<Vec<(usize, usize, Option<f64>)>> {
    let n = args.num_prompts;
    match args.dataset {
        ServeDataset::Random => Ok(vec![(args.input_len, args.output_len, None); n]),
        ServeDataset::Sharegpt | ServeDataset::Trace => {
            let path = args
                .dataset_path
                .clone()
                .context("--dataset-path is required for sharegpt and trace datasets")?;
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            let mut rows = Vec::new();
            let mut first_ts: Option<f64> = None;
            for (i, line) in text.lines().enumerate().skip(1) {
                let f: Vec<&str> = line.split(',').collect();
                let num = |k: usize, name: &str| -> anyhow::Result<usize> {
                    f.get(k)
                        .and_then(|v| v.trim().parse().ok())
                        .with_context(|| format!("{}:{}: field {name}", path.display(), i + 1))
                };
                if args.dataset == ServeDataset::Sharegpt {
                    rows.push((
                        num(0, "num_prefill_tokens")?,
                        num(1, "num_decode_tokens")?,
                        None,
                    ));
                } else {
                    // Azure trace: TIMESTAMP, ContextTokens, GeneratedTokens.
                    let ts = f.first().and_then(|t| parse_clock(t)).with_context(|| {
                        format!("{}:{}: field TIMESTAMP", path.display(), i + 1)
                    })?;
                    let base = *first_ts.get_or_insert(ts);
                    rows.push((
                        num(1, "ContextTokens")?,
                        num(2, "GeneratedTokens")?,
                        Some(ts - base),
                    ));
                }
                if args.dataset == ServeDataset::Trace && rows.len() >= n {
                    break;
                }
            }
            anyhow::ensure!(!rows.is_empty(), "{} has no rows", path.display());
            let rows: Vec<_> = rows
                .into_iter()
                .map(|(p, o, t)| {
                    (
                        p.clamp(1, args.max_input_len),
                        o.clamp(1, args.max_output_len),
                        t,
                    )
                })
                .collect();
            if args.dataset == ServeDataset::Trace {
                return Ok(rows);
            }
            Ok((0..n)
                .map(|_| rows[rng.random_range(0..rows.len())])
                .collect())
        }
    }
}

/// Seconds since midnight of a `YYYY-MM-DD HH:MM:SS.fffffff` wall-clock time.
fn parse_clock(ts: &str) -> Option<f64> {
    let time = ts.trim().split(' ').nth(1)?;
    let mut parts = time.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

pub fn run(args: ServeBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=MAX_PROMPTS).contains(&args.num_prompts),
        "--num-prompts must be 1..={MAX_PROMPTS}"
    );
    let target = parse_url(&args.base_url)?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => first_model(&target, args.api_key.as_deref())
            .context("asking /v1/models for the model name (or pass --model)")?,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let work = workload(&args, &mut rng)?;
    // Speculative decoding's counters before the run (a server without them reports none).
    let spec_before = spec_counters(&target);
    let concurrency = args.max_concurrency.unwrap_or(usize::MAX).max(1);
    let (tx, rx) = mpsc::channel::<Sample>();
    let bar = super::progress_bar(work.len() as u64, "requests");
    let start = Instant::now();
    let mut in_flight = 0usize;
    let mut samples = Vec::with_capacity(work.len());
    let mut next_arrival = 0.0f64;
    for (i, &(input, output, at)) in work.iter().enumerate() {
        // Arrival time: the trace's own, Poisson at --request-rate, or all at once.
        let due = match (at, args.request_rate) {
            (Some(t), _) => t / args.time_scale.max(1e-9),
            (None, Some(rate)) if rate.is_finite() && rate > 0.0 => {
                let t = next_arrival;
                next_arrival += -(1.0 - rng.random::<f64>()).ln() / rate;
                t
            }
            _ => 0.0,
        };
        let wait = due - start.elapsed().as_secs_f64();
        if wait > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(wait));
        }
        while in_flight >= concurrency {
            samples.push(rx.recv().context("worker vanished")?);
            in_flight -= 1;
            bar.inc(1);
        }
        let prompt: Vec<u32> = (0..input)
            .map(|_| args.token_offset + rng.random_range(0..args.token_range.max(1)))
            .collect();
        let body = json!({
            "model": model, "prompt": prompt, "max_tokens": output, "temperature": 0.0,
            "ignore_eos": args.ignore_eos, "stream": true, "stream_options": {"include_usage": true},
        })
        .to_string();
        let (host, port, path, key, tx) = (
            target.host.clone(),
            target.port,
            format!("{}/v1/completions", target.prefix),
            args.api_key.clone(),
            tx.clone(),
        );
        std::thread::Builder::new()
            .name(format!("bench-{i}"))
            .spawn(move || {
                let sample = one_request(&host, port, &path, key.as_deref(), &body, input)
                    .unwrap_or_else(|e| Sample {
                        error: format!("{e:#}"),
                        ..Sample::default()
                    });
                let _ = tx.send(sample);
            })?;
        in_flight += 1;
    }
    while in_flight > 0 {
        samples.push(rx.recv().context("worker vanished")?);
        in_flight -= 1;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let duration = start.elapsed().as_secs_f64();
    let spec = match (spec_before, spec_counters(&target)) {
        (Some(a), Some(b)) => Some(SpecCounters {
            drafts: b.drafts - a.drafts,
            draft_tokens: b.draft_tokens - a.draft_tokens,
            accepted: b.accepted - a.accepted,
        }),
        (None, Some(b)) => Some(b),
        _ => None,
    };
    report(
        &args,
        &samples,
        duration,
        spec.filter(|s| s.draft_tokens > 0.0),
    )
}

/// Speculative decoding counters of a Switchyard server (`/metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct SpecCounters {
    drafts: f64,
    draft_tokens: f64,
    accepted: f64,
}

/// Reads the speculative decoding counters from `/metrics`; `None` when the endpoint or the
/// counters are missing (another server, or metrics behind a key).
fn spec_counters(t: &Target) -> Option<SpecCounters> {
    let mut s = connect(&t.host, t.port).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        t.host
    )
    .ok()?;
    let mut text = String::new();
    s.take(16 << 20).read_to_string(&mut text).ok()?;
    parse_spec_counters(&text)
}

fn parse_spec_counters(text: &str) -> Option<SpecCounters> {
    let value = |name: &str| {
        text.lines().find_map(|l| {
            let (lhs, v) = l.rsplit_once(' ')?;
            (lhs.split('{').next()? == name).then(|| v.trim().parse::<f64>().ok())?
        })
    };
    Some(SpecCounters {
        drafts: value("switchyard:spec_decode_num_drafts_total")?,
        draft_tokens: value("switchyard:spec_decode_num_draft_tokens_total")?,
        accepted: value("switchyard:spec_decode_num_accepted_tokens_total")?,
    })
}

fn connect(host: &str, port: u16) -> anyhow::Result<TcpStream> {
    let s =
        TcpStream::connect((host, port)).with_context(|| format!("connecting to {host}:{port}"))?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    s.set_nodelay(true)?;
    Ok(s)
}

fn first_model(t: &Target, key: Option<&str>) -> anyhow::Result<String> {
    let mut s = connect(&t.host, t.port)?;
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET {}/v1/models HTTP/1.1\r\nHost: {}\r\n{auth}Connection: close\r\n\r\n",
        t.prefix, t.host
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let body = text.split_once("\r\n\r\n").map(|x| x.1).unwrap_or_default();
    // Tolerate chunked framing: take the JSON object inside.
    let json_text = &body[body.find('{').unwrap_or(0)..=body.rfind('}').unwrap_or(0)];
    let v: serde_json::Value = serde_json::from_str(json_text).context("parsing /v1/models")?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .context("no model listed")
}

/// Sends one streaming completion and timestamps its chunks.
fn one_request(
    host: &str,
    port: u16,
    path: &str,
    key: Option<&str>,
    body: &str,
    input: usize,
) -> anyhow::Result<Sample> {
    let t0 = Instant::now();
    let mut stream = connect(host, port)?;
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut chunked = false;
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            break;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if l.to_ascii_lowercase().starts_with("transfer-encoding:")
            && l.to_ascii_lowercase().contains("chunked")
        {
            chunked = true;
        }
    }
    let mut sample = Sample {
        prompt_tokens: input,
        ..Sample::default()
    };
    if status != 200 {
        let mut rest = String::new();
        let _ = reader.read_to_string(&mut rest);
        sample.error = format!(
            "HTTP {status}: {}",
            rest.chars().take(200).collect::<String>()
        );
        return Ok(sample);
    }
    let mut pending = String::new();
    let mut last: Option<Instant> = None;
    let mut done = false;
    let mut buf = Vec::new();
    while !done {
        buf.clear();
        if chunked {
            line.clear();
            if reader.read_line(&mut line)? == 0 {
                break;
            }
            let size = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            if size == 0 {
                break;
            }
            buf.resize(size, 0);
            reader.read_exact(&mut buf)?;
            line.clear();
            reader.read_line(&mut line)?;
        } else {
            buf.resize(8192, 0);
            let n = reader.read(&mut buf)?;
            if n == 0 {
                break;
            }
            buf.truncate(n);
        }
        let now = Instant::now();
        pending.push_str(&String::from_utf8_lossy(&buf));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                break;
            }
            let v: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
            if let Some(u) = v
                .get("usage")
                .and_then(|u| u.get("completion_tokens"))
                .and_then(|c| c.as_u64())
            {
                sample.output_tokens = u as usize;
            }
            let has_text = v["choices"]
                .get(0)
                .and_then(|c| c["text"].as_str())
                .is_some_and(|t| !t.is_empty());
            if has_text {
                match last {
                    None => sample.ttft = (now - t0).as_secs_f64(),
                    Some(l) => sample.itl.push((now - l).as_secs_f64()),
                }
                last = Some(now);
            }
        }
    }
    sample.latency = t0.elapsed().as_secs_f64();
    sample.ok = done && last.is_some();
    if !sample.ok {
        sample.error = "stream ended without [DONE] or without output".into();
    }
    Ok(sample)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0 * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let mean = if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    };
    (
        mean * 1e3,
        percentile(&v, 50.0) * 1e3,
        percentile(&v, 99.0) * 1e3,
    )
}

fn report(
    args: &ServeBenchArgs,
    samples: &[Sample],
    duration: f64,
    spec: Option<SpecCounters>,
) -> anyhow::Result<()> {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let failed = samples.len() - ok.len();
    let input: usize = ok.iter().map(|s| s.prompt_tokens).sum();
    let output: usize = ok.iter().map(|s| s.output_tokens).sum();
    let ttft = stats(ok.iter().map(|s| s.ttft).collect());
    let tpot = stats(
        ok.iter()
            .filter(|s| s.output_tokens > 1)
            .map(|s| (s.latency - s.ttft) / (s.output_tokens - 1) as f64)
            .collect(),
    );
    let itl = stats(ok.iter().flat_map(|s| s.itl.iter().copied()).collect());
    let d = duration.max(1e-9);
    println!("{:=^50}", " Serving Benchmark Result ");
    println!("{:<40}{}", "Successful requests:", ok.len());
    println!("{:<40}{}", "Failed requests:", failed);
    println!("{:<40}{:.2}", "Benchmark duration (s):", duration);
    println!("{:<40}{}", "Total input tokens:", input);
    println!("{:<40}{}", "Total generated tokens:", output);
    println!(
        "{:<40}{:.2}",
        "Request throughput (req/s):",
        ok.len() as f64 / d
    );
    println!(
        "{:<40}{:.2}",
        "Output token throughput (tok/s):",
        output as f64 / d
    );
    println!(
        "{:<40}{:.2}",
        "Total Token throughput (tok/s):",
        (input + output) as f64 / d
    );
    for (title, name, s) in [
        ("Time to First Token", "TTFT", ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", tpot),
        ("Inter-token Latency", "ITL", itl),
    ] {
        println!("{:-^50}", title);
        println!("{:<40}{:.2}", format!("Mean {name} (ms):"), s.0);
        println!("{:<40}{:.2}", format!("Median {name} (ms):"), s.1);
        println!("{:<40}{:.2}", format!("P99 {name} (ms):"), s.2);
    }
    if let Some(sp) = spec {
        println!("{:-^50}", "Speculative Decoding");
        println!(
            "{:<40}{:.2}",
            "Acceptance rate (%):",
            100.0 * sp.accepted / sp.draft_tokens
        );
        println!(
            "{:<40}{:.2}",
            "Mean acceptance length:",
            1.0 + sp.accepted / sp.drafts.max(1.0)
        );
        println!("{:<40}{}", "Drafts:", sp.drafts);
        println!("{:<40}{}", "Draft tokens:", sp.draft_tokens);
        println!("{:<40}{}", "Accepted tokens:", sp.accepted);
    }
    println!("{}", "=".repeat(50));
    if let Some(first) = samples.iter().find(|s| !s.ok) {
        eprintln!("first failure: {}", first.error);
    }
    if let Some(path) = &args.result_file {
        let result = json!({
            "completed": ok.len(), "failed": failed, "duration": duration,
            "total_input_tokens": input, "total_output_tokens": output,
            "request_throughput": ok.len() as f64 / d, "output_throughput": output as f64 / d,
            "total_token_throughput": (input + output) as f64 / d,
            "mean_ttft_ms": ttft.0, "median_ttft_ms": ttft.1, "p99_ttft_ms": ttft.2,
            "mean_tpot_ms": tpot.0, "median_tpot_ms": tpot.1, "p99_tpot_ms": tpot.2,
            "mean_itl_ms": itl.0, "median_itl_ms": itl.1, "p99_itl_ms": itl.2,
            "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
        });
        let mut result = result;
        if let Some(sp) = spec {
            result["spec_decode_acceptance_rate"] = json!(sp.accepted / sp.draft_tokens);
            result["spec_decode_num_drafts"] = json!(sp.drafts);
            result["spec_decode_num_draft_tokens"] = json!(sp.draft_tokens);
            result["spec_decode_num_accepted_tokens"] = json!(sp.accepted);
        }
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    anyhow::ensure!(!ok.is_empty(), "no request succeeded");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_with_and_without_prefix() {
        let t = parse_url("http://127.0.0.1:8000").unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.prefix.as_str()),
            ("127.0.0.1", 8000, "")
        );
        let t = parse_url("http://localhost/api/").unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.prefix.as_str()),
            ("localhost", 80, "/api")
        );
        assert!(parse_url("https://x").is_err());
    }

    #[test]
    fn speculative_counters_parse_from_prometheus_text() {
        let text = "HTTP/1.1 200 OK\r\n\r\n# HELP x\nswitchyard:spec_decode_num_drafts_total 12\n\
                    switchyard:spec_decode_num_draft_tokens_total 48\n\
                    switchyard:spec_decode_num_accepted_tokens_total{a=\"b\"} 30\n";
        assert_eq!(
            parse_spec_counters(text),
            Some(SpecCounters {
                drafts: 12.0,
                draft_tokens: 48.0,
                accepted: 30.0
            })
        );
        assert_eq!(parse_spec_counters("switchyard:other 1\n"), None);
    }

    #[test]
    fn percentiles_and_clock_parse() {
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 50.0), 3.0);
        assert_eq!(percentile(&[], 99.0), 0.0);
        assert_eq!(
            parse_clock("2023-11-16 18:17:03.5"),
            Some(18.0 * 3600.0 + 17.0 * 60.0 + 3.5)
        );
    }
}
