//! A certificate's expiry (X.509 `notAfter`, RFC 5280 4.1.2.5), read from its DER by a minimal
//! walk: Certificate → TBSCertificate → (version, serialNumber, signature, issuer) skipped →
//! Validity → notAfter, a UTCTime (`YYMMDDHHMMSSZ`, years 1950-2049) or a GeneralizedTime
//! (`YYYYMMDDHHMMSSZ`). Nothing else of the certificate is parsed (rustls and webpki do that;
//! neither makes the validity public, and no X.509 parser is among the dependencies).
//!
//! Every length is checked against the bytes there before it is used, tags are single-byte,
//! lengths at most 4 bytes long: any input, however crafted or cut, gives a value or an
//! [`ExpiryError`], never a panic (a property test feeds it random and truncated bytes), in
//! time linear in the five headers it reads.

/// Why a certificate's `notAfter` cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot read the certificate's expiry: {0}")]
pub struct ExpiryError(&'static str);

impl ExpiryError {
    /// A certificate chain without a certificate.
    pub(crate) const EMPTY_CHAIN: Self = Self("no certificate");
}

/// Seconds in a day.
const DAY_S: i64 = 86_400;

/// One DER element: its tag, its content, and the bytes after it.
struct Element<'a> {
    tag: u8,
    content: &'a [u8],
    rest: &'a [u8],
}

/// The DER element at the start of `bytes`.
fn element(bytes: &[u8]) -> Result<Element<'_>, ExpiryError> {
    let (&tag, after_tag) = bytes.split_first().ok_or(ExpiryError("truncated"))?;
    if tag & 0x1f == 0x1f {
        return Err(ExpiryError("a multi-byte tag"));
    }
    let (&first, after_length) = after_tag.split_first().ok_or(ExpiryError("truncated"))?;
    let (length, body) = if first < 0x80 {
        (usize::from(first), after_length)
    } else {
        // Long form: the low bits count the length's bytes (0: indefinite, not DER).
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 {
            return Err(ExpiryError("a length that is not DER"));
        }
        if after_length.len() < count {
            return Err(ExpiryError("truncated"));
        }
        let (digits, body) = after_length.split_at(count);
        let length = digits
            .iter()
            .fold(0usize, |n, &d| (n << 8) | usize::from(d));
        (length, body)
    };
    if length > body.len() {
        return Err(ExpiryError("truncated"));
    }
    let (content, rest) = body.split_at(length);
    Ok(Element { tag, content, rest })
}

/// The element at the start of `bytes`, which must have tag `tag`.
fn expect<'a>(bytes: &'a [u8], tag: u8, what: &'static str) -> Result<Element<'a>, ExpiryError> {
    let e = element(bytes)?;
    if e.tag == tag {
        Ok(e)
    } else {
        Err(ExpiryError(what))
    }
}

const SEQUENCE: u8 = 0x30;
const INTEGER: u8 = 0x02;
const VERSION: u8 = 0xa0;
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;

/// The `notAfter` of the DER certificate `der`, in seconds since the Unix epoch.
pub fn not_after(der: &[u8]) -> Result<i64, ExpiryError> {
    let certificate = expect(der, SEQUENCE, "not a certificate (no SEQUENCE)")?;
    let tbs = expect(certificate.content, SEQUENCE, "no TBSCertificate")?;
    let mut fields = tbs.content;
    if fields.first() == Some(&VERSION) {
        fields = element(fields)?.rest;
    }
    fields = expect(fields, INTEGER, "no serial number")?.rest;
    fields = expect(fields, SEQUENCE, "no signature algorithm")?.rest;
    fields = expect(fields, SEQUENCE, "no issuer")?.rest;
    let validity = expect(fields, SEQUENCE, "no validity")?;
    let not_before = element(validity.content)?;
    let not_after = element(not_before.rest)?;
    time(not_after.tag, not_after.content)
}

/// A UTCTime or GeneralizedTime of RFC 5280's form (UTC, `Z`, seconds, no fraction), in
/// seconds since the Unix epoch.
fn time(tag: u8, text: &[u8]) -> Result<i64, ExpiryError> {
    let (year, rest) = match (tag, text.len()) {
        (UTC_TIME, 13) => {
            let yy = digits(&text[..2])?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &text[2..])
        }
        (GENERALIZED_TIME, 15) => (digits(&text[..4])?, &text[4..]),
        (UTC_TIME | GENERALIZED_TIME, _) => {
            return Err(ExpiryError("a time not of the form ...HHMMSSZ"))
        }
        _ => return Err(ExpiryError("notAfter is not a time")),
    };
    if rest[10] != b'Z' {
        return Err(ExpiryError("a time not in UTC (Z)"));
    }
    let [month, day, hour, minute, second] = [0, 2, 4, 6, 8].map(|i| digits(&rest[i..i + 2]));
    let (month, day) = (month?, day?);
    let (hour, minute, second) = (hour?, minute?, second?);
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 59
    {
        return Err(ExpiryError("a date or time out of range"));
    }
    Ok(days_from_civil(year, month, day) * DAY_S + hour * 3600 + minute * 60 + second)
}

/// The decimal number `text` (ASCII digits only).
fn digits(text: &[u8]) -> Result<i64, ExpiryError> {
    text.iter().try_fold(0i64, |n, &c| {
        if c.is_ascii_digit() {
            Ok(n * 10 + i64::from(c - b'0'))
        } else {
            Err(ExpiryError("a time with a character that is not a digit"))
        }
    })
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to the proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of `days` since 1970-01-01 (Hinnant's `civil_from_days`): year, month, day.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// `unix_s` as RFC 3339 UTC (`2026-12-04T20:33:40Z`).
pub fn rfc3339(unix_s: i64) -> String {
    let (year, month, day) = civil_from_days(unix_s.div_euclid(DAY_S));
    let s = unix_s.rem_euclid(DAY_S);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        s / 3600,
        s / 60 % 60,
        s % 60
    )
}

/// How soon a certificate expires, as the server reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpiryState {
    /// More than [`EXPIRY_WARNING_DAYS`] days left.
    Valid,
    /// Expires within [`EXPIRY_WARNING_DAYS`] days: this many whole days left.
    ExpiresSoon(i64),
    /// Expired this many whole days ago (0: within the last day).
    Expired(i64),
}

/// Days before its expiry from which a certificate is warned about.
pub const EXPIRY_WARNING_DAYS: i64 = 14;

/// The state of a certificate whose `notAfter` is `not_after`, at `now` (both Unix seconds).
/// RFC 5280's validity includes `notAfter` itself: expired once `now` is past it.
pub fn expiry_state(not_after: i64, now: i64) -> ExpiryState {
    let left = not_after.saturating_sub(now);
    if left < 0 {
        ExpiryState::Expired(left.saturating_neg() / DAY_S)
    } else if left <= EXPIRY_WARNING_DAYS * DAY_S {
        ExpiryState::ExpiresSoon(left / DAY_S)
    } else {
        ExpiryState::Valid
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;

    /// The DER of a fixture of `tests/fixtures/tls` (see its `make.sh`).
    fn der(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/../tests/fixtures/tls/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        CertificateDer::from_pem_file(&path)
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .to_vec()
    }

    /// The fixtures' `notAfter`, as `openssl x509 -enddate -noout -in FILE` prints them.
    #[test]
    fn the_fixtures_expiry_is_read_from_generalized_and_utc_times() {
        // notAfter=Nov 10 20:38:17 2126 GMT (GeneralizedTime: after 2049).
        for name in ["server.pem", "rotated.pem", "ca.pem"] {
            let t = not_after(&der(name)).unwrap();
            assert_eq!(rfc3339(t), "2126-11-10T20:38:17Z", "{name}");
        }
        // notAfter=Jan  1 00:00:00 2001 GMT (UTCTime).
        assert_eq!(not_after(&der("expired.pem")), Ok(978_307_200));
    }

    /// A certificate with this validity, of the shape `not_after` walks (no signature).
    fn certificate(validity: &[u8]) -> Vec<u8> {
        fn tlv(tag: u8, content: &[u8]) -> Vec<u8> {
            let mut v = vec![tag];
            if content.len() < 0x80 {
                v.push(content.len() as u8);
            } else {
                v.extend([0x82, (content.len() >> 8) as u8, content.len() as u8]);
            }
            v.extend_from_slice(content);
            v
        }
        let mut tbs = tlv(VERSION, &tlv(INTEGER, &[2]));
        tbs.extend(tlv(INTEGER, &[1, 2, 3]));
        tbs.extend(tlv(SEQUENCE, &[0x06, 0x01, 0x2a]));
        tbs.extend(tlv(SEQUENCE, &[0; 200]));
        tbs.extend(tlv(SEQUENCE, validity));
        tlv(SEQUENCE, &tlv(SEQUENCE, &tbs))
    }

    fn times(not_before: (u8, &str), not_after: (u8, &str)) -> Vec<u8> {
        let mut v = vec![not_before.0, not_before.1.len() as u8];
        v.extend_from_slice(not_before.1.as_bytes());
        v.extend([not_after.0, not_after.1.len() as u8]);
        v.extend_from_slice(not_after.1.as_bytes());
        certificate(&v)
    }

    #[test]
    fn times_are_read_as_rfc_5280_writes_them() {
        let at = |t: (u8, &str)| not_after(&times((UTC_TIME, "000101000000Z"), t));
        assert_eq!(at((UTC_TIME, "491231235959Z")), Ok(2_524_607_999));
        assert_eq!(at((UTC_TIME, "500101000000Z")), Ok(-631_152_000));
        assert_eq!(at((UTC_TIME, "700101000000Z")), Ok(0));
        assert_eq!(at((GENERALIZED_TIME, "20240229120000Z")), Ok(1_709_208_000));
        assert_eq!(
            at((GENERALIZED_TIME, "99991231235959Z")),
            Ok(253_402_300_799)
        );
        for bad in [
            (UTC_TIME, "0001010000Z"),
            (UTC_TIME, "000101000000+"),
            (UTC_TIME, "001301000000Z"),
            (UTC_TIME, "000100000000Z"),
            (UTC_TIME, "230229000000Z"),
            (UTC_TIME, "000101240000Z"),
            (UTC_TIME, "000101006000Z"),
            (UTC_TIME, "000101000060Z"),
            (UTC_TIME, "0001010000-1Z"),
            (GENERALIZED_TIME, "000101000000Z"),
            (GENERALIZED_TIME, "20240229120000.5Z"),
            (INTEGER, "20240229120000Z"),
        ] {
            assert!(at(bad).is_err(), "{bad:?}");
        }
        assert_eq!(rfc3339(1_709_208_000), "2024-02-29T12:00:00Z");
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn expiry_states_warn_from_14_days_and_count_whole_days() {
        let now = 1_000_000_000;
        assert_eq!(expiry_state(now + 15 * DAY_S, now), ExpiryState::Valid);
        assert_eq!(expiry_state(now + 14 * DAY_S + 1, now), ExpiryState::Valid);
        assert_eq!(
            expiry_state(now + 14 * DAY_S, now),
            ExpiryState::ExpiresSoon(14)
        );
        assert_eq!(
            expiry_state(now + DAY_S - 1, now),
            ExpiryState::ExpiresSoon(0)
        );
        assert_eq!(expiry_state(now, now), ExpiryState::ExpiresSoon(0));
        assert_eq!(expiry_state(now - 1, now), ExpiryState::Expired(0));
        assert_eq!(expiry_state(now - 3 * DAY_S, now), ExpiryState::Expired(3));
        assert_eq!(
            expiry_state(i64::MIN, i64::MAX),
            ExpiryState::Expired(i64::MAX / DAY_S)
        );
    }

    #[test]
    fn malformed_lengths_and_tags_are_errors() {
        for bad in [
            &[][..],
            &[0x30],
            &[0x30, 0x80, 0x00, 0x00],
            &[0x30, 0x85, 1, 1, 1, 1, 1],
            &[0x30, 0x84, 0xff, 0xff, 0xff, 0xff],
            &[0x3f, 0x01, 0x00],
            &[0x30, 0x02, 0x30, 0x00],
            &[0x31, 0x00],
        ] {
            assert!(not_after(bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn random_bytes_give_an_error_or_a_time_never_a_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..600)
        ) {
            let _ = not_after(&bytes);
        }

        /// Every cut of a real certificate is an error (its outer length outruns it), and
        /// a changed byte never panics.
        #[test]
        fn cut_or_changed_certificates_never_panic(
            cut in 0usize..2000, at in 0usize..2000, byte in any::<u8>()
        ) {
            for name in ["server.pem", "rotated.pem", "expired.pem"] {
                let der = der(name);
                let cut = cut % der.len();
                prop_assert!(not_after(&der[..cut]).is_err());
                let mut changed = der.clone();
                changed[at % der.len()] = byte;
                let _ = not_after(&changed);
            }
        }
    }
}
