//! `server.cors`: which browser origins may call the API (Cross-Origin Resource Sharing), as
//! vLLM's `--allowed-origins`, `--allowed-methods`, `--allowed-headers` and
//! `--allow-credentials`.
//!
//! Without the section the server sends no CORS headers, so browsers refuse cross-origin calls
//! (the safe default). Every list and string is bounded, and each entry is checked here to be
//! what browsers send (an origin is compared byte for byte with the `Origin` header), so the
//! HTTP layer can build its middleware from the section without failing.

use serde::{Deserialize, Serialize};

/// The most entries in each of the section's lists.
pub const MAX_CORS_ENTRIES: usize = 64;
/// The longest origin, method or header name accepted.
pub const MAX_CORS_ENTRY_BYTES: usize = 256;
/// The longest `max_age_s` (a day; browsers cap it lower: Chromium at 2 hours).
pub const MAX_CORS_MAX_AGE_S: u64 = 86_400;

/// The methods `allowed_methods` may name (besides `*`).
const METHODS: &[&str] = &["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];

/// `server.cors`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a mapping (the server.cors section)"
)]
pub struct CorsSection {
    /// Origins allowed to call (`https://app.example.com`, as browsers send them: scheme,
    /// host and port, no path), or `["*"]` for any.
    pub allowed_origins: Vec<String>,
    /// Methods a cross-origin request may use, or `["*"]` for any.
    pub allowed_methods: Vec<String>,
    /// Request headers a cross-origin request may send, or `["*"]` for any (the default).
    pub allowed_headers: Vec<String>,
    /// Let browsers send cookies and HTTP authentication (`Access-Control-Allow-Credentials`);
    /// refused with `allowed_origins: ["*"]`, as the CORS standard forbids it. The API key in
    /// `Authorization` does not need it.
    pub allow_credentials: bool,
    /// Seconds a browser may cache a preflight's answer.
    #[serde(deserialize_with = "crate::schema::int_in::<_, 0, MAX_CORS_MAX_AGE_S>")]
    pub max_age_s: u64,
}

impl Default for CorsSection {
    fn default() -> Self {
        Self {
            allowed_origins: Vec::new(),
            allowed_methods: ["GET", "POST", "PUT", "DELETE", "OPTIONS"]
                .map(String::from)
                .to_vec(),
            // Any, as vLLM's default: the OpenAI SDKs send headers of their own
            // (`x-stainless-os`, `x-stainless-retry-count`, ...; new ones with new versions),
            // which a fixed list refuses in the browser's preflight. Which origins may call
            // is what guards the API (and its key); the headers grant nothing.
            allowed_headers: vec!["*".to_owned()],
            allow_credentials: false,
            max_age_s: 600,
        }
    }
}

/// Whether `list` is `["*"]`, the wildcard.
pub(crate) fn is_wildcard(list: &[String]) -> bool {
    matches!(list, [only] if only == "*")
}

/// A token of RFC 9110 (a header name).
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Why `origin` is not an origin as browsers send it in `Origin`: `scheme://host[:port]`,
/// lower case, no path (a trailing `/` would never match).
fn origin_error(origin: &str) -> Option<String> {
    let Some((scheme, rest)) = origin.split_once("://") else {
        return Some(format!(
            "`{origin}` is not an origin: write scheme://host[:port], such as \
             https://app.example.com"
        ));
    };
    let scheme_ok = scheme.starts_with(|c: char| c.is_ascii_lowercase())
        && scheme
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.".contains(&b));
    let host_ok = !rest.is_empty()
        && rest
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.:[]_".contains(&b));
    if rest.contains('/') {
        return Some(format!(
            "`{origin}` has a path: browsers send an origin without one (no trailing `/`)"
        ));
    }
    (!scheme_ok || !host_ok).then(|| {
        format!(
            "`{origin}` is not an origin as browsers send it: scheme://host[:port] in lower \
             case ASCII (an international domain in its xn-- form)"
        )
    })
}

impl CorsSection {
    /// The section's rules (run by [`crate::Config::validate`]): bounded lists and entries,
    /// each an origin, method or header name as browsers send it, `*` only alone, at least
    /// one origin, and no credentials with any origin. Returns the field at fault and why.
    pub(crate) fn check(&self) -> Result<(), (String, String)> {
        let at = |field: &str| format!("server.cors.{field}");
        let lists = [
            ("allowed_origins", &self.allowed_origins),
            ("allowed_methods", &self.allowed_methods),
            ("allowed_headers", &self.allowed_headers),
        ];
        for (field, list) in lists {
            if list.len() > MAX_CORS_ENTRIES {
                return Err((
                    at(field),
                    format!("at most {MAX_CORS_ENTRIES} entries are allowed"),
                ));
            }
            for (i, entry) in list.iter().enumerate() {
                let at = || format!("server.cors.{field}[{i}]");
                if entry.is_empty() || entry.len() > MAX_CORS_ENTRY_BYTES {
                    return Err((at(), format!("entries are 1-{MAX_CORS_ENTRY_BYTES} bytes")));
                }
                if entry == "*" {
                    if list.len() > 1 {
                        return Err((
                            at(),
                            "`*` allows any: it must be the list's only entry".into(),
                        ));
                    }
                    continue;
                }
                let why = match field {
                    "allowed_origins" => origin_error(entry),
                    "allowed_methods" => (!METHODS.contains(&entry.as_str())).then(|| {
                        format!(
                            "`{entry}` is not one of {} (methods are upper case) or `*`",
                            METHODS.join(", ")
                        )
                    }),
                    _ => (!is_token(entry)).then(|| format!("`{entry}` is not a header name")),
                };
                if let Some(why) = why {
                    return Err((at(), why));
                }
            }
        }
        if self.allowed_origins.is_empty() {
            return Err((
                at("allowed_origins"),
                "no origin is listed, so no browser could call: list origins \
                 (https://app.example.com) or `*` for any, or remove server.cors"
                    .into(),
            ));
        }
        if self.allow_credentials && is_wildcard(&self.allowed_origins) {
            return Err((
                at("allow_credentials"),
                "true with allowed_origins `*`: the CORS standard forbids credentials for any \
                 origin; list the origins that may send them"
                    .into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::Config;

    /// The error of a configuration with `cors` as the `server.cors` section (one line of flow
    /// or block lines indented four spaces).
    fn error(cors: &str) -> String {
        Config::from_yaml_str(&format!("server:\n  cors:\n{cors}"), "t.yaml")
            .expect_err("should be refused")
            .to_string()
    }

    #[test]
    fn defaults_and_wildcards_are_accepted() {
        let c = Config::from_yaml_str(
            "server:\n  cors:\n    allowed_origins: [https://app.example.com, 'http://localhost:3000']\n",
            "t.yaml",
        )
        .unwrap();
        let cors = c.server.cors.expect("the section");
        assert_eq!(
            cors.allowed_methods,
            ["GET", "POST", "PUT", "DELETE", "OPTIONS"]
        );
        assert!(super::is_wildcard(&cors.allowed_headers));
        assert_eq!(cors.max_age_s, 600);
        assert!(!cors.allow_credentials);
        let c = Config::from_yaml_str(
            "server:\n  cors: { allowed_origins: ['*'], allowed_methods: ['*'], allowed_headers: ['*'] }\n",
            "t.yaml",
        )
        .unwrap();
        assert!(super::is_wildcard(&c.server.cors.unwrap().allowed_headers));
        assert_eq!(Config::default().server.cors, None);
    }

    #[test]
    fn credentials_with_any_origin_are_refused() {
        let e = error("    allowed_origins: ['*']\n    allow_credentials: true\n");
        assert!(
            e.starts_with("t.yaml:4: server.cors.allow_credentials"),
            "{e}"
        );
        assert!(e.contains("forbids"), "{e}");
        // With listed origins they are fine.
        Config::from_yaml_str(
            "server:\n  cors: { allowed_origins: ['https://a.example'], allow_credentials: true }\n",
            "t",
        )
        .unwrap();
    }

    #[test]
    fn entries_that_browsers_would_never_send_are_refused() {
        let cases = [
            (
                "    allowed_origins: []\n",
                "server.cors.allowed_origins",
                "no origin",
            ),
            (
                "    allowed_origins: ['https://a.example/']\n",
                "server.cors.allowed_origins[0]",
                "has a path",
            ),
            (
                "    allowed_origins: ['https://a.example', 'HTTPS://B.example']\n",
                "server.cors.allowed_origins[1]",
                "lower case",
            ),
            (
                "    allowed_origins: [a.example]\n",
                "server.cors.allowed_origins[0]",
                "not an origin",
            ),
            (
                "    allowed_origins: ['*', 'https://a.example']\n",
                "server.cors.allowed_origins[0]",
                "only entry",
            ),
            (
                "    allowed_origins: ['*']\n    allowed_methods: [get]\n",
                "server.cors.allowed_methods[0]",
                "upper case",
            ),
            (
                "    allowed_origins: ['*']\n    allowed_headers: ['x y']\n",
                "server.cors.allowed_headers[0]",
                "not a header name",
            ),
            (
                "    allowed_origins: ['*']\n    allowed_headers: ['']\n",
                "server.cors.allowed_headers[0]",
                "1-256 bytes",
            ),
        ];
        for (yaml, field, why) in cases {
            let e = error(yaml);
            assert!(
                e.contains(&format!("{field}: ")) && e.contains(why),
                "{yaml}: {e}"
            );
        }
        let many: Vec<String> = (0..65).map(|i| format!("'https://h{i}.example'")).collect();
        let e = error(&format!("    allowed_origins: [{}]\n", many.join(", ")));
        assert!(e.contains("server.cors.allowed_origins: at most 64"), "{e}");
        let long = format!("https://{}.example", "a".repeat(300));
        let e = error(&format!("    allowed_origins: ['{long}']\n"));
        assert!(e.contains("1-256 bytes"), "{e}");
        let e = error("    allowed_origins: ['*']\n    max_age_s: 86401\n");
        assert!(
            e.starts_with("t.yaml:4: server.cors.max_age_s: 86401 is out of range"),
            "{e}"
        );
    }
}
