//! The client side of `bench serve`: HTTP/1.1 over `std::net`, plain or over TLS (rustls on
//! the ring provider, the server's own TLS library, verifying the server against the CA
//! certificates of `--cacert`), chunked transfer decoding and server-sent events. Everything
//! a server sends is bounded (line, chunk and event sizes), so a broken or hostile server
//! fails its requests instead of exhausting memory.
//!
//! The requests of a run go through a [`Pool`] of kept-alive connections, as vLLM's client
//! sends them through one aiohttp session: a request takes an idle connection where there is
//! one (a connection the server has closed is left), else opens one, and gives it back once its
//! response has been read to its end. A request whose reused connection turns out closed before
//! any byte of a response came back is sent again, once, on a fresh connection.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

use super::Sample;

/// Largest HTTP chunk, and largest server-sent event, of a response, in bytes.
const MAX_CHUNK_BYTES: usize = 16 << 20;
/// Longest status, header or chunk-size line of a response, in bytes.
const MAX_LINE_BYTES: u64 = 64 << 10;
/// Largest `/v1/models` or `/metrics` response read, in bytes.
pub(super) const MAX_SMALL_RESPONSE_BYTES: u64 = 16 << 20;
/// Most bytes of a failed response's body read for its error message.
const MAX_ERROR_BODY_BYTES: u64 = 64 << 10;
/// Largest `--cacert` file, in bytes (a system bundle of ~150 roots is about 200 KiB).
const MAX_CACERT_BYTES: u64 = 1 << 20;
/// How long a connection's TLS handshake may take: a server that never answers one (plain
/// HTTP behind an https:// URL waits for a request) fails the request instead of hanging it.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a read may wait once the connection is up (a long prefill sends nothing).
const READ_TIMEOUT: Duration = Duration::from_secs(600);
/// How long an idle connection is kept for another request (aiohttp's `keepalive_timeout` in
/// vLLM's client).
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the end of a streamed body may take to arrive after its `[DONE]` (the chunked
/// body's last chunk) before the connection is dropped instead of kept.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(1);
/// Most bytes read after a stream's `[DONE]` to reach the end of its body.
const MAX_DRAIN_BYTES: usize = 64 << 10;
/// Most trailer lines after a chunked body's last chunk.
const MAX_TRAILER_LINES: usize = 64;

/// Where the server listens, and how to speak to it.
#[derive(Clone)]
pub(super) struct Target {
    /// Host name or address.
    pub(super) host: String,
    /// TCP port.
    pub(super) port: u16,
    /// Path prefix before `/v1` (empty, or starting with `/`).
    pub(super) prefix: String,
    /// The URL is `https://`.
    pub(super) https: bool,
    /// The TLS client's configuration, set (by [`Target::trust`]) for an `https://` URL.
    tls: Option<Arc<rustls::ClientConfig>>,
}

/// Parses `--base-url` (`http://host[:port][/prefix]` or `https://...`; the port defaults to
/// 80 and 443).
pub(super) fn parse_url(url: &str) -> anyhow::Result<Target> {
    let (https, rest) = match (url.strip_prefix("http://"), url.strip_prefix("https://")) {
        (Some(rest), _) => (false, rest),
        (_, Some(rest)) => (true, rest),
        _ => anyhow::bail!("--base-url must start with http:// or https://"),
    };
    let (hostport, prefix) = rest
        .split_once('/')
        .map(|(h, p)| (h, format!("/{}", p.trim_end_matches('/'))))
        .unwrap_or((rest, String::new()));
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) => (h.to_string(), p.parse().context("bad port in --base-url")?),
        None => (hostport.to_string(), if https { 443 } else { 80 }),
    };
    anyhow::ensure!(!host.is_empty(), "--base-url has no host");
    let prefix = if prefix == "/" { String::new() } else { prefix };
    Ok(Target {
        host,
        port,
        prefix,
        https,
        tls: None,
    })
}

impl Target {
    /// Sets up TLS for an `https://` target from `--cacert`: the server's certificate must
    /// chain to one of the file's CA certificates and name the URL's host. `https://` without
    /// `--cacert` is refused (no certificate store is built in), as is `--cacert` with
    /// `http://` (it would be ignored).
    pub(super) fn trust(&mut self, cacert: Option<&Path>) -> anyhow::Result<()> {
        match (self.https, cacert) {
            (false, None) => Ok(()),
            (false, Some(_)) => anyhow::bail!(
                "--cacert is for an https:// --base-url; this one is http://, which TLS does \
                 not protect"
            ),
            (true, None) => anyhow::bail!(
                "an https:// --base-url needs --cacert FILE, the PEM certificate(s) of the CA \
                 that signed the server's certificate (no certificate store is built in; \
                 /etc/ssl/certs/ca-certificates.crt trusts the system's roots on Debian)"
            ),
            (true, Some(path)) => {
                self.tls = Some(Arc::new(client_config(path)?));
                Ok(())
            }
        }
    }
}

/// A TLS client configuration trusting the CA certificates of the PEM file at `path`: the
/// ring provider, rustls' safe default protocol versions, ALPN `http/1.1`.
fn client_config(path: &Path) -> anyhow::Result<rustls::ClientConfig> {
    let shown = path.display();
    let pem = switchyard_config::read_bytes(path, MAX_CACERT_BYTES)
        .with_context(|| format!("--cacert {shown}"))?;
    let mut certificates = Vec::new();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        certificates.push(
            cert.map_err(|e| {
                anyhow::anyhow!("--cacert {shown}: not a PEM certificate file ({e})")
            })?,
        );
    }
    anyhow::ensure!(
        !certificates.is_empty(),
        "--cacert {shown}: no certificate in it (expected PEM blocks `-----BEGIN \
         CERTIFICATE-----`)"
    );
    let mut roots = rustls::RootCertStore::empty();
    let (added, ignored) = roots.add_parsable_certificates(certificates);
    anyhow::ensure!(
        added > 0,
        "--cacert {shown}: none of its {ignored} certificate(s) can be used as a CA"
    );
    if ignored > 0 {
        eprintln!("warning: --cacert {shown}: {ignored} certificate(s) cannot be used, ignored");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("setting up TLS")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// A connection to the server: plain TCP, or TLS over it.
pub(super) enum Connection {
    /// `http://`.
    Plain(Tcp),
    /// `https://`, its handshake done.
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, Tcp>>),
}

/// The TCP stream of a [`Connection`], whose reads end by a deadline while one is set: each
/// read waits at most what is left of it, so that bytes trickling in cannot stretch a bounded
/// read (the drain after a stream's `[DONE]`) past it. Without one, each read waits at most
/// the stream's own timeout ([`READ_TIMEOUT`]).
pub(super) struct Tcp {
    stream: TcpStream,
    deadline: Option<Instant>,
}

impl Tcp {
    fn new(stream: TcpStream) -> Tcp {
        Tcp {
            stream,
            deadline: None,
        }
    }
}

impl Read for Tcp {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the read's deadline passed",
                ));
            }
            self.stream.set_read_timeout(Some(left))?;
        }
        self.stream.read(buf)
    }
}

impl Write for Tcp {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

impl Read for Connection {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::Plain(s) => s.read(buf),
            // A server that closes without TLS's close_notify ends the stream as a plain one
            // would: the HTTP framing (length, chunks, `[DONE]`) tells a cut response.
            Self::Tls(s) => match s.read(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(0),
                other => other,
            },
        }
    }
}

impl Write for Connection {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Self::Plain(s) => s.write(buf),
            Self::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Self::Plain(s) => s.flush(),
            Self::Tls(s) => s.flush(),
        }
    }
}

impl Connection {
    /// The TCP stream under the connection.
    fn tcp(&self) -> &TcpStream {
        match self {
            Self::Plain(s) => &s.stream,
            Self::Tls(s) => &s.sock.stream,
        }
    }

    /// Sets the deadline of the connection's reads (see [`Tcp`]), or with `None` lifts it:
    /// each read then waits at most [`READ_TIMEOUT`] again.
    fn set_deadline(&mut self, deadline: Option<Instant>) -> std::io::Result<()> {
        let tcp = match self {
            Self::Plain(s) => s,
            Self::Tls(s) => &mut s.sock,
        };
        tcp.deadline = deadline;
        if deadline.is_none() {
            tcp.stream.set_read_timeout(Some(READ_TIMEOUT))?;
        }
        Ok(())
    }

    /// Whether an idle connection can carry another request: nothing has arrived on it since
    /// its last response (no end of stream, no TLS alert, no stray byte) and it has no error.
    fn is_open(&self) -> bool {
        let s = self.tcp();
        if s.set_nonblocking(true).is_err() {
            return false;
        }
        let idle = matches!(
            s.peek(&mut [0u8; 1]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
        );
        s.set_nonblocking(false).is_ok() && idle
    }
}

/// A connection to the target, its TLS handshake done for `https://` (within
/// [`HANDSHAKE_TIMEOUT`]); reads then wait at most [`READ_TIMEOUT`].
pub(super) fn connect(t: &Target) -> anyhow::Result<Connection> {
    let (host, port) = (t.host.as_str(), t.port);
    let mut s =
        TcpStream::connect((host, port)).with_context(|| format!("connecting to {host}:{port}"))?;
    s.set_nodelay(true)?;
    let Some(config) = &t.tls else {
        anyhow::ensure!(!t.https, "internal: https:// without a TLS configuration");
        s.set_read_timeout(Some(READ_TIMEOUT))?;
        return Ok(Connection::Plain(Tcp::new(s)));
    };
    // An IPv6 address is written in brackets in a URL, not in a certificate.
    let name = host.trim_start_matches('[').trim_end_matches(']');
    let name = ServerName::try_from(name.to_string())
        .with_context(|| format!("`{host}` is not a host name TLS can verify"))?;
    let mut conn = rustls::ClientConnection::new(Arc::clone(config), name)
        .context("setting up the TLS connection")?;
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    s.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    while conn.is_handshaking() {
        conn.complete_io(&mut s)
            .map_err(|e| handshake_error(&e, host, port))?;
    }
    s.set_read_timeout(Some(READ_TIMEOUT))?;
    s.set_write_timeout(None)?;
    Ok(Connection::Tls(Box::new(rustls::StreamOwned::new(
        conn,
        Tcp::new(s),
    ))))
}

/// Why the TLS handshake with `host:port` failed, with what to check.
fn handshake_error(e: &std::io::Error, host: &str, port: u16) -> anyhow::Error {
    let hint = match e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer)) => {
            " (is --cacert the CA that signed the server's certificate?)"
        }
        Some(rustls::Error::InvalidCertificate(_)) => "",
        _ if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) =>
        {
            " (no answer: does the server speak TLS on this port?)"
        }
        _ => " (does the server speak TLS on this port?)",
    };
    anyhow::anyhow!("TLS handshake with {host}:{port} failed: {e}{hint}")
}

/// The `Authorization` header line of `key`, or nothing.
fn auth_line(key: Option<&str>) -> String {
    key.map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default()
}

/// Sends `GET path` on a fresh connection (with `Connection: close`) and returns it, the
/// response to be read from it to its end.
pub(super) fn get(t: &Target, path: &str, key: Option<&str>) -> anyhow::Result<Connection> {
    let mut s = connect(t)?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {}\r\n{}Connection: close\r\n\r\n",
        t.host,
        auth_line(key)
    );
    s.write_all(request.as_bytes())?;
    s.flush()?;
    Ok(s)
}

/// Asks `/v1/models` for the first model the server lists.
pub(super) fn first_model(t: &Target, key: Option<&str>) -> anyhow::Result<String> {
    let s = get(t, &format!("{}/v1/models", t.prefix), key)?;
    let mut text = String::new();
    s.take(MAX_SMALL_RESPONSE_BYTES).read_to_string(&mut text)?;
    parse_first_model(&text)
}

/// The first model id of a whole `/v1/models` HTTP response; a response other than 200 is
/// an error with its status and body (a 401 asks for `--api-key`).
fn parse_first_model(response: &str) -> anyhow::Result<String> {
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((response, ""));
    let status = head
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("");
    if status != "200" {
        let detail: String = body.trim().chars().take(300).collect();
        let hint = if status == "401" {
            " (pass the key with --api-key or SWITCHYARD_API_KEY)"
        } else {
            ""
        };
        anyhow::bail!("/v1/models answered {status}{hint}: {detail}");
    }
    // Tolerate chunked framing: take the JSON object inside.
    let (Some(start), Some(end)) = (body.find('{'), body.rfind('}')) else {
        anyhow::bail!("/v1/models returned no JSON object");
    };
    anyhow::ensure!(start <= end, "/v1/models returned no JSON object");
    let v: serde_json::Value =
        serde_json::from_str(&body[start..=end]).context("parsing /v1/models")?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .context("no model listed")
}

/// Reads one line of at most `MAX_LINE_BYTES` (a longer one is an error); 0 at end of stream.
fn read_line_bounded(reader: &mut impl BufRead, line: &mut String) -> anyhow::Result<usize> {
    let n = reader.by_ref().take(MAX_LINE_BYTES).read_line(line)?;
    anyhow::ensure!(
        (n as u64) < MAX_LINE_BYTES || line.ends_with('\n'),
        "a line of the response is longer than {} KiB",
        MAX_LINE_BYTES >> 10
    );
    Ok(n)
}

/// The size of an HTTP/1.1 chunk from its size line (extensions after `;` ignored). A chunk
/// over `MAX_CHUNK_BYTES` fails the request rather than allocating what the server asks for.
fn parse_chunk_size(line: &str) -> anyhow::Result<usize> {
    let hex = line.split(';').next().unwrap_or_default().trim();
    let size = usize::from_str_radix(hex, 16).with_context(|| format!("bad chunk size `{hex}`"))?;
    anyhow::ensure!(
        size <= MAX_CHUNK_BYTES,
        "a chunk of {size} bytes exceeds {} MiB",
        MAX_CHUNK_BYTES >> 20
    );
    Ok(size)
}

/// Server-sent events as their bytes arrive: the `data` of each complete event comes out.
/// Events end with a blank line, framed with LF (`\n\n`) or CRLF (`\r\n\r\n`).
#[derive(Debug, Default)]
struct EventStream {
    /// Bytes received and not yet split into events.
    pending: Vec<u8>,
    /// How far `pending` has been searched for the end of an event.
    searched: usize,
}

impl EventStream {
    fn push(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
    }

    /// The data of the next complete event (its `data:` lines joined by newlines), `None` until
    /// one has fully arrived; an event over `MAX_CHUNK_BYTES` is an error.
    fn next_data(&mut self) -> anyhow::Result<Option<String>> {
        loop {
            let Some((end, blank)) = find_event_end(&self.pending, self.searched) else {
                anyhow::ensure!(
                    self.pending.len() <= MAX_CHUNK_BYTES,
                    "a server-sent event exceeds {} MiB",
                    MAX_CHUNK_BYTES >> 20
                );
                // The next blank line may begin in the last 3 bytes ("\r\n\r" + "\n").
                self.searched = self.pending.len().saturating_sub(3);
                return Ok(None);
            };
            let event: Vec<u8> = self.pending.drain(..end + blank).collect();
            self.searched = 0;
            let text = String::from_utf8_lossy(&event[..end]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                return Ok(Some(data.join("\n")));
            }
        }
    }
}

/// Where the first event of `b` ends, searching from `from`: its length and the length of
/// the blank line after it.
fn find_event_end(b: &[u8], from: usize) -> Option<(usize, usize)> {
    (from..b.len()).find_map(|i| {
        if b[i..].starts_with(b"\n\n") {
            Some((i, 2))
        } else if b[i..].starts_with(b"\r\n\r\n") {
            Some((i, 4))
        } else {
            None
        }
    })
}

/// One stream's chunks, timed as vLLM's benchmark times them: every chunk with a choice
/// counts, text or not ("text could be empty here e.g. for special tokens", or an end of
/// sequence under `ignore_eos`); the first one is the first token (TTFT), each later one adds
/// an inter-token latency.
#[derive(Debug, Default)]
struct StreamTimer {
    /// When the latest chunk with a choice arrived.
    last: Option<Instant>,
    /// Chunks with a choice.
    chunks: usize,
    /// `usage.completion_tokens`, the latest the server sent.
    usage_tokens: Option<usize>,
    /// `usage.prompt_tokens`, the latest the server sent.
    usage_prompt_tokens: Option<usize>,
    /// `usage.prompt_tokens_details.cached_tokens`, the latest the server sent.
    cached_tokens: Option<usize>,
}

impl StreamTimer {
    /// Takes one chunk (a parsed event) that arrived at `now`, for a request sent at `t0`.
    fn on_chunk(&mut self, v: &serde_json::Value, now: Instant, t0: Instant, sample: &mut Sample) {
        if let Some(u) = v
            .get("usage")
            .and_then(|u| u.get("completion_tokens"))
            .and_then(|c| c.as_u64())
        {
            self.usage_tokens = Some(usize::try_from(u).unwrap_or(usize::MAX));
        }
        if let Some(p) = v
            .get("usage")
            .and_then(|u| u.get("prompt_tokens"))
            .and_then(|c| c.as_u64())
        {
            self.usage_prompt_tokens = Some(usize::try_from(p).unwrap_or(usize::MAX));
        }
        if let Some(c) = v
            .get("usage")
            .and_then(|u| u.get("prompt_tokens_details"))
            .and_then(|d| d.get("cached_tokens"))
            .and_then(|c| c.as_u64())
        {
            self.cached_tokens = Some(usize::try_from(c).unwrap_or(usize::MAX));
        }
        // A usage-only chunk (`choices: []`) is not a token.
        if v.get("choices").and_then(|c| c.get(0)).is_none() {
            return;
        }
        match self.last {
            None => sample.ttft = (now - t0).as_secs_f64(),
            Some(l) => sample.itl.push((now - l).as_secs_f64()),
        }
        self.last = Some(now);
        self.chunks += 1;
    }

    /// Ends the sample of a request sent at `t0`, its stream read: its E2E latency runs to
    /// the last chunk with a choice, as vLLM's (the usage chunk and `[DONE]` after it carry no
    /// token; without any such chunk, to `end`); its output tokens are the server's usage, or
    /// without one the chunks with a choice (a token each; fewer than the tokens when a chunk
    /// carries several, as with speculative decoding), flagged in [`Sample::usage_missing`];
    /// its prompt tokens are the server's `usage.prompt_tokens` where it sent one (as vLLM's),
    /// else the ids sent.
    fn finish(&self, t0: Instant, end: Instant, sample: &mut Sample) {
        sample.latency = (self.last.unwrap_or(end) - t0).as_secs_f64();
        sample.output_tokens = self.usage_tokens.unwrap_or(self.chunks);
        sample.usage_missing = self.usage_tokens.is_none();
        if let Some(p) = self.usage_prompt_tokens {
            sample.prompt_tokens = p;
        }
        sample.cached_tokens = self.cached_tokens;
    }
}

/// The connections of a run to its target: the idle ones, kept alive for the next request
/// (most recently used first), and a count of those opened.
pub(super) struct Pool {
    /// Where the requests go.
    target: Target,
    /// Connections whose last response was read to its end, and when it ended.
    idle: Mutex<Vec<(Connection, Instant)>>,
    /// Most idle connections kept (the threads sending requests: more are never idle at once).
    max_idle: usize,
    /// Connections opened so far.
    opened: AtomicUsize,
}

/// Why sending a request on a connection failed.
enum SendError {
    /// The connection was closed (or reset) before any byte of a response came back: the
    /// server dropped it while it was idle, and a fresh connection may carry the request.
    Closed(anyhow::Error),
    /// Anything else: part of a response arrived, or it was not HTTP.
    Failed(anyhow::Error),
}

impl Pool {
    /// A pool for `target` keeping at most `max_idle` idle connections.
    pub(super) fn new(target: Target, max_idle: usize) -> Pool {
        Pool {
            target,
            idle: Mutex::new(Vec::new()),
            max_idle: max_idle.max(1),
            opened: AtomicUsize::new(0),
        }
    }

    /// Connections opened so far.
    #[cfg(test)]
    fn opened(&self) -> usize {
        self.opened.load(Ordering::Relaxed)
    }

    /// The most recently used idle connection still open, if any (those closed, or idle for
    /// longer than [`KEEPALIVE_TIMEOUT`], are dropped).
    fn take(&self) -> Option<Connection> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some((conn, since)) = idle.pop() {
            if since.elapsed() < KEEPALIVE_TIMEOUT && conn.is_open() {
                return Some(conn);
            }
        }
        None
    }

    /// Keeps `conn` for another request, unless the pool is full.
    fn put(&self, conn: Connection) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < self.max_idle {
            idle.push((conn, Instant::now()));
        }
    }

    /// A fresh connection to the target.
    fn open(&self) -> anyhow::Result<Connection> {
        let conn = connect(&self.target)?;
        self.opened.fetch_add(1, Ordering::Relaxed);
        Ok(conn)
    }

    /// POSTs `body` (JSON) to `path` and reads the response's head: on an idle connection
    /// where there is one, else on a fresh one. Where the idle connection turns out closed
    /// before any byte of a response came back (the server closed it as the request went
    /// out), the request is sent again on a fresh connection, once; a connection that fails
    /// after part of a response fails the request. The request counts as sent (the
    /// [`ResponseHead::sent`] its latencies count from) when it is issued, before a
    /// connection is taken or opened, as vLLM's client starts its clock before the session
    /// finds it a connection.
    pub(super) fn post(
        &self,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> anyhow::Result<ResponseHead> {
        let sent = Instant::now();
        // One write: over TLS each write is a record of its own.
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\n{}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.target.host,
            auth_line(key),
            body.len()
        );
        if let Some(conn) = self.take() {
            match send(conn, &request, sent) {
                Ok(head) => return Ok(head),
                Err(SendError::Failed(e)) => return Err(e),
                // Sent again below, on a fresh connection.
                Err(SendError::Closed(_)) => {}
            }
        }
        match send(self.open()?, &request, sent) {
            Ok(head) => Ok(head),
            Err(SendError::Closed(e) | SendError::Failed(e)) => Err(e),
        }
    }
}

/// Sends `request` on `conn` and reads the response's head.
fn send(mut conn: Connection, request: &str, sent: Instant) -> Result<ResponseHead, SendError> {
    let closed = |e: std::io::Error| {
        SendError::Closed(anyhow::Error::new(e).context("the connection was closed"))
    };
    conn.write_all(request.as_bytes()).map_err(closed)?;
    conn.flush().map_err(closed)?;
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    match read_line_bounded(&mut reader, &mut line) {
        Ok(0) => {
            return Err(SendError::Closed(anyhow::anyhow!(
                "the server closed the connection without a response"
            )))
        }
        Ok(_) => {}
        Err(e) => {
            let reset = e.downcast_ref::<std::io::Error>().is_some_and(|e| {
                matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::BrokenPipe
                        | std::io::ErrorKind::UnexpectedEof
                )
            });
            return Err(if reset && line.is_empty() {
                SendError::Closed(e)
            } else {
                SendError::Failed(e)
            });
        }
    }
    read_head(reader, &line, sent).map_err(SendError::Failed)
}

/// The rest of a response's head after its status line `status_line`.
fn read_head(
    mut reader: BufReader<Connection>,
    status_line: &str,
    sent: Instant,
) -> anyhow::Result<ResponseHead> {
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    // HTTP/1.1 keeps the connection unless the server says otherwise; HTTP/1.0 closes it.
    let mut keep_alive = status_line.starts_with("HTTP/1.1 ");
    let (mut chunked, mut length) = (false, None);
    let mut line = String::new();
    loop {
        line.clear();
        if read_line_bounded(&mut reader, &mut line)? == 0 {
            break;
        }
        let l = line.trim_end().to_ascii_lowercase();
        if l.is_empty() {
            break;
        }
        if l.starts_with("transfer-encoding:") && l.contains("chunked") {
            chunked = true;
        }
        if let Some(n) = l.strip_prefix("content-length:") {
            length = Some(n.trim().parse().context("a bad Content-Length")?);
        }
        if let Some(v) = l.strip_prefix("connection:") {
            if v.split(',').any(|t| t.trim() == "close") {
                keep_alive = false;
            }
        }
    }
    // A 204 or 304 answer has no body, whatever its head says (RFC 9112, 6.3).
    if matches!(status, 204 | 304) {
        (chunked, length) = (false, Some(0));
    }
    let length = length.filter(|_| !chunked);
    Ok(ResponseHead {
        reader,
        status,
        chunked,
        // A body that runs to the end of the connection leaves nothing to keep.
        keep_alive: keep_alive && (chunked || length.is_some()),
        length,
        ended: length == Some(0),
        sent,
    })
}

/// A response whose head has been read: its status and how its body is framed.
pub(super) struct ResponseHead {
    /// The body, after the head.
    reader: BufReader<Connection>,
    /// The HTTP status (0 if the status line had none).
    pub(super) status: u16,
    /// The body is sent in chunks (`Transfer-Encoding: chunked`).
    chunked: bool,
    /// The body's bytes not yet read, where the head gives its length (`Content-Length`) and
    /// it is not chunked.
    length: Option<u64>,
    /// The connection may carry another request once the body has been read to its end.
    keep_alive: bool,
    /// The body has been read to its end, as its framing says.
    ended: bool,
    /// When the request was issued (before a connection was taken or opened for it): a
    /// request's latencies count from here, as vLLM's client counts them.
    pub(super) sent: Instant,
}

impl ResponseHead {
    /// Reads the next piece of the body into `buf` (replacing what it held): a chunk, up to the
    /// length left, or what arrives; `false` once the body has ended (a chunked body's
    /// trailers read, so that the connection is at its next response).
    fn next_piece(&mut self, buf: &mut Vec<u8>) -> anyhow::Result<bool> {
        buf.clear();
        if self.ended {
            return Ok(false);
        }
        if self.chunked {
            let mut line = String::new();
            anyhow::ensure!(
                read_line_bounded(&mut self.reader, &mut line)? > 0,
                "the response ended inside its chunked body"
            );
            let size = parse_chunk_size(&line)?;
            if size == 0 {
                // The trailer section, up to its blank line.
                for _ in 0..MAX_TRAILER_LINES {
                    line.clear();
                    if read_line_bounded(&mut self.reader, &mut line)? == 0
                        || line.trim_end().is_empty()
                    {
                        self.ended = true;
                        return Ok(false);
                    }
                }
                anyhow::bail!("more than {MAX_TRAILER_LINES} trailer lines after the body");
            }
            buf.resize(size, 0);
            self.reader.read_exact(buf)?;
            line.clear();
            read_line_bounded(&mut self.reader, &mut line)?;
            return Ok(true);
        }
        let want = self.length.map_or(8192, |n| n.min(8192) as usize);
        buf.resize(want, 0);
        let n = self.reader.read(buf)?;
        buf.truncate(n);
        if let Some(left) = &mut self.length {
            anyhow::ensure!(n > 0, "the response ended before its Content-Length");
            *left -= n as u64;
            self.ended = *left == 0;
        } else if n == 0 {
            self.ended = true;
            return Ok(false);
        }
        Ok(true)
    }

    /// The body, up to `max` bytes: whether it all came, and what came.
    fn read_up_to(&mut self, max: usize) -> anyhow::Result<(bool, Vec<u8>)> {
        let mut body = Vec::new();
        let mut piece = Vec::new();
        while self.next_piece(&mut piece)? {
            if piece.len() > max - body.len() {
                return Ok((false, body));
            }
            body.extend_from_slice(&piece);
        }
        Ok((true, body))
    }

    /// The error of a response other than 200: its status and the start of its body (the
    /// server's reason).
    pub(super) fn error(&mut self) -> String {
        let rest = match self.read_up_to(MAX_ERROR_BODY_BYTES as usize) {
            Ok((_, body)) => String::from_utf8_lossy(&body).into_owned(),
            Err(e) => format!("(its body could not be read: {e:#})"),
        };
        format!(
            "HTTP {}: {}",
            self.status,
            rest.chars().take(200).collect::<String>()
        )
    }

    /// The whole body of a response that is not streamed, of at most `max` bytes (a longer
    /// one is an error): chunks joined, its `Content-Length`, or else everything up to the
    /// end of the connection.
    pub(super) fn body(&mut self, max: usize) -> anyhow::Result<Vec<u8>> {
        if let Some(n) = self.length {
            anyhow::ensure!(
                n <= max as u64,
                "the response's body is larger than {} MiB",
                max >> 20
            );
        }
        match self.read_up_to(max)? {
            (true, body) => Ok(body),
            (false, _) => anyhow::bail!("the response's body is larger than {} MiB", max >> 20),
        }
    }

    /// Reads what is left of a framed body whose content is no longer needed (after a
    /// stream's `[DONE]`), for at most [`DRAIN_TIMEOUT`] in all and [`MAX_DRAIN_BYTES`], so
    /// that its connection can carry another request; a body that does not end by then leaves
    /// the connection to be dropped.
    fn drain(&mut self) {
        if self.ended || !self.keep_alive {
            return;
        }
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        let set = self.reader.get_mut().set_deadline(Some(deadline)).is_ok();
        let drained = set && matches!(self.read_up_to(MAX_DRAIN_BYTES), Ok((true, _)));
        let lifted = self.reader.get_mut().set_deadline(None).is_ok();
        if !(drained && lifted) {
            self.keep_alive = false;
        }
    }

    /// Gives the connection back to `pool` where it can carry another request: its response
    /// was read to its end (and nothing more arrived), and neither side asked to close it.
    pub(super) fn release(self, pool: &Pool) {
        if self.keep_alive && self.ended && self.reader.buffer().is_empty() {
            pool.put(self.reader.into_inner());
        }
    }
}

/// Sends one streaming completion and timestamps its chunks. A request succeeds when its
/// stream completes (`[DONE]`) after at least one chunk with a choice, even one without text
/// (an immediate end of sequence), as in vLLM, and carries no `error` event and no event
/// that is not JSON. vLLM's client is laxer there: it counts a stream cut before `[DONE]`, or
/// one whose server reported an error after some tokens, a success; this one counts them
/// failed, so a server's failures do not add to its throughput.
pub(super) fn one_request(
    pool: &Pool,
    path: &str,
    key: Option<&str>,
    body: &str,
    input: usize,
) -> anyhow::Result<Sample> {
    let mut head = pool.post(path, key, body)?;
    let t0 = head.sent;
    let mut sample = Sample {
        prompt_tokens: input,
        inputs: 1,
        sent: Some(t0),
        ..Sample::default()
    };
    if head.status != 200 {
        sample.error = head.error();
        head.release(pool);
        return Ok(sample);
    }
    let mut events = EventStream::default();
    let mut timer = StreamTimer::default();
    let mut done = false;
    // The first error event, or event that is not JSON.
    let mut failure: Option<String> = None;
    let mut buf = Vec::new();
    while !done && head.next_piece(&mut buf)? {
        let now = Instant::now();
        events.push(&buf);
        while let Some(data) = events.next_data()? {
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                break;
            }
            match serde_json::from_str::<serde_json::Value>(data) {
                Ok(v) if v.get("error").is_some() => {
                    let shown: String = data.chars().take(200).collect();
                    failure.get_or_insert(format!("the stream reported an error: {shown}"));
                }
                Ok(v) => timer.on_chunk(&v, now, t0, &mut sample),
                Err(e) => {
                    failure.get_or_insert(format!("an event of the stream is not JSON: {e}"));
                }
            }
        }
    }
    timer.finish(t0, Instant::now(), &mut sample);
    // The end of the body after `[DONE]`, so that the connection can carry the next request
    // (the figures are taken already).
    head.drain();
    head.release(pool);
    let any = timer.chunks > 0;
    sample.ok = done && any && failure.is_none();
    if let Some(failure) = failure {
        sample.error = failure;
    } else if !done {
        sample.error = "stream ended without [DONE]".into();
    } else if !any {
        sample.error = "stream ended without a completion chunk".into();
    }
    Ok(sample)
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
        let t = parse_url("https://localhost/v1x").unwrap();
        assert_eq!((t.https, t.port, t.prefix.as_str()), (true, 443, "/v1x"));
        assert!(!parse_url("http://x").unwrap().https);
        for bad in ["ftp://x", "localhost:8000", "http://:80", "https://x:port"] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    /// `https://` needs `--cacert`, `http://` refuses it, and a file without a usable CA
    /// certificate is refused naming it, before anything is sent.
    #[test]
    fn https_needs_a_cacert_with_a_ca_certificate() {
        let fixture = |name: &str| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/tls")
                .join(name)
        };
        let mut t = parse_url("https://localhost:8443").unwrap();
        let e = t.trust(None).unwrap_err().to_string();
        assert!(e.contains("needs --cacert"), "{e}");
        t.trust(Some(&fixture("ca.pem"))).unwrap();
        assert!(t.tls.is_some());
        let mut plain = parse_url("http://localhost:8000").unwrap();
        plain.trust(None).unwrap();
        let e = plain.trust(Some(&fixture("ca.pem"))).unwrap_err();
        assert!(e.to_string().contains("--cacert is for an https://"), "{e}");
        let mut t = parse_url("https://localhost:8443").unwrap();
        for (name, why) in [
            ("server.key", "no certificate in it"),
            ("missing.pem", "cannot read it"),
            ("", "not a regular file"),
        ] {
            let e = format!("{:#}", t.trust(Some(&fixture(name))).unwrap_err());
            assert!(e.contains("--cacert") && e.contains(why), "{name}: {e}");
        }
        assert!(t.tls.is_none());
    }

    #[test]
    fn models_body_without_a_json_object_is_an_error_not_a_panic() {
        let ok = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                  25\r\n{\"object\":\"list\",\"data\":[{\"id\":\"m\"}]}\r\n0\r\n\r\n";
        assert_eq!(parse_first_model(ok).unwrap(), "m");
        for bad in [
            "",
            "HTTP/1.1 200 OK\r\n\r\n",
            "HTTP/1.1 200 OK\r\n\r\n{",
            "HTTP/1.1 200 OK\r\n\r\n}",
            "HTTP/1.1 200 OK\r\n\r\n} {",
            "HTTP/1.1 200 OK\r\n\r\n{\"data\":[]}",
        ] {
            assert!(parse_first_model(bad).is_err(), "{bad:?}");
        }
        // A refusal says so, with the server's reason (not "no model listed").
        let denied = "HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n\r\n\
                      {\"error\":{\"message\":\"Missing API key\"}}";
        let e = parse_first_model(denied).unwrap_err().to_string();
        assert!(
            e.contains("401") && e.contains("--api-key") && e.contains("Missing API key"),
            "{e}"
        );
    }

    #[test]
    fn chunk_sizes_are_capped() {
        assert_eq!(parse_chunk_size("1a\r\n").unwrap(), 26);
        assert_eq!(parse_chunk_size("5;name=value\r\n").unwrap(), 5);
        assert_eq!(parse_chunk_size("0\r\n").unwrap(), 0);
        assert_eq!(parse_chunk_size("1000000\r\n").unwrap(), MAX_CHUNK_BYTES);
        for bad in [
            "1000001\r\n",
            "ffffffffffffffff\r\n",
            "1ffffffffffffffff",
            "zz",
            "",
        ] {
            assert!(parse_chunk_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn events_split_on_lf_and_crlf_framing_across_reads() {
        let mut events = EventStream::default();
        events.push(b"data: {\"a\":1}\n\ndata: {\"b\"");
        assert_eq!(events.next_data().unwrap().as_deref(), Some("{\"a\":1}"));
        assert_eq!(events.next_data().unwrap(), None);
        events.push(b":2}\r\n\r");
        assert_eq!(events.next_data().unwrap(), None);
        events.push(b"\n: comment\r\n\r\ndata:[DONE]\r\n\r\n");
        assert_eq!(events.next_data().unwrap().as_deref(), Some("{\"b\":2}"));
        assert_eq!(events.next_data().unwrap().as_deref(), Some("[DONE]"));
        assert_eq!(events.next_data().unwrap(), None);
    }

    /// One chunk of a completion stream with this text.
    fn text_chunk(text: &str) -> serde_json::Value {
        serde_json::json!({"choices": [{"index": 0, "text": text, "finish_reason": null}]})
    }

    #[test]
    fn chunks_without_text_are_timed_as_tokens() {
        // vLLM times every chunk with a choice: a special token's empty text first is the
        // first token, and an empty chunk between two texts is a token of its own.
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut timer = StreamTimer::default();
        let mut sample = Sample::default();
        for (at, text) in [(1, ""), (3, "a"), (6, ""), (10, "b")] {
            timer.on_chunk(&text_chunk(text), ms(at), t0, &mut sample);
        }
        let usage = serde_json::json!({"choices": [], "usage": {"completion_tokens": 4}});
        timer.on_chunk(&usage, ms(11), t0, &mut sample);
        // `[DONE]` at 12 ms: the E2E latency ends at the last chunk with a choice (10 ms), as
        // vLLM's `most_recent_timestamp - st`, not at the usage chunk or the stream's end.
        timer.finish(t0, ms(12), &mut sample);
        assert_eq!(sample.latency, 0.010);
        // A usage without `prompt_tokens_details` says nothing of the prefix cache.
        assert_eq!(sample.cached_tokens, None);
        assert_eq!(sample.ttft, 0.001);
        let itl: Vec<u128> = sample
            .itl
            .iter()
            .map(|s| Duration::from_secs_f64(*s).as_micros())
            .collect();
        assert_eq!(itl, vec![2000, 3000, 4000]);
        assert_eq!((sample.output_tokens, sample.usage_missing), (4, false));
    }

    /// The server's `usage.prompt_tokens_details.cached_tokens` (OpenAI's and vLLM's shape,
    /// in the final usage chunk of a stream) is kept on the sample.
    #[test]
    fn cached_prompt_tokens_are_read_from_the_streamed_usage() {
        let t0 = Instant::now();
        let mut timer = StreamTimer::default();
        let mut sample = Sample::default();
        timer.on_chunk(&text_chunk("a"), t0, t0, &mut sample);
        let usage = serde_json::json!({"choices": [], "usage": {"prompt_tokens": 40,
            "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 32}}});
        timer.on_chunk(&usage, t0, t0, &mut sample);
        timer.finish(t0, t0, &mut sample);
        assert_eq!(sample.cached_tokens, Some(32));
        // The server's prompt tokens replace the ids counted when it sends them, as vLLM's.
        assert_eq!(sample.prompt_tokens, 40);
    }

    /// The plain-HTTP target on a loopback port.
    fn local(port: u16) -> Target {
        parse_url(&format!("http://127.0.0.1:{port}")).unwrap()
    }

    /// A pool of connections to a loopback port.
    fn pool(port: u16) -> Pool {
        Pool::new(local(port), 4)
    }

    /// Answers the first connection on a loopback port with `response` once the request
    /// (whose body is `{}`) has arrived.
    fn serve_once(response: String) -> u16 {
        serve_in_parts(vec![(Duration::ZERO, response)])
    }

    /// Answers the first connection on a loopback port, once the request (whose body is
    /// `{}`) has arrived, with each part after its pause.
    fn serve_in_parts(parts: Vec<(Duration, String)>) -> u16 {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while !got.ends_with(b"{}") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            for (pause, part) in parts {
                std::thread::sleep(pause);
                if s.write_all(part.as_bytes())
                    .and_then(|()| s.flush())
                    .is_err()
                {
                    return;
                }
            }
        });
        port
    }

    /// vLLM's E2E latency ends at the last chunk with a choice: a usage chunk and `[DONE]`
    /// that come later (here 200 ms later) do not lengthen it, so a one-chunk answer's E2E
    /// latency is its TTFT; its prompt tokens are the server's `usage.prompt_tokens`.
    #[test]
    fn the_latency_ends_at_the_last_token_not_at_done() {
        let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n";
        let usage = serde_json::json!({"choices": [],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1}});
        let port = serve_in_parts(vec![
            (
                Duration::ZERO,
                format!("{head}data: {}\n\n", text_chunk("a")),
            ),
            (
                Duration::from_millis(200),
                format!("data: {usage}\n\ndata: [DONE]\n\n"),
            ),
        ]);
        let sent = Instant::now();
        let sample = one_request(&pool(port), "/v1/completions", None, "{}", 3).unwrap();
        assert!(sample.ok, "{}", sample.error);
        assert!(sent.elapsed() >= Duration::from_millis(200));
        assert_eq!(sample.latency, sample.ttft);
        assert!(sample.itl.is_empty());
        assert_eq!((sample.prompt_tokens, sample.output_tokens), (4, 1));
    }

    #[test]
    fn a_stream_without_usage_counts_its_chunks_as_output_tokens() {
        let mut response =
            String::from("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n");
        for text in ["", "a", "", "b"] {
            response.push_str(&format!("data: {}\n\n", text_chunk(text)));
        }
        response.push_str("data: [DONE]\n\n");
        let port = serve_once(response);
        let sample = one_request(&pool(port), "/v1/completions", None, "{}", 3).unwrap();
        assert!(sample.ok, "{}", sample.error);
        assert_eq!((sample.output_tokens, sample.usage_missing), (4, true));
        // Every chunk is timed, the empty ones too.
        assert_eq!(sample.itl.len(), 3);
        assert_eq!(sample.prompt_tokens, 3);
    }

    /// A stream that reports an error after its first tokens, or sends an event that is not
    /// JSON, fails its request, `[DONE]` or not (vLLM's client counts the first a success).
    #[test]
    fn an_error_event_after_tokens_fails_the_request() {
        let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n";
        let error = r#"{"error":{"message":"the server is shutting down","type":"unavailable"}}"#;
        // The events after the first tokens' chunk.
        for (events, why) in [
            (&[error, "[DONE]"][..], "the stream reported an error: "),
            (
                &["{\"choices\": [", "[DONE]"],
                "an event of the stream is not JSON",
            ),
            // Cut before [DONE]: failed too.
            (&[], "stream ended without [DONE]"),
        ] {
            let mut response = format!("{head}data: {}\n\n", text_chunk("a"));
            for event in events {
                response.push_str(&format!("data: {event}\n\n"));
            }
            let sample = one_request(
                &pool(serve_once(response)),
                "/v1/completions",
                None,
                "{}",
                3,
            )
            .unwrap();
            assert!(
                !sample.ok && sample.error.starts_with(why),
                "{}",
                sample.error
            );
        }
    }

    /// A body that is not streamed reads whole, chunked or up to the end of the connection,
    /// and one over the cap is an error, not a truncation.
    #[test]
    fn whole_bodies_read_chunked_or_to_the_end_up_to_a_cap() {
        let read = |response: &str, max: usize| {
            let port = serve_once(response.to_string());
            let mut head = pool(port).post("/v1/embeddings", None, "{}").unwrap();
            assert_eq!(head.status, 200);
            head.body(max)
        };
        let chunked = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                       4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n";
        assert_eq!(read(chunked, 7).unwrap(), b"{\"a\":1}");
        assert!(read(chunked, 6).is_err());
        let sized = "HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n{\"a\":1}";
        assert_eq!(read(sized, 7).unwrap(), b"{\"a\":1}");
        assert!(read(sized, 6).is_err());
        // Read to its length, not to the end of the connection.
        let short = "HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n{\"a\":1}";
        assert_eq!(read(short, 100).unwrap(), b"{\"a\"");
        let cut_short = "HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{\"a\":1}";
        assert!(read(cut_short, 100).is_err());
        let bad = "HTTP/1.1 200 OK\r\ncontent-length: many\r\n\r\n{\"a\":1}";
        let port = serve_once(bad.to_string());
        assert!(pool(port).post("/v1/embeddings", None, "{}").is_err());
        let to_close = "HTTP/1.1 200 OK\r\n\r\n{\"a\":1}";
        assert_eq!(read(to_close, 7).unwrap(), b"{\"a\":1}");
        assert!(read(to_close, 6).is_err());
        // A chunked body cut off is an error too.
        let cut = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n";
        assert!(read(cut, 100).is_err());
        // A refusal keeps its status and reason.
        let port = serve_once("HTTP/1.1 400 Bad Request\r\n\r\n{\"error\":\"too long\"}".into());
        let mut head = pool(port).post("/v1/embeddings", None, "{}").unwrap();
        assert_eq!(head.error(), "HTTP 400: {\"error\":\"too long\"}");
    }

    #[test]
    fn an_event_that_never_ends_fails_the_request() {
        let mut events = EventStream::default();
        let piece = vec![b'x'; 1 << 20];
        for _ in 0..(MAX_CHUNK_BYTES >> 20) {
            events.push(&piece);
            assert_eq!(events.next_data().unwrap(), None);
        }
        events.push(b"x");
        assert!(events.next_data().is_err());
    }

    /// What a test server does with one request of a connection.
    enum Step {
        /// Answers it, and waits for the next request.
        Answer(String),
        /// Sends this (a whole answer or a part of one) and closes the connection.
        Cut(String),
        /// Closes the connection without answering.
        Drop,
    }

    /// Reads one request (its head, and its body of `Content-Length` bytes); false at the end
    /// of the connection.
    fn read_request(reader: &mut BufReader<TcpStream>) -> bool {
        let mut length = 0;
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return false,
                Ok(_) => {}
            }
            let l = line.trim_end().to_ascii_lowercase();
            if l.is_empty() {
                break;
            }
            if let Some(n) = l.strip_prefix("content-length:") {
                length = n.trim().parse().unwrap();
            }
        }
        let mut body = vec![0u8; length];
        reader.read_exact(&mut body).is_ok()
    }

    /// A server on a loopback port that runs the steps of its `i`th connection on it, one a
    /// request, and closes it after the last; returns its port and the count of connections
    /// it accepted.
    fn keep_alive_server(connections: Vec<Vec<Step>>) -> (u16, Arc<AtomicUsize>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        std::thread::spawn(move || {
            for steps in connections {
                let Ok((stream, _)) = listener.accept() else {
                    return;
                };
                count.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || {
                    let mut out = stream.try_clone().unwrap();
                    let mut reader = BufReader::new(stream);
                    for step in steps {
                        if !read_request(&mut reader) {
                            return;
                        }
                        match step {
                            Step::Answer(a) => {
                                if out.write_all(a.as_bytes()).is_err() {
                                    return;
                                }
                            }
                            Step::Cut(a) => {
                                let _ = out.write_all(a.as_bytes());
                                return;
                            }
                            Step::Drop => return,
                        }
                    }
                });
            }
        });
        (port, accepted)
    }

    /// A streamed completion of one chunk, its usage and `[DONE]`, in HTTP chunks.
    fn chunked_stream() -> String {
        let usage = serde_json::json!({"choices": [],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1}});
        let mut response = String::from(
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
             Transfer-Encoding: chunked\r\n\r\n",
        );
        for data in [
            text_chunk("a").to_string(),
            usage.to_string(),
            "[DONE]".into(),
        ] {
            let event = format!("data: {data}\n\n");
            response.push_str(&format!("{:x}\r\n{event}\r\n", event.len()));
        }
        response.push_str("0\r\n\r\n");
        response
    }

    /// A completion request, which must succeed.
    fn completes(pool: &Pool) {
        let sample = one_request(pool, "/v1/completions", None, "{}", 3).unwrap();
        assert!(sample.ok, "{}", sample.error);
        assert_eq!((sample.prompt_tokens, sample.output_tokens), (4, 1));
    }

    /// Requests one after another share one kept-alive connection, whatever their answers'
    /// framing: a stream in chunks (read past `[DONE]` to its last chunk), a refusal with a
    /// length, a whole body with a length and one in chunks with a trailer.
    #[test]
    fn requests_reuse_a_kept_alive_connection() {
        let refusal = "HTTP/1.1 429 Too Many Requests\r\nContent-Length: 11\r\n\r\nslow down!!";
        let sized = "HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n{\"a\":1}";
        let chunked = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                       4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\nx-trailer: 1\r\n\r\n";
        let steps = vec![
            Step::Answer(chunked_stream()),
            Step::Answer(refusal.into()),
            Step::Answer(chunked_stream()),
            Step::Answer(sized.into()),
            Step::Answer(chunked.into()),
            Step::Answer(chunked_stream()),
        ];
        let (port, accepted) = keep_alive_server(vec![steps]);
        let pool = pool(port);
        completes(&pool);
        let refused = one_request(&pool, "/v1/completions", None, "{}", 3).unwrap();
        assert_eq!(refused.error, "HTTP 429: slow down!!");
        completes(&pool);
        for _ in 0..2 {
            let mut head = pool.post("/v1/embeddings", None, "{}").unwrap();
            assert_eq!(head.body(100).unwrap(), b"{\"a\":1}");
            head.release(&pool);
        }
        completes(&pool);
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        assert_eq!(pool.opened(), 1);
    }

    /// A connection whose answer runs to its end (no length, no chunks), or that the server
    /// says it closes, is not kept.
    #[test]
    fn a_connection_the_server_ends_is_not_kept() {
        let to_close = "HTTP/1.1 200 OK\r\n\r\n{\"a\":1}";
        let closing = "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 7\r\n\r\n{\"a\":1}";
        let (port, accepted) = keep_alive_server(vec![
            vec![Step::Cut(to_close.into())],
            vec![Step::Answer(closing.into())],
            vec![Step::Answer(chunked_stream())],
        ]);
        let pool = pool(port);
        for _ in 0..2 {
            let mut head = pool.post("/v1/embeddings", None, "{}").unwrap();
            assert_eq!(head.body(100).unwrap(), b"{\"a\":1}");
            head.release(&pool);
        }
        completes(&pool);
        assert_eq!((accepted.load(Ordering::SeqCst), pool.opened()), (3, 3));
    }

    /// A kept connection the server closed while it was idle is left for a fresh one, and a
    /// request the server drops unanswered on a kept connection (it closed the connection as
    /// the request went out) is sent again, once, on a fresh one: both succeed.
    #[test]
    fn a_closed_kept_connection_is_replaced_and_its_request_sent_again() {
        let (port, accepted) = keep_alive_server(vec![
            // Answers, then closes the idle connection.
            vec![Step::Cut(chunked_stream())],
            // Answers, then drops the next request unanswered.
            vec![Step::Answer(chunked_stream()), Step::Drop],
            vec![Step::Answer(chunked_stream())],
        ]);
        let pool = pool(port);
        completes(&pool);
        // Let the close arrive: the idle connection is seen closed and left.
        std::thread::sleep(Duration::from_millis(50));
        completes(&pool);
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        // Sent on the kept connection, dropped, sent again on a third.
        completes(&pool);
        assert_eq!((accepted.load(Ordering::SeqCst), pool.opened()), (3, 3));
    }

    /// A request whose answer has begun when its connection breaks fails, without being sent
    /// again, as does one whose fresh connection closes unanswered.
    #[test]
    fn a_broken_answer_fails_its_request_without_sending_it_again() {
        // Cut after the first event's chunk: a head, a token, no [DONE].
        let event = format!("data: {}\n\n", text_chunk("a"));
        let cut = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
             Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{event}\r\n",
            event.len()
        );
        let (port, accepted) = keep_alive_server(vec![
            vec![Step::Answer(chunked_stream()), Step::Cut(cut)],
            vec![Step::Drop],
        ]);
        let pool = pool(port);
        completes(&pool);
        let broken = one_request(&pool, "/v1/completions", None, "{}", 3);
        let error = match broken {
            Ok(sample) => {
                assert!(!sample.ok);
                sample.error
            }
            Err(e) => format!("{e:#}"),
        };
        assert!(
            error.contains("ended inside its chunked body") || error.contains("[DONE]"),
            "{error}"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        // A fresh connection closed unanswered: an error, and no third connection.
        let e = pool
            .post("/v1/completions", None, "{}")
            .err()
            .expect("no answer");
        assert!(
            format!("{e:#}").contains("closed the connection without a response"),
            "{e:#}"
        );
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!((accepted.load(Ordering::SeqCst), pool.opened()), (2, 2));
    }

    /// A stream whose body goes on after `[DONE]` (a comment every 200 ms for a minute, never
    /// its last chunk) is given up [`DRAIN_TIMEOUT`] after `[DONE]` in all, not once a second
    /// passes without a byte: the request succeeds at once and its connection is not kept. It
    /// used to be read for as long as the bytes kept coming (up to 64 KiB of them): here the
    /// whole minute. The bound taken between the two, half a minute, leaves a loaded machine
    /// 29 s of scheduling delay before it could fail by chance.
    #[test]
    fn the_drain_after_done_ends_by_its_deadline() {
        let chunk = |text: &str| format!("{:x}\r\n{text}\r\n", text.len());
        let mut head = String::from(
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
             Transfer-Encoding: chunked\r\n\r\n",
        );
        head.push_str(&chunk(&format!("data: {}\n\n", text_chunk("a"))));
        head.push_str(&chunk("data: [DONE]\n\n"));
        let mut parts = vec![(Duration::ZERO, head)];
        parts.extend((0..300).map(|_| (Duration::from_millis(200), chunk(": ping\n\n"))));
        let pool = pool(serve_in_parts(parts));
        let t0 = Instant::now();
        let sample = one_request(&pool, "/v1/completions", None, "{}", 3).unwrap();
        let took = t0.elapsed();
        assert!(sample.ok, "{}", sample.error);
        assert!(took < Duration::from_secs(30), "{took:?}");
        assert!(
            pool.take().is_none(),
            "a connection inside its body was kept"
        );
    }

    /// A 204 or 304 answer has no body whatever its head says (RFC 9112, 6.3): it ends at its
    /// head, and its connection carries the next request. It used to be read up to the end of
    /// the connection, which a server keeping the connection never sends: the request hung
    /// for [`READ_TIMEOUT`].
    #[test]
    fn an_answer_without_a_body_ends_at_its_head() {
        let (port, accepted) = keep_alive_server(vec![vec![
            Step::Answer("HTTP/1.1 204 No Content\r\n\r\n".into()),
            Step::Answer("HTTP/1.1 304 Not Modified\r\nContent-Length: 7\r\n\r\n".into()),
            Step::Answer(chunked_stream()),
        ]]);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let pool = pool(port);
            let errors: Vec<String> = (0..2)
                .map(|_| {
                    one_request(&pool, "/v1/completions", None, "{}", 3)
                        .unwrap()
                        .error
                })
                .collect();
            completes(&pool);
            let _ = tx.send((errors, pool.opened()));
        });
        let (errors, opened) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the requests ended within 10 s");
        assert_eq!(errors, ["HTTP 204: ", "HTTP 304: "]);
        assert_eq!((accepted.load(Ordering::SeqCst), opened), (1, 1));
    }
}
