//! HTTPS: rustls on the ring provider, with a certificate that can be replaced while serving.
//!
//! [`certified_key`] parses a PEM certificate chain and private key (PKCS#8, PKCS#1 or SEC1)
//! and checks that the key is the first certificate's. [`CertificateResolver`] hands every new
//! connection the certificate in force, behind a lock, so that [`CertificateResolver::replace`]
//! (the binary's SIGHUP) rotates it without a restart: handshakes under way keep the one they
//! started with. Protocols are rustls' safe defaults (TLS 1.3 and 1.2); ALPN offers
//! `http/1.1` only (actix-web adds it; HTTP/2 would need its `http2` feature).
//! [`report_expiry`] exports a certificate's `notAfter` ([`expiry`] reads it) and warns as it
//! nears.
//!
//! ```no_run
//! # fn f(cert_pem: &[u8], key_pem: &[u8]) -> Result<(), switchyard_api::tls::TlsError> {
//! use std::sync::Arc;
//! use switchyard_api::tls::{certified_key, CertificateResolver};
//! let resolver = Arc::new(CertificateResolver::new(certified_key(cert_pem, key_pem)?));
//! // Give `resolver` to `build_server_on`; later, on a rotation:
//! resolver.replace(certified_key(cert_pem, key_pem)?);
//! # Ok(()) }
//! ```

pub mod expiry;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::RwLock;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
pub use rustls::sign::CertifiedKey;

/// The most certificates read from a chain file (a leaf and its intermediates are a few).
pub const MAX_CHAIN_CERTIFICATES: usize = 16;

/// Why a certificate and key cannot be served. The messages never quote a file's content.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The certificate chain is missing or malformed.
    #[error("{0}")]
    Certificate(String),
    /// The private key is missing, malformed, or of a kind rustls cannot sign with.
    #[error("{0}")]
    Key(String),
    /// The private key is not the first certificate's.
    #[error(
        "the private key does not match the certificate (the first certificate of the chain \
         must be the key's)"
    )]
    KeyMismatch,
    /// rustls refused to build the server's configuration.
    #[error("cannot set up TLS: {0}")]
    Setup(String),
}

/// Why a PEM file could not be read, without its content.
fn pem_reason(e: &pem::Error) -> String {
    match e {
        pem::Error::MissingSectionEnd { .. } => "a PEM block has no END line".into(),
        pem::Error::IllegalSectionStart { .. } => "a PEM block's BEGIN line is malformed".into(),
        pem::Error::Base64Decode(_) => "a PEM block's body is not valid base64".into(),
        pem::Error::SectionTooLarge => "a PEM block is too large".into(),
        _ => "not a PEM file".into(),
    }
}

/// The ring provider: the one compiled in (aws-lc-rs, rustls' default, is not).
fn provider() -> rustls::crypto::CryptoProvider {
    rustls::crypto::ring::default_provider()
}

/// Parses `cert_pem` (the chain, leaf first) and `key_pem` (the leaf's private key) into what
/// a handshake serves, checking that the key is the first certificate's. PEM text around the
/// blocks is ignored, as are blocks of other kinds.
pub fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<CertifiedKey>, TlsError> {
    let mut chain = Vec::new();
    for cert in CertificateDer::pem_slice_iter(cert_pem) {
        let cert = cert.map_err(|e| TlsError::Certificate(pem_reason(&e)))?;
        if chain.len() == MAX_CHAIN_CERTIFICATES {
            return Err(TlsError::Certificate(format!(
                "more than {MAX_CHAIN_CERTIFICATES} certificates in the chain"
            )));
        }
        chain.push(cert);
    }
    if chain.is_empty() {
        return Err(TlsError::Certificate(
            "no certificate in it: expected PEM blocks `-----BEGIN CERTIFICATE-----` (a DER \
             file converts with `openssl x509 -inform der -in FILE -out FILE.pem`)"
                .into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| match e {
        pem::Error::NoItemsFound if contains(key_pem, b"ENCRYPTED PRIVATE KEY") => TlsError::Key(
            "the private key is encrypted: give it unencrypted (`openssl pkey -in FILE -out \
             FILE.key`), readable only by the server's user"
                .into(),
        ),
        pem::Error::NoItemsFound => TlsError::Key(
            "no private key in it: expected a PEM block `PRIVATE KEY` (PKCS#8), `RSA PRIVATE \
             KEY` (PKCS#1) or `EC PRIVATE KEY` (SEC1)"
                .into(),
        ),
        other => TlsError::Key(pem_reason(&other)),
    })?;
    let key = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| TlsError::Key(format!("not a private key rustls can sign with: {e}")))?;
    let certified = CertifiedKey::new(chain, key);
    match certified.keys_match() {
        Ok(()) => Ok(Arc::new(certified)),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            Err(TlsError::KeyMismatch)
        }
        Err(e) => Err(TlsError::Certificate(format!(
            "the first certificate cannot be read: {e}"
        ))),
    }
}

/// Whether `needle` occurs in `haystack`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Serves every handshake the certificate in force; [`CertificateResolver::replace`] swaps it.
pub struct CertificateResolver {
    /// The certificate new connections get.
    current: RwLock<Arc<CertifiedKey>>,
}

impl std::fmt::Debug for CertificateResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateResolver")
            .field("chain_len", &self.current.read().cert.len())
            .finish()
    }
}

impl CertificateResolver {
    /// A resolver serving `key`.
    pub fn new(key: Arc<CertifiedKey>) -> Self {
        Self {
            current: RwLock::new(key),
        }
    }

    /// Serves `key` to connections from now on. Returns whether its certificate chain differs
    /// from the one it replaces.
    pub fn replace(&self, key: Arc<CertifiedKey>) -> bool {
        let mut current = self.current.write();
        let changed = current.cert != key.cert;
        *current = key;
        changed
    }

    /// The certificate in force.
    pub fn current(&self) -> Arc<CertifiedKey> {
        Arc::clone(&self.current.read())
    }
}

impl ResolvesServerCert for CertificateResolver {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// The server's TLS configuration: the ring provider, rustls' safe default protocol versions,
/// no client certificates, certificates from `resolver`.
pub fn server_config(resolver: Arc<CertificateResolver>) -> Result<rustls::ServerConfig, TlsError> {
    Ok(
        rustls::ServerConfig::builder_with_provider(Arc::new(provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Setup(e.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(resolver),
    )
}

/// Exports the `notAfter` of `key`'s certificate (the chain's first) as
/// [`crate::metrics::TLS_CERTIFICATE_EXPIRY`] and logs a WARN when it expires within
/// [`expiry::EXPIRY_WARNING_DAYS`] days, an ERROR once it has expired (it is served all the
/// same: the operator decides). A `notAfter` that cannot be read (rustls accepted the
/// certificate, so hardly ever) is a WARN and sets the gauge to NaN, so no stale date stays.
/// Called when a certificate is loaded: at start and on each SIGHUP.
pub fn report_expiry(key: &CertifiedKey) -> Option<expiry::ExpiryState> {
    let gauge = metrics::gauge!(crate::metrics::TLS_CERTIFICATE_EXPIRY);
    let read = key
        .cert
        .first()
        .ok_or(expiry::ExpiryError::EMPTY_CHAIN)
        .and_then(|leaf| expiry::not_after(leaf));
    let not_after = match read {
        Ok(t) => t,
        Err(e) => {
            gauge.set(f64::NAN);
            tracing::warn!(error = %e, "TLS: the certificate's expiry is not known");
            return None;
        }
    };
    gauge.set(not_after as f64);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let state = expiry::expiry_state(not_after, now);
    let at = expiry::rfc3339(not_after);
    match state {
        expiry::ExpiryState::Valid => {}
        expiry::ExpiryState::ExpiresSoon(days) => tracing::warn!(
            not_after = %at,
            "TLS: the certificate expires in {days} day(s), at {at}: put a new one in \
             server.tls's files and send SIGHUP"
        ),
        expiry::ExpiryState::Expired(days) => tracing::error!(
            not_after = %at,
            "TLS: the certificate expired {days} day(s) ago, at {at}, and clients refuse it \
             (it is served all the same): put a new one in server.tls's files and send SIGHUP"
        ),
    }
    Some(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixture of `tests/fixtures/tls` (made by its `make.sh`).
    fn fixture(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/../tests/fixtures/tls/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    fn error(cert: &[u8], key: &[u8]) -> String {
        certified_key(cert, key)
            .expect_err("should be refused")
            .to_string()
    }

    #[test]
    fn pkcs8_sec1_and_pkcs1_keys_load_with_their_certificates() {
        for (cert, key) in [
            ("server.pem", "server.key"),
            ("server.pem", "server-sec1.key"),
            ("rotated.pem", "rotated.key"),
        ] {
            let k = certified_key(&fixture(cert), &fixture(key))
                .unwrap_or_else(|e| panic!("{cert} {key}: {e}"));
            assert_eq!(k.cert.len(), 1, "{cert}");
        }
        // A chain: the leaf then the CA (served as sent).
        let mut chain = fixture("server.pem");
        chain.extend(fixture("ca.pem"));
        let k = certified_key(&chain, &fixture("server.key")).unwrap();
        assert_eq!(k.cert.len(), 2);
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let e = certified_key(&fixture("server.pem"), &fixture("rotated.key"));
        assert!(matches!(e, Err(TlsError::KeyMismatch)), "{e:?}");
        let e = certified_key(&fixture("rotated.pem"), &fixture("server.key"));
        assert!(matches!(e, Err(TlsError::KeyMismatch)), "{e:?}");
        // The chain's first certificate is the one that must match.
        let mut chain = fixture("ca.pem");
        chain.extend(fixture("server.pem"));
        let e = certified_key(&chain, &fixture("server.key"));
        assert!(matches!(e, Err(TlsError::KeyMismatch)), "{e:?}");
    }

    #[test]
    fn missing_and_malformed_pem_is_named_without_its_content() {
        let cert = fixture("server.pem");
        let key = fixture("server.key");
        let e = error(b"", &key);
        assert!(e.starts_with("no certificate in it"), "{e}");
        // A key where the certificate should be: no certificate either.
        assert!(error(&key, &key).starts_with("no certificate in it"));
        let e = error(&cert, b"");
        assert!(e.starts_with("no private key in it"), "{e}");
        assert!(error(&cert, &cert).starts_with("no private key in it"));
        let encrypted =
            b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n";
        assert!(error(&cert, encrypted).contains("encrypted"));
        let text = String::from_utf8(key.clone()).unwrap();
        let cut = &text[..text.len() - 30];
        let e = error(&cert, cut.as_bytes());
        assert_eq!(e, "a PEM block has no END line");
        let body = text.lines().nth(1).unwrap();
        let bad = text.replace(body, "!!!!");
        let e = error(&cert, bad.as_bytes());
        assert_eq!(e, "a PEM block's body is not valid base64");
        assert!(!e.contains(body));
        // Valid PEM of garbage is no key rustls can use.
        let junk = b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
        assert!(error(&cert, junk).starts_with("not a private key rustls can sign with"));
        let many: Vec<u8> = (0..=MAX_CHAIN_CERTIFICATES)
            .flat_map(|_| cert.clone())
            .collect();
        assert!(error(&many, &key).starts_with("more than 16 certificates"));
    }

    #[test]
    fn the_resolver_serves_the_certificate_in_force() {
        let first = certified_key(&fixture("server.pem"), &fixture("server.key")).unwrap();
        let second = certified_key(&fixture("rotated.pem"), &fixture("rotated.key")).unwrap();
        let resolver = Arc::new(CertificateResolver::new(Arc::clone(&first)));
        assert!(server_config(Arc::clone(&resolver)).is_ok());
        assert!(!resolver.replace(Arc::clone(&first)), "the same chain");
        assert!(resolver.replace(Arc::clone(&second)));
        assert_eq!(resolver.current().cert, second.cert);
    }
}
