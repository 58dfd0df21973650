//! Helpers for end-to-end tests: start the real `switchyard` binary on a loopback port with the
//! embedded SmolLM2 model, and speak just enough HTTP/1.1 to drive it.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The embedded model, as `switchyard model fetch smollm2-135m` leaves it.
pub fn model_path() -> PathBuf {
    let dir = std::env::var_os("SWITCHYARD_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
                .join(".cache/switchyard/models")
        });
    let p = dir.join("smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run `switchyard model fetch smollm2-135m` first",
        p.display()
    );
    p
}

/// A running server; killed on drop.
pub struct Server {
    /// The port it listens on. A server started on `port: 0` (the OS picks a free port when
    /// it binds) is made with 0 here: [`Server::wait_ready`] reads the bound port from the
    /// server's `serving url=…` log line.
    pub port: u16,
    pub child: Child,
    pub dir: PathBuf,
}

/// The port of the first `serving url=http://127.0.0.1:PORT` line of a `serve` log (plain
/// text at INFO, as [`serve`] writes it), if it has one yet. Whole lines only: the server may
/// be writing the line as the file is read, and a port cut short (`:4` of `:45123`) would read
/// as another port, which the caller would then wait on until its deadline.
pub fn logged_port(log: &str) -> Option<u16> {
    let whole = &log[..log.rfind('\n').map_or(0, |end| end + 1)];
    whole.lines().find_map(|line| {
        let url = line.split_once(" serving url=")?.1;
        let url = url.split_whitespace().next()?;
        url.rsplit_once(':')?.1.parse().ok()
    })
}

pub mod pid1;

#[path = "../../testsupport/scratch.rs"]
mod scratch;
/// A test's scratch directory, removed with all it holds when dropped, so that a test leaves
/// nothing in the temporary directory whether it passes or fails (a panic unwinds through the
/// drop). It reads as the [`Path`] it is.
pub use scratch::ScratchDir as TempDir;

/// A fresh, empty scratch directory for one test, `sy-{kind}-{name}-{pid}` in the temporary
/// directory, removed when the returned guard drops.
pub fn temp_dir(kind: &str, name: &str) -> TempDir {
    TempDir::new(&format!("{kind}-{name}"))
}

/// Waits for `child` to exit, at most `within` (then kills it and fails naming `what`, the
/// exit the test waited for); returns its status.
pub fn wait_exit(child: &mut Child, within: Duration, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The rank-4 SmolLM2 LoRA adapter of the fixtures (PEFT's format).
/// A golden generation made by Hugging Face transformers, by name
/// (gpu/tests/fixtures/smollm2_golden.json, made by gpu/reference/make_golden.py).
pub fn golden(name: &str) -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/gpu/tests/fixtures/smollm2_golden.json"
    );
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("fixture"))
            .expect("fixture json");
    fixture["generations"]
        .as_array()
        .expect("generations")
        .iter()
        .find(|g| g["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no golden generation {name}"))
}

/// `server.api_keys` lines (indented for `server:`) of `(bearer, tenant, tier)` entries, the
/// key being the `Authorization` value `bearer` without its `Bearer ` scheme.
pub fn api_key_lines(keys: &[(&str, &str, &str)]) -> String {
    let mut lines = String::from("  api_keys:\n");
    for (bearer, tenant, tier) in keys {
        let key = bearer.strip_prefix("Bearer ").unwrap_or(bearer);
        lines.push_str(&format!(
            "    - {{ key: {key}, tenant: {tenant}, tier: {tier} }}\n"
        ));
    }
    lines
}

pub fn lora_fixture_dir() -> &'static str {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/gpu/tests/fixtures/lora/smollm2-r4"
    )
}

impl Server {
    /// The adapters `GET /v1/models` lists after the base model, in order.
    pub fn served_adapters(&self) -> Vec<String> {
        let r = self
            .request("GET", "/v1/models", None, &[])
            .expect("models");
        let v: serde_json::Value = serde_json::from_str(&r.body).expect("json");
        v["data"]
            .as_array()
            .expect("data")
            .iter()
            .skip(1)
            .filter_map(|m| m["id"].as_str().map(str::to_owned))
            .collect()
    }

    /// Starts the binary with `extra_yaml` appended to a base config and waits for /ready.
    pub fn start(name: &str, extra_yaml: &str) -> Server {
        Self::start_with(name, "", extra_yaml)
    }

    /// Like [`Server::start`], with `server_lines` (indented two spaces) added to `server:`.
    pub fn start_with(name: &str, server_lines: &str, extra_yaml: &str) -> Server {
        Self::start_full(name, "", server_lines, extra_yaml)
    }

    /// Like [`Server::start_with`], with `model_lines` (indented two spaces) added to `model:`.
    pub fn start_full(
        name: &str,
        model_lines: &str,
        server_lines: &str,
        extra_yaml: &str,
    ) -> Server {
        Self::start_model(name, &model_path(), model_lines, server_lines, extra_yaml)
    }

    /// Like [`Server::start_full`], serving the model at `model` (a GGUF file or a checkpoint
    /// directory) rather than the embedded one.
    pub fn start_model(
        name: &str,
        model: &std::path::Path,
        model_lines: &str,
        server_lines: &str,
        extra_yaml: &str,
    ) -> Server {
        let mut server =
            Self::spawn_model(name, model, model_lines, server_lines, extra_yaml, |_| {});
        server.wait_ready();
        server
    }

    /// Like [`Server::start`] with the base config alone, not waited for: `with` adjusts the
    /// command first (such as [`ignoring_sigint`]), and the caller waits as it needs
    /// ([`Server::wait_ready`], or a log line of the load).
    pub fn spawn(name: &str, with: impl FnOnce(&mut Command)) -> Server {
        Self::spawn_model(name, &model_path(), "", "", "", with)
    }

    /// [`Server::start_model`]'s config and process, `with` applied to the command, not
    /// waited for.
    fn spawn_model(
        name: &str,
        model: &std::path::Path,
        model_lines: &str,
        server_lines: &str,
        extra_yaml: &str,
        with: impl FnOnce(&mut Command),
    ) -> Server {
        let dir = Self::write_config(name, model, model_lines, server_lines, extra_yaml);
        let mut cmd = serve(&dir.join("config.yaml"), &dir);
        with(&mut cmd);
        let child = cmd.spawn().expect("start switchyard serve");
        Server {
            port: 0,
            child,
            dir,
        }
    }

    /// Like [`Server::start_with`], not waited for, with `serve` run as PID 1 of a new user and
    /// PID namespace ([`pid1::switchyard_as_pid1`]): `child` is the `unshare` process, which
    /// exits with the server's exit code, and [`pid1::namespace_init`] finds the server's own
    /// process. Check [`pid1::pid_namespaces_work`] first.
    pub fn spawn_as_pid1(name: &str, server_lines: &str) -> Server {
        let dir = Self::write_config(name, &model_path(), "", server_lines, "");
        let child = serve_by(pid1::switchyard_as_pid1(), &dir.join("config.yaml"), &dir)
            .spawn()
            .expect("start unshare switchyard serve");
        Server {
            port: 0,
            child,
            dir,
        }
    }

    /// A fresh scratch directory for a server named `name`, with [`Server::start_model`]'s
    /// `config.yaml` written in it; returns the directory.
    fn write_config(
        name: &str,
        model: &std::path::Path,
        model_lines: &str,
        server_lines: &str,
        extra_yaml: &str,
    ) -> PathBuf {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("switchyard-e2e-{name}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let config = dir.join("config.yaml");
        // Port 0: the server binds a free port itself, and `wait_ready` reads it from the log
        // (a port picked free here could be taken before the server binds it). 20 s of drain
        // unless `server_lines` sets it.
        let drain = if server_lines.contains("drain_timeout_s:") {
            ""
        } else {
            "  drain_timeout_s: 20\n"
        };
        let yaml = format!(
            "model:\n  path: {}\n  threads: 2\n{model_lines}server:\n  host: 127.0.0.1\n  port: 0\n{drain}{server_lines}{extra_yaml}",
            model.display()
        );
        std::fs::write(&config, yaml).expect("write config");
        dir
    }

    /// Waits (up to 120 s) until `/ready` answers 200 over plain HTTP; fails at once, with the
    /// log, if the server exits. A server made with port 0 has its port read from its log
    /// first.
    pub fn wait_ready(&mut self) {
        self.wait_ready_by(|s| {
            s.request("GET", "/ready", None, &[])
                .is_ok_and(|r| r.status == 200)
        });
    }

    /// Waits (up to 120 s) until `ready` says the server is; fails at once, with the log, if
    /// the server exits. A server made with port 0 (started on `port: 0`) has its port read
    /// from its `serving` log line first, and `ready` is asked only then.
    pub fn wait_ready_by(&mut self, ready: impl Fn(&Server) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if self.port == 0 {
                self.port = logged_port(&self.log()).unwrap_or(0);
            }
            if self.port != 0 && ready(self) {
                break;
            }
            if let Some(status) = self.child.try_wait().expect("wait") {
                panic!("server exited ({status}); log:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "server did not become ready; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Sends SIGHUP to the server.
    pub fn hang_up(&self) {
        let status = Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits (up to 30 s) until the server's log holds `text` `n` times.
    pub fn wait_logged(&self, text: &str, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.log().matches(text).count() < n {
            assert!(
                Instant::now() < deadline,
                "`{text}` not logged {n} times:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// Asserts that one line of the server's log holds every one of `parts`.
    pub fn assert_logged(&self, parts: &[&str]) {
        let log = self.log();
        assert!(
            log.lines().any(|l| parts.iter().all(|p| l.contains(p))),
            "no log line holds all of {parts:?}:\n{log}"
        );
    }

    /// Sends one request and reads the whole response.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> std::io::Result<Response> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(300)))?;
        write_request(&mut stream, method, path, body, headers)?;
        read_response(&mut stream)
    }

    /// POSTs JSON to `/v1/completions` with the `Authorization` value `auth`; the whole
    /// response.
    pub fn complete_as(&self, auth: &str, body: &serde_json::Value) -> Response {
        self.request(
            "POST",
            "/v1/completions",
            Some(&body.to_string()),
            &[("authorization", auth)],
        )
        .expect("request")
    }

    /// POSTs JSON and parses the JSON reply.
    pub fn post_json(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        self.call_json("POST", path, Some(body), &[])
    }

    /// Sends one request (`body` as JSON) with `headers`; the status and the JSON answer (its
    /// text as a JSON string where it is not JSON).
    pub fn call_json(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
        headers: &[(&str, &str)],
    ) -> (u16, serde_json::Value) {
        let text = body.map(serde_json::Value::to_string);
        let r = self
            .request(method, path, text.as_deref(), headers)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let v = serde_json::from_str(&r.body).unwrap_or(serde_json::Value::String(r.body.clone()));
        (r.status, v)
    }

    /// POSTs JSON, asserts a 200 (naming the request, the answer and the log) and returns the
    /// JSON answer.
    pub fn post_ok(&self, path: &str, body: &serde_json::Value) -> serde_json::Value {
        let (status, v) = self.post_json(path, body);
        assert_eq!(status, 200, "{path} {body}: {v}\nlog:\n{}", self.log());
        v
    }

    /// Opens a connection, sends a request and returns the stream without reading.
    pub fn open(&self, method: &str, path: &str, body: Option<&str>) -> TcpStream {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        write_request(&mut stream, method, path, body, &[]).expect("send");
        stream
    }

    /// Opens a streamed completion of `max_tokens` tokens (end of sequence ignored) as
    /// `auth`, checks its 200, and reads it to its end on a thread of its own, which returns
    /// the rest of the response: a request that holds a seat while a test sends others.
    pub fn hold_stream(&self, auth: &str, max_tokens: u32) -> std::thread::JoinHandle<String> {
        let body = serde_json::json!({"prompt": "Count:", "max_tokens": max_tokens,
                                      "ignore_eos": true, "stream": true})
        .to_string();
        let mut stream = self.open_with(
            "POST",
            "/v1/completions",
            Some(&body),
            &[("authorization", auth)],
        );
        assert_eq!(read_status(&mut stream), 200);
        std::thread::spawn(move || {
            let mut rest = String::new();
            let _ = stream.read_to_string(&mut rest);
            rest
        })
    }

    /// [`Server::open`] with headers.
    pub fn open_with(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> TcpStream {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        write_request(&mut stream, method, path, body, headers).expect("send");
        stream
    }

    /// The served model's id (the first of `GET /v1/models`).
    pub fn model_id(&self) -> String {
        let r = self
            .request("GET", "/v1/models", None, &[])
            .expect("GET /v1/models");
        let v: serde_json::Value = serde_json::from_str(&r.body).expect("json");
        v["data"][0]["id"].as_str().expect("a model id").to_string()
    }

    /// Asserts that a plain 4-token completion is served in full.
    pub fn assert_serves(&self) {
        let model = self.model_id();
        let (code, v) = self.post_json(
            "/v1/completions",
            &serde_json::json!({"model": model, "prompt": "Hi", "max_tokens": 4, "ignore_eos": true}),
        );
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    }

    /// POSTs `body` (with `"stream": true`) and returns the events before the final
    /// `[DONE]`, which is checked, as is the status.
    pub fn post_stream(&self, path: &str, body: &serde_json::Value) -> Vec<String> {
        let r = self
            .request("POST", path, Some(&body.to_string()), &[])
            .expect("a streamed response");
        assert_eq!(r.status, 200, "{}", r.body);
        let mut events = sse_events(&r.body);
        assert_eq!(events.pop().as_deref(), Some("[DONE]"), "{}", r.body);
        events
    }

    /// Reads a metric from /metrics: the sum of its samples over all their labels.
    /// The sum of the samples of `name` whose labels include each of `labels` (such as
    /// `reason="unavailable"`); 0 when none does.
    pub fn labelled_metric(&self, name: &str, labels: &[&str]) -> f64 {
        let r = self
            .request("GET", "/metrics", None, &[])
            .expect("/metrics");
        let start = format!("{name}{{");
        r.body
            .lines()
            .filter(|l| l.starts_with(&start) && labels.iter().all(|label| l.contains(label)))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    }

    pub fn metric(&self, name: &str) -> Option<f64> {
        let r = self.request("GET", "/metrics", None, &[]).ok()?;
        let values: Vec<f64> = r
            .body
            .lines()
            .filter_map(|l| {
                let (lhs, value) = l.rsplit_once(' ')?;
                let metric = lhs.split('{').next()?;
                (metric == name).then(|| value.parse().ok()).flatten()
            })
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn write_request(
    stream: &mut TcpStream,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> std::io::Result<()> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    if let Some(b) = body {
        req.push_str(b);
    }
    stream.write_all(req.as_bytes())
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads a response's status line only (the rest stays unread), waiting at most 60 s.
pub fn read_status(stream: &mut TcpStream) -> u16 {
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.last() != Some(&b'\n') {
        match stream.read(&mut byte) {
            Ok(1) => line.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&line)
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Reads a response with Content-Length, chunked encoding, or until close.
pub fn read_response(stream: &mut TcpStream) -> std::io::Result<Response> {
    read_response_from(&mut BufReader::new(stream))
}

/// [`read_response`] from a buffered reader, which keeps what follows the response (the next
/// of pipelined responses) for the next call.
pub fn read_response_from(reader: &mut impl BufRead) -> std::io::Result<Response> {
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _): &&(String, String)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            line.clear();
            reader.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            if size == 0 {
                break;
            }
            let mut chunk = vec![0; size];
            reader.read_exact(&mut chunk)?;
            body.extend_from_slice(&chunk);
            line.clear();
            reader.read_line(&mut line)?;
        }
    } else if let Some(len) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.resize(len, 0);
        reader.read_exact(&mut body)?;
    } else {
        reader.read_to_end(&mut body)?;
    }
    Ok(Response {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// The JSON chunks of a streamed response (200, ending with `[DONE]`), before `[DONE]`.
pub fn stream_chunks(s: &Server, path: &str, body: &serde_json::Value) -> Vec<serde_json::Value> {
    let r = s
        .request("POST", path, Some(&body.to_string()), &[])
        .expect("stream");
    assert_eq!(r.status, 200, "{}", r.body);
    let events = sse_events(&r.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect()
}

/// Splits an SSE body into its `data:` payloads, checking the framing exactly: every event is
/// one `data: ` line followed by a blank line.
pub fn sse_events(body: &str) -> Vec<String> {
    assert!(
        body.ends_with("\n\n"),
        "SSE body must end with a blank line: {body:?}"
    );
    body.split_terminator("\n\n")
        // Comment frames (the server's keep-alives) carry no event.
        .filter(|event| !event.starts_with(':'))
        .map(|event| {
            let payload = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("event without `data: `: {event:?}"));
            assert!(!payload.contains('\n'), "multi-line event: {event:?}");
            payload.to_string()
        })
        .collect()
}

/// The texts of a completion's choices, in order (each choice's `index` checked).
pub fn choice_texts(v: &serde_json::Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i, "{v}");
            c["text"].as_str().expect("text").to_owned()
        })
        .collect()
}

/// The `switchyard` binary, as a command to add arguments to. It starts with SIGINT's default
/// disposition whatever the tests' own is: a test run started in the background of a script
/// (CI's, say) has SIGINT ignored, which the binary would inherit and keep (it leaves an
/// inherited ignored SIGINT alone), and the tests that stop it with SIGINT would wait forever.
/// [`ignoring_sigint`] adds the opposite on top.
pub fn switchyard() -> Command {
    with_default_sigint(Command::new(env!("CARGO_BIN_EXE_switchyard")))
}

/// `cmd`, made to start its process with SIGINT's default disposition (see [`switchyard`]).
pub(crate) fn with_default_sigint(mut cmd: Command) -> Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: `signal` is async-signal-safe, and the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            if libc::signal(libc::SIGINT, libc::SIG_DFL) == libc::SIG_ERR {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// `switchyard serve --config {config}`, its stdout dropped and its stderr (at `RUST_LOG=info`)
/// written to `server.log` in `dir`, where [`Server::log`] reads it: add arguments or
/// variables, then spawn it.
pub fn serve(config: &Path, dir: &Path) -> Command {
    serve_by(switchyard(), config, dir)
}

/// [`serve`]'s command, run by `program` ([`switchyard`] or [`pid1::switchyard_as_pid1`]).
fn serve_by(mut program: Command, config: &Path, dir: &Path) -> Command {
    let log = std::fs::File::create(dir.join("server.log")).expect("log file");
    program
        .args(["serve", "--config"])
        .arg(config)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log);
    program
}

/// Runs a command that must succeed; returns its stdout.
pub fn succeeds(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run switchyard");
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command that must fail; returns its stderr.
pub fn fails(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run switchyard");
    assert!(!out.status.success(), "{cmd:?} should have failed");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `cmd`, which must fail within `limit` (killed and the test failed past it, as
/// [`wait_exit`] does; `what` names it then), and returns its stderr.
pub fn fails_within(cmd: &mut Command, limit: Duration, what: &str) -> String {
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run switchyard");
    let status = wait_exit(&mut child, limit, what);
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err)
        .expect("read stderr");
    assert!(!status.success(), "{what} should have failed: {err}");
    err
}

/// Makes `cmd` start its process with SIGINT ignored, as a POSIX shell starts a
/// non-interactive shell's background job (`switchyard run-batch ... &` in a script). Run
/// after [`switchyard`]'s reset to the default (`pre_exec` closures run in order).
pub fn ignoring_sigint(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: `signal` is async-signal-safe, and the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            if libc::signal(libc::SIGINT, libc::SIG_IGN) == libc::SIG_ERR {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// Whether process `pid`'s `/proc` status lists `signal` under `field`: `SigIgn` (ignored),
/// `SigCgt` (caught by a handler).
pub fn signal_listed(pid: u32, field: &str, signal: libc::c_int) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in {status}"));
    let mask = u64::from_str_radix(hex.trim(), 16).expect("a hexadecimal mask");
    mask & (1 << (signal - 1)) != 0
}

/// Sends process `pid` (a child the test started and has not reaped) `signal`.
pub fn send_signal(pid: u32, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("a pid");
    // SAFETY: a plain system call, on a process of the test's own.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill");
}
