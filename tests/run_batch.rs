//! `switchyard run-batch` end to end: the real binary, SmolLM2 on the CPU, an OpenAI Batch
//! file in and out. The answers are checked against what `serve` gives for the same bodies
//! (a server started on the same configuration file) and against the greedy references.

mod common;

use common::pid1::{namespace_init, pid_namespaces_work, switchyard_as_pid1};
use common::{
    fails, golden, ignoring_sigint, model_path, send_signal, signal_listed, switchyard, temp_dir,
    wait_exit, Server,
};
use serde_json::{json, Value};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The scheduler of both the server and the batch.
const SCHEDULER: &str = "scheduler:\n  max_num_seqs: 16\n  max_num_batched_tokens: 1024\n";

/// An input line.
fn line(custom_id: &str, url: &str, body: Value) -> String {
    json!({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).to_string()
}

fn chat_body() -> Value {
    json!({"messages": [{"role": "user", "content": "Write a haiku about trains."}],
           "max_tokens": 12, "temperature": 0})
}

fn completion_body() -> Value {
    json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0})
}

fn responses_body() -> Value {
    json!({"input": "Write a haiku about trains.", "max_output_tokens": 12, "temperature": 0})
}

fn embeddings_body() -> Value {
    json!({"input": "A train crosses the valley."})
}

/// A body the API refuses (a negative `max_tokens`): its error must be the server's.
fn refused_body() -> Value {
    json!({"prompt": "Hello", "max_tokens": -1})
}

/// Runs `switchyard run-batch` on `config` (with `--set` overrides `set`) from `input` to
/// `output`, which must succeed; returns its stderr.
fn run_batch(config: &Path, set: &[&str], input: &Path, output: &Path) -> String {
    let mut cmd = switchyard();
    cmd.arg("run-batch").arg("--config").arg(config);
    for s in set {
        cmd.args(["--set", s]);
    }
    let out = cmd
        .arg("-i")
        .arg(input)
        .arg("-o")
        .arg(output)
        .output()
        .expect("run switchyard");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "run-batch failed:\n{stderr}");
    stderr
}

/// The output's lines as JSON.
fn output_lines(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

#[test]
fn a_batch_file_is_answered_in_order_as_serve_answers() {
    let server = Server::start("run-batch", SCHEDULER);
    let dir = temp_dir("run-batch", "e2e");
    let input = [
        line("chat", "/v1/chat/completions", chat_body()),
        line("completion", "/v1/completions", completion_body()),
        line("embedding", "/v1/embeddings", embeddings_body()),
        "{\"custom_id\": \"broken\", \"method\": ".to_owned(),
        line(
            "streamed",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "stream": true}),
        ),
        line("responses", "/v1/responses", responses_body()),
        line("unknown-url", "/v1/moderations", json!({"input": "Hi"})),
        json!({"custom_id": 1, "method": "POST", "url": "/v1/completions",
               "body": completion_body()})
        .to_string(),
        String::new(),
        line("refused", "/v1/completions", refused_body()),
        line(
            "chained",
            "/v1/responses",
            json!({"input": "And then?", "previous_response_id": "resp_1"}),
        ),
        // Longer than a line may be (64 KiB of body, set below, + 64 KiB): refused unread,
        // so its error names no custom_id, and its id is no duplicate of the first line's.
        line(
            "chat",
            "/v1/completions",
            json!({"prompt": "x".repeat(140_000)}),
        ),
    ]
    .join("\n");
    let input_path = dir.join("requests.jsonl");
    std::fs::write(&input_path, input + "\n").unwrap();
    let output_path = dir.join("results.jsonl");
    // The server's own configuration file: run-batch opens no socket, so its port is no matter.
    let stderr = run_batch(
        &server.dir.join("config.yaml"),
        &["server.max_body_bytes=65536"],
        &input_path,
        &output_path,
    );
    assert!(
        stderr.contains("run-batch: 11 lines, 4 succeeded, 7 failed"),
        "{stderr}"
    );
    assert!(!dir.join("results.jsonl.partial").exists());
    let lines = output_lines(&std::fs::read_to_string(&output_path).unwrap());
    let ids: Vec<&str> = lines
        .iter()
        .map(|l| l["custom_id"].as_str().unwrap_or("<null>"))
        .collect();
    assert_eq!(
        ids,
        [
            "chat",
            "completion",
            "embedding",
            "<null>",
            "streamed",
            "responses",
            "unknown-url",
            "<null>",
            "refused",
            "chained",
            "<null>"
        ]
    );
    for l in &lines {
        assert!(
            l["id"]
                .as_str()
                .is_some_and(|id| id.starts_with("batch_req_")),
            "{l}"
        );
        assert_eq!(l.as_object().map(|o| o.len()), Some(4), "{l}");
    }
    let status = |i: usize| lines[i]["response"]["status_code"].as_u64();
    assert_eq!(
        (0..11).map(status).collect::<Vec<_>>(),
        [
            Some(200),
            Some(200),
            Some(200),
            None,
            Some(400),
            Some(200),
            None,
            None,
            Some(400),
            Some(400),
            None
        ]
    );
    assert_eq!(lines[10]["error"]["code"], "line_too_long", "{}", lines[10]);
    // A batch without a journal stores nothing, and says so in the words of run-batch.
    let chained = &lines[9]["response"]["body"]["error"];
    assert_eq!(chained["param"], "previous_response_id", "{chained}");
    assert!(
        chained["message"]
            .as_str()
            .is_some_and(|m| m.contains("only in the journal of server.responses.path")),
        "{chained}"
    );

    // The chat answer: the server's for the same body, and the greedy reference's prefix.
    let batch_chat = &lines[0]["response"]["body"];
    let (code, served_chat) = server.post_json("/v1/chat/completions", &chat_body());
    assert_eq!(code, 200, "{served_chat}");
    assert_eq!(batch_chat["choices"], served_chat["choices"]);
    assert_eq!(batch_chat["usage"], served_chat["usage"]);
    assert_eq!(batch_chat["object"], "chat.completion");
    assert_eq!(
        lines[0]["response"]["request_id"], batch_chat["id"],
        "a completion's request id is its id, as serve's x-request-id"
    );
    let content = batch_chat["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    let reference = golden("chat-haiku")["completion"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        !content.is_empty() && reference.starts_with(content),
        "{content:?} is not a prefix of the reference {reference:?}"
    );

    // The completion and the embedding: the server's answers.
    let (code, served) = server.post_json("/v1/completions", &completion_body());
    assert_eq!(code, 200, "{served}");
    assert_eq!(lines[1]["response"]["body"]["choices"], served["choices"]);
    let (code, served) = server.post_json("/v1/embeddings", &embeddings_body());
    assert_eq!(code, 200, "{served}");
    assert_eq!(lines[2]["response"]["body"]["data"], served["data"]);
    assert_eq!(lines[2]["response"]["body"]["usage"], served["usage"]);

    // Lines that are no batch lines: an error naming the line, and no response.
    assert_eq!(lines[3]["response"], Value::Null);
    assert_eq!(lines[3]["error"]["code"], "invalid_json_line");
    assert!(
        lines[3]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("line 4: ")),
        "{}",
        lines[3]
    );
    assert_eq!(lines[6]["response"], Value::Null);
    assert_eq!(lines[6]["error"]["code"], "invalid_url");
    assert!(
        lines[6]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("line 7: ")),
        "{}",
        lines[6]
    );
    // A custom_id that is no string: an error naming its type.
    assert_eq!(lines[7]["response"], Value::Null);
    assert_eq!(lines[7]["error"]["code"], "invalid_custom_id");
    assert_eq!(
        lines[7]["error"]["message"],
        "line 8: custom_id must be a string, not a number"
    );

    // The response: the server's output and usage for the same body. The configuration
    // names no journal (server.responses.path), so the batch stores nothing (`store` false)
    // where the server keeps it in memory.
    let batch_response = &lines[5]["response"]["body"];
    let (code, served) = server.post_json("/v1/responses", &responses_body());
    assert_eq!(code, 200, "{served}");
    assert_eq!(batch_response["object"], "response");
    let text = |r: &Value| r["output"][0]["content"][0]["text"].clone();
    assert!(text(batch_response).is_string(), "{batch_response}");
    assert_eq!(text(batch_response), text(&served));
    assert_eq!(batch_response["status"], served["status"]);
    // The same tokens, but for those the prefix cache held: the chat line's prompt is this
    // one's, and the server answered it just before (its 32 cached tokens), where the batch
    // ran both lines at once (0, or as many if the chat line's prefill came first).
    let uncached = |r: &Value| {
        let mut usage = r["usage"].clone();
        let cached = usage["input_tokens_details"]
            .as_object_mut()
            .and_then(|d| d.remove("cached_tokens"))
            .and_then(|c| c.as_u64());
        assert!(cached <= usage["input_tokens"].as_u64(), "{r}");
        usage
    };
    assert_eq!(uncached(batch_response), uncached(&served));
    assert_eq!(lines[5]["response"]["request_id"], batch_response["id"]);
    assert_eq!(batch_response["store"], false);
    assert_eq!(served["store"], true);

    // A stream is refused as a request: the API's error body, naming the field.
    assert_eq!(lines[4]["error"], Value::Null);
    assert_eq!(
        lines[4]["response"]["body"]["error"]["param"], "stream",
        "{}",
        lines[4]
    );
    assert_eq!(
        lines[4]["response"]["body"]["error"]["type"],
        "invalid_request_error"
    );

    // A request the API refuses: the server's status and error body.
    let (code, served) = server.post_json("/v1/completions", &refused_body());
    assert_eq!(code, 400, "{served}");
    assert_eq!(lines[8]["response"]["body"], served);
    assert_eq!(lines[8]["error"], Value::Null);
    // Blank line 9 is no request; the refused line is line 10 of the file.
    assert_eq!(lines[8]["custom_id"], "refused");
}

/// With `server.responses.path`, a batch's responses are stored in that journal and a server
/// started on it afterwards reads them back (the open API's tenant both times); with the
/// journal named but storing off (`max_stored: 0`), a refusal names that setting, not a
/// missing journal.
#[test]
fn a_batch_stores_its_responses_in_the_journal_a_later_server_reads() {
    let dir = temp_dir("run-batch", "journal");
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "model:\n  path: {}\n  threads: 2\n{SCHEDULER}server:\n  host: 127.0.0.1\n  port: 0\n  \
             drain_timeout_s: 20\n  responses:\n    path: {}\n",
            model_path().display(),
            dir.join("store").display()
        ),
    )
    .unwrap();
    let run = |input: &[String], name: &str, set: &[&str]| {
        let input_path = dir.join(format!("{name}.jsonl"));
        std::fs::write(&input_path, input.join("\n")).unwrap();
        let output_path = dir.join(format!("{name}-out.jsonl"));
        run_batch(&config, set, &input_path, &output_path);
        output_lines(&std::fs::read_to_string(&output_path).unwrap())
    };

    // Storing off with the journal named: the refusal names the setting that turned it off.
    let chained = line(
        "chained",
        "/v1/responses",
        json!({"input": "And then?", "previous_response_id": "resp_1"}),
    );
    let off = run(
        std::slice::from_ref(&chained),
        "off",
        &["server.responses.max_stored=0"],
    );
    let error = &off[0]["response"]["body"]["error"];
    assert_eq!(error["param"], "previous_response_id", "{error}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("server.responses.max_stored is 0") && !message.contains("names none"),
        "{error}"
    );

    // Storing on: the response is in the journal once run-batch has exited.
    let lines = run(
        &[line("stored", "/v1/responses", responses_body())],
        "on",
        &[],
    );
    let body = &lines[0]["response"]["body"];
    assert_eq!(lines[0]["response"]["status_code"], 200, "{body}");
    assert_eq!(body["store"], true, "{body}");
    let id = body["id"].as_str().expect("a response id");
    let child = common::serve(&config, &dir).spawn().expect("start serve");
    let mut server = Server {
        port: 0,
        child,
        dir: dir.keep(),
    };
    server.wait_ready();
    let (code, read) = server.call_json("GET", &format!("/v1/responses/{id}"), None, &[]);
    assert_eq!(code, 200, "{read}");
    assert_eq!(read["id"], body["id"]);
    assert_eq!(read["output"], body["output"]);
    assert_eq!(read["usage"], body["usage"]);
}

#[test]
fn a_file_with_a_duplicate_custom_id_is_refused_before_anything_runs() {
    let dir = temp_dir("run-batch", "duplicate");
    let input_path = dir.join("requests.jsonl");
    let input = [
        line("a", "/v1/completions", completion_body()),
        line("b", "/v1/completions", completion_body()),
        line("a", "/v1/embeddings", embeddings_body()),
    ]
    .join("\n");
    std::fs::write(&input_path, input).unwrap();
    // Refused once the configuration (which bounds a line) is read, before the model loads.
    let output_path = dir.join("out.jsonl");
    let err = fails(
        switchyard()
            .arg("run-batch")
            .arg("--config")
            .arg(batch_config(&dir))
            .arg("-i")
            .arg(&input_path)
            .arg("-o")
            .arg(&output_path),
    );
    assert!(
        err.contains("lines 1 and 3 have the same custom_id `a`"),
        "{err}"
    );
    assert!(!output_path.exists());
    assert!(!dir.join("out.jsonl.partial").exists());
}

#[test]
fn a_url_as_input_is_refused() {
    let dir = temp_dir("run-batch", "url");
    let err = fails(
        switchyard()
            .arg("run-batch")
            .arg("--config")
            .arg(dir.join("missing.yaml"))
            .args(["-i", "https://example.com/requests.jsonl", "-o"])
            .arg(dir.join("out.jsonl")),
    );
    assert!(err.contains("fetches nothing from the network"), "{err}");
}

/// A configuration for run-batch alone (its port is never bound), written in `dir`.
fn batch_config(dir: &Path) -> std::path::PathBuf {
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "model:\n  path: {}\n  threads: 2\n{SCHEDULER}",
            model_path().display()
        ),
    )
    .unwrap();
    config
}

/// A batch that is still running when a test stops it: a line answered at once (one token),
/// then two that each generate 2,000 tokens whatever the model writes (`ignore_eos`), which
/// the CPU takes far longer to do than a test takes to send a signal.
struct EndlessBatch {
    /// The process started: run-batch's, or with [`Start::AsPid1`] `unshare`'s, which exits
    /// with run-batch's exit code.
    child: Child,
    /// How it was started.
    how: Start,
    output: std::path::PathBuf,
    partial: std::path::PathBuf,
    stderr: std::path::PathBuf,
}

/// How a test starts run-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// As a child of the test, with SIGINT's default disposition.
    Plain,
    /// With SIGINT ignored from the start, as a non-interactive shell starts a background job.
    IgnoringSigint,
    /// As PID 1 of a new user and PID namespace ([`switchyard_as_pid1`]), as a container's
    /// entry point runs.
    AsPid1,
}

impl EndlessBatch {
    /// Starts it in `dir` as `how` says, and returns once the first line is written: the
    /// signal handlers are installed by then, and the long lines are running.
    fn start(dir: &Path, how: Start) -> Self {
        let mut batch = Self::spawn(dir, how);
        batch.wait_for("a line written", |b| {
            std::fs::read_to_string(&b.partial).is_ok_and(|t| t.ends_with('\n'))
        });
        batch
    }

    /// Starts it in `dir` as `how` says and returns at once.
    fn spawn(dir: &Path, how: Start) -> Self {
        let long = json!({"prompt": "Count to ten thousand:", "max_tokens": 2000,
                          "ignore_eos": true, "temperature": 0});
        let input = [
            line(
                "quick",
                "/v1/completions",
                json!({"prompt": "Hi", "max_tokens": 1}),
            ),
            line("long-1", "/v1/completions", long.clone()),
            line("long-2", "/v1/completions", long),
        ]
        .join("\n");
        let input_path = dir.join("requests.jsonl");
        std::fs::write(&input_path, input).unwrap();
        let output = dir.join("out.jsonl");
        let partial = dir.join("out.jsonl.partial");
        let stderr = dir.join("stderr.txt");
        let mut cmd = if how == Start::AsPid1 {
            switchyard_as_pid1()
        } else {
            switchyard()
        };
        cmd.arg("run-batch")
            .arg("--config")
            .arg(batch_config(dir))
            .arg("-i")
            .arg(&input_path)
            .arg("-o")
            .arg(&output)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap());
        if how == Start::IgnoringSigint {
            ignoring_sigint(&mut cmd);
        }
        Self {
            child: cmd.spawn().expect("start run-batch"),
            how,
            output,
            partial,
            stderr,
        }
    }

    /// Waits (at most 5 minutes) until `ready` says it is `what`; fails if it ends first.
    fn wait_for(&mut self, what: &str, ready: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(300);
        while !ready(self) {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "run-batch ended ({status}) before {what}:\n{}",
                    self.stderr()
                );
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("no {what}:\n{}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The host PID of run-batch's own process (with [`Start::AsPid1`], `unshare`'s child).
    fn pid(&self) -> u32 {
        match self.how {
            Start::AsPid1 => namespace_init(&self.child),
            Start::Plain | Start::IgnoringSigint => self.child.id(),
        }
    }

    /// Sends it `signal`.
    fn signal(&self, signal: libc::c_int) {
        send_signal(self.pid(), signal);
    }

    /// Whether its `/proc` status lists `signal` under `field` (`SigIgn`, `SigCgt`).
    fn lists(&self, field: &str, signal: libc::c_int) -> bool {
        signal_listed(self.pid(), field, signal)
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Waits for its end; returns its status and stderr.
    fn wait(&mut self) -> (ExitStatus, String) {
        let status = wait_exit(&mut self.child, Duration::from_secs(60), "run-batch");
        (status, self.stderr())
    }
}

/// The status a shell reports for `status`: the exit code, or 128 + the signal that ended it.
fn shell_status(status: ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap()
}

/// Ctrl-C or SIGTERM mid-run: the lines done are kept in `OUTPUT.partial`, the summary says
/// how many, and the process ends by the signal (the shell's 130 or 143), the batch not done.
#[test]
fn an_interrupted_batch_keeps_its_lines_done_and_ends_by_the_signal() {
    for (signal, name, shell) in [
        (libc::SIGINT, "SIGINT", 130),
        (libc::SIGTERM, "SIGTERM", 143),
    ] {
        let dir = temp_dir("run-batch", &format!("interrupted-{name}"));
        let mut batch = EndlessBatch::start(&dir, Start::Plain);
        assert!(batch.lists("SigCgt", signal), "{name} caught");
        batch.signal(signal);
        let (status, stderr) = batch.wait();
        assert_eq!(status.signal(), Some(signal), "{status}: {stderr}");
        assert_eq!(shell_status(status), shell);
        assert_stopped_after_the_quick_line(&batch, name, &stderr);
    }
}

/// What a batch that `name` (`SIGINT`, `SIGTERM`) stopped after its first line leaves: the
/// summary on `stderr`, `OUTPUT.partial` with that line, no `OUTPUT`.
fn assert_stopped_after_the_quick_line(batch: &EndlessBatch, name: &str, stderr: &str) {
    let partial = batch.partial.display();
    assert!(
        stderr.contains(&format!(
            "error: run-batch stopped: 1 of 3 lines were done; the lines done, in input \
             order, are in {partial}: interrupted ({name})"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("run-batch: 1 lines, 1 succeeded, 0 failed"),
        "{stderr}"
    );
    let kept = output_lines(&std::fs::read_to_string(&batch.partial).unwrap());
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0]["custom_id"], "quick");
    assert!(!batch.output.exists());
}

/// As PID 1 of a PID namespace (a container's entry point), which the kernel keeps from
/// dying of the signal the binary raises at itself under the default disposition, a batch
/// stopped mid-run exits with the shell's status as its exit code (130 for SIGINT, 143 for
/// SIGTERM: `exit_status`'s fallback) and leaves what it leaves elsewhere. Where
/// this machine makes no user and PID namespace (`unshare -Urpf true` fails: unprivileged
/// user namespaces off), the test says so on stderr and checks nothing.
#[test]
fn an_interrupted_batch_as_pid_1_exits_with_128_plus_the_signal_and_keeps_its_lines_done() {
    if !pid_namespaces_work() {
        return;
    }
    for (signal, name, code) in [
        (libc::SIGINT, "SIGINT", 130),
        (libc::SIGTERM, "SIGTERM", 143),
    ] {
        let dir = temp_dir("run-batch", &format!("pid1-{name}"));
        let mut batch = EndlessBatch::start(&dir, Start::AsPid1);
        // A signal from outside the namespace reaches its init only through a handler.
        assert!(batch.lists("SigCgt", signal), "{name} caught");
        batch.signal(signal);
        let (status, stderr) = batch.wait();
        assert_eq!(status.code(), Some(code), "{status}: {stderr}");
        assert_stopped_after_the_quick_line(&batch, name, &stderr);
    }
}

/// A signal as the model loads ends the run at once by that signal, with nothing written.
/// The signal is sent at the load's log line (the handlers are installed by then); the small
/// model's load may end before it arrives, and then it stops the run instead: either way the
/// process ends by the signal, saying what was done.
#[test]
fn a_batch_interrupted_as_the_model_loads_ends_by_the_signal() {
    let dir = temp_dir("run-batch", "interrupted-load");
    let mut batch = EndlessBatch::spawn(&dir, Start::Plain);
    batch.wait_for("the model load's start", |b| {
        b.stderr().contains("loading model")
    });
    batch.signal(libc::SIGINT);
    let (status, stderr) = batch.wait();
    assert_eq!(status.signal(), Some(libc::SIGINT), "{status}: {stderr}");
    if stderr.contains("while the model loaded") {
        assert!(
            stderr.contains(
                "error: run-batch stopped while the model loaded, before any line ran (no \
                 output was written): interrupted (SIGINT)"
            ),
            "{stderr}"
        );
        assert!(!batch.partial.exists());
    } else {
        assert!(
            stderr.contains("error: run-batch stopped: ")
                && stderr.contains("interrupted (SIGINT)"),
            "{stderr}"
        );
    }
    assert!(!batch.output.exists());
}

/// Regression: a run-batch started with SIGINT ignored (`run-batch ... &` in a script) took
/// SIGINT over and was stopped by it. It is left ignored; SIGTERM still stops the run.
#[test]
fn a_sigint_inherited_ignored_stays_ignored_and_sigterm_still_stops() {
    let dir = temp_dir("run-batch", "sigint-ignored");
    let mut batch = EndlessBatch::start(&dir, Start::IgnoringSigint);
    assert!(batch.lists("SigIgn", libc::SIGINT), "SIGINT ignored");
    assert!(!batch.lists("SigCgt", libc::SIGINT), "SIGINT not caught");
    assert!(batch.lists("SigCgt", libc::SIGTERM), "SIGTERM caught");
    // An ignored signal is discarded as it is sent: the run goes on, and the SIGTERM after it
    // is what stops it.
    batch.signal(libc::SIGINT);
    assert!(
        batch.child.try_wait().unwrap().is_none(),
        "{}",
        batch.stderr()
    );
    batch.signal(libc::SIGTERM);
    let (status, stderr) = batch.wait();
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status}: {stderr}");
    assert!(
        stderr.contains("1 of 3 lines were done") && stderr.contains("interrupted (SIGTERM)"),
        "{stderr}"
    );
    assert!(!stderr.contains("SIGINT"), "{stderr}");
}
