//! `server.tls`: the certificate chain and private key files `serve` speaks HTTPS with.
//!
//! This crate only reads the files (regular files, to [`MAX_TLS_FILE_BYTES`], `~` expanded);
//! the HTTP layer parses them (`switchyard_api::tls`). Paths are not secrets, the key's bytes
//! are: no error shows a file's content.

use serde::{Deserialize, Serialize};

use crate::file::{self, expand_home, ReadError};
use crate::Config;

/// The most bytes read from a certificate or key file (a chain of a few certificates is a few
/// KiB).
pub const MAX_TLS_FILE_BYTES: u64 = 1 << 20;

/// The longest path accepted in `server.tls`.
const MAX_PATH_BYTES: usize = 4096;

/// `server.tls`: HTTPS with these files; absent, the server speaks plain HTTP.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, expecting = "a mapping (the server.tls section)")]
pub struct TlsSection {
    /// The PEM certificate chain: the server's certificate first, then the intermediates.
    /// `~` expands to the home directory. Read again on SIGHUP.
    pub cert_file: String,
    /// The PEM private key of the first certificate (PKCS#8 `PRIVATE KEY`, PKCS#1
    /// `RSA PRIVATE KEY` or SEC1 `EC PRIVATE KEY`). `~` expands. Read again on SIGHUP.
    pub key_file: String,
}

/// The bytes of `server.tls`'s two files, as read (PEM text, not yet parsed).
pub struct TlsFiles {
    /// The certificate chain file's content.
    pub cert_pem: Vec<u8>,
    /// The private key file's content (a secret: never logged).
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsFiles")
            .field("cert_pem", &format_args!("{} bytes", self.cert_pem.len()))
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

impl TlsSection {
    /// The section's own rules (run by [`Config::validate`]): both paths set and of sane
    /// length. Returns the field at fault and why.
    pub(crate) fn check(&self) -> Result<(), (String, String)> {
        for (field, path) in [("cert_file", &self.cert_file), ("key_file", &self.key_file)] {
            if path.trim().is_empty() || path.len() > MAX_PATH_BYTES {
                return Err((
                    format!("server.tls.{field}"),
                    format!("a path of 1-{MAX_PATH_BYTES} bytes is required"),
                ));
            }
        }
        Ok(())
    }
}

impl Config {
    /// The content of `server.tls`'s files, read now (`None` without the section). An error
    /// names the field (`server.tls.cert_file`, `server.tls.key_file`), the path and why:
    /// missing, unreadable, not a regular file, larger than [`MAX_TLS_FILE_BYTES`].
    pub fn read_tls_files(&self) -> Result<Option<TlsFiles>, (String, String)> {
        let Some(tls) = &self.server.tls else {
            return Ok(None);
        };
        let read = |field: &str, name: &str| {
            let path = expand_home(name);
            file::read_bytes(&path, MAX_TLS_FILE_BYTES).map_err(|e| {
                let why = match e {
                    ReadError::Io(e) => format!("cannot read it: {e}"),
                    ReadError::Invalid(m) => m,
                };
                (
                    format!("server.tls.{field}"),
                    format!("`{}`{}: {why}", path.display(), file::relative_note(&path)),
                )
            })
        };
        Ok(Some(TlsFiles {
            cert_pem: read("cert_file", &tls.cert_file)?,
            key_pem: read("key_file", &tls.key_file)?,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(yaml: &str) -> Result<Config, String> {
        Config::from_yaml_str(yaml, "t.yaml").map_err(|e| e.to_string())
    }

    #[test]
    fn the_section_needs_both_files_and_nothing_else() {
        let e = config("server:\n  tls:\n    cert_file: /c.pem\n").unwrap_err();
        assert!(e.contains("missing field `key_file`"), "{e}");
        let e =
            config("server:\n  tls: { cert_file: /c.pem, key_file: /k.pem, ca: x }\n").unwrap_err();
        assert!(e.contains("unknown field `ca`"), "{e}");
        let e = config("server:\n  tls:\n    cert_file: /c.pem\n    key_file: ''\n").unwrap_err();
        assert!(e.starts_with("t.yaml:4: server.tls.key_file"), "{e}");
        let long = "a".repeat(5000);
        let e = config(&format!(
            "server:\n  tls:\n    cert_file: {long}\n    key_file: /k\n"
        ))
        .unwrap_err();
        assert!(e.starts_with("t.yaml:3: server.tls.cert_file"), "{e}");
        let c = config("server: { port: 1 }\n").unwrap();
        assert_eq!(c.server.tls, None);
        assert!(c.read_tls_files().unwrap().is_none());
    }

    #[test]
    fn files_are_read_to_a_bound_and_errors_name_the_field_and_path() {
        let dir = crate::scratch::ScratchDir::new("tls-read");
        let cert = dir.join("c.pem");
        std::fs::write(&cert, b"cert bytes").unwrap();
        let key = dir.join("k.pem");
        std::fs::write(&key, b"key bytes").unwrap();
        let with = |c: &std::path::Path, k: &std::path::Path| {
            config(&format!(
                "server:\n  tls:\n    cert_file: {}\n    key_file: {}\n",
                c.display(),
                k.display()
            ))
            .unwrap()
            .read_tls_files()
        };
        let files = with(&cert, &key).unwrap().unwrap();
        assert_eq!(files.cert_pem, b"cert bytes");
        assert_eq!(files.key_pem, b"key bytes");
        assert!(!format!("{files:?}").contains("key bytes"));
        let (field, why) = with(&cert, &dir.join("missing.pem")).unwrap_err();
        assert_eq!(field, "server.tls.key_file");
        assert!(
            why.contains("missing.pem") && why.contains("cannot read"),
            "{why}"
        );
        let (field, why) = with(&dir, &key).unwrap_err();
        assert_eq!(field, "server.tls.cert_file");
        assert!(why.contains("not a regular file"), "{why}");
        std::fs::write(&cert, vec![b'a'; MAX_TLS_FILE_BYTES as usize + 1]).unwrap();
        let (field, why) = with(&cert, &key).unwrap_err();
        assert_eq!(field, "server.tls.cert_file");
        assert!(why.contains("too large"), "{why}");
    }
}
