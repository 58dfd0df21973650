//! Azure LLM inference trace CSV (Patel et al., "Splitwise", ISCA'24; the
//! `Azure/AzurePublicDataset` files): `TIMESTAMP` (wall clock,
//! `YYYY-MM-DD HH:MM:SS.fffffff`), `ContextTokens`, `GeneratedTokens`.
//! Timestamps become seconds relative to the first row; prompts are unique per
//! request (the trace carries no content, so no prefix reuse is invented).

use super::{
    add_total, check_output_len, check_prompt_len, for_each_line, unique_prompt, LoadOptions, Row,
    TraceRequest,
};
use crate::error::SimError;
use std::io::BufRead;
use std::path::Path;

const COLUMNS: [&str; 3] = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"];

/// Loads an Azure LLM inference CSV. Rows must be sorted by time.
pub fn load_azure(
    reader: impl BufRead,
    path: &Path,
    options: &LoadOptions,
) -> Result<Vec<TraceRequest>, SimError> {
    let mut out = Vec::new();
    let mut cols: Option<[usize; 3]> = None;
    let mut first: Option<f64> = None;
    let mut prev = f64::NEG_INFINITY;
    let mut total = 0usize;
    for_each_line(reader, path, |line, text| {
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        let Some(idx) = cols else {
            cols = Some(header_indices(&fields, path, line)?);
            return Ok(true);
        };
        let get = |i: usize| -> Result<&str, SimError> {
            fields
                .get(idx[i])
                .copied()
                .ok_or_else(|| SimError::trace(path, line, COLUMNS[i], "missing column"))
        };
        let abs = parse_timestamp(get(0)?).ok_or_else(|| {
            SimError::trace(
                path,
                line,
                COLUMNS[0],
                format!("bad timestamp `{}`", get(0).unwrap_or("")),
            )
        })?;
        if abs < prev {
            return Err(SimError::trace(
                path,
                line,
                COLUMNS[0],
                "timestamps are not sorted",
            ));
        }
        prev = abs;
        let t0 = *first.get_or_insert(abs);
        let arrival_s = abs - t0;
        let prompt_len = parse_u64(get(1)?, path, line, COLUMNS[1])?;
        let prompt_len = check_prompt_len(path, line, COLUMNS[1], prompt_len)?;
        let output_len = parse_u64(get(2)?, path, line, COLUMNS[2])?;
        let output_len = check_output_len(path, line, COLUMNS[2], output_len)?;
        match options.row(arrival_s, out.len()) {
            Row::Keep => {}
            Row::Skip => return Ok(true),
            Row::Stop => return Ok(false),
        }
        add_total(&mut total, prompt_len, path, line)?;
        out.push(TraceRequest::untagged(
            arrival_s,
            unique_prompt(out.len() as u64, prompt_len),
            output_len,
        ));
        Ok(!options.full(out.len()))
    })?;
    if cols.is_none() {
        return Err(SimError::trace(
            path,
            1,
            "<header>",
            "empty file, expected a CSV header",
        ));
    }
    Ok(out)
}

fn header_indices(fields: &[&str], path: &Path, line: usize) -> Result<[usize; 3], SimError> {
    let mut idx = [0usize; 3];
    for (slot, name) in idx.iter_mut().zip(COLUMNS) {
        *slot = fields
            .iter()
            .position(|f| *f == name)
            .ok_or_else(|| super::missing_column(path, line, fields, name, "azure"))?;
    }
    Ok(idx)
}

pub(crate) fn parse_u64(s: &str, path: &Path, line: usize, field: &str) -> Result<u64, SimError> {
    s.parse::<u64>().map_err(|_| {
        SimError::trace(
            path,
            line,
            field,
            format!("`{s}` is not a non-negative integer"),
        )
    })
}

/// Parses `YYYY-MM-DD HH:MM:SS[.fraction]` into seconds since 1970-01-01 (UTC assumed), and
/// ISO 8601 / RFC 3339 likewise: a `T` between date and time, and a `Z` or a `+HH:MM` /
/// `-HH:MM` (or `+HHMM`) offset after it (`2023-11-16T18:17:03.25Z`); `None` for anything else.
pub fn parse_timestamp(s: &str) -> Option<f64> {
    let (date, time) = s.split_once([' ', 'T'])?;
    let (time, offset_s) = split_offset(time)?;
    let mut d = date.splitn(3, '-');
    let y: i64 = d.next()?.parse().ok()?;
    let m: u32 = d.next()?.parse().ok()?;
    let day: u32 = d.next()?.parse().ok()?;
    let mut t = time.splitn(3, ':');
    let hh: u32 = t.next()?.parse().ok()?;
    let mm: u32 = t.next()?.parse().ok()?;
    let ss: f64 = t.next()?.parse().ok()?;
    let valid = (1..=12).contains(&m)
        && (1..=31).contains(&day)
        && hh < 24
        && mm < 60
        && (0.0..61.0).contains(&ss)
        && (1..=9999).contains(&y);
    if !valid {
        return None;
    }
    let days = days_from_civil(y, m, day);
    Some(days as f64 * 86_400.0 + f64::from(hh * 3600 + mm * 60) + ss - offset_s)
}

/// Splits a time of day from its UTC designator or offset: the time and the offset in seconds
/// (local time minus UTC); `None` for a malformed offset.
fn split_offset(time: &str) -> Option<(&str, f64)> {
    if let Some(t) = time.strip_suffix(['Z', 'z']) {
        return Some((t, 0.0));
    }
    let Some(at) = time.find(['+', '-']) else {
        return Some((time, 0.0));
    };
    let (t, off) = time.split_at(at);
    let sign = if off.starts_with('-') { -1.0 } else { 1.0 };
    let digits = &off[1..];
    let (h, m) = match digits.split_once(':') {
        Some(hm) => hm,
        None if digits.len() == 4 => digits.split_at(2),
        None if digits.len() == 2 => (digits, "00"),
        None => return None,
    };
    let all_digits = |x: &str| x.len() == 2 && x.bytes().all(|b| b.is_ascii_digit());
    if !(all_digits(h) && all_digits(m)) {
        return None;
    }
    let (h, m): (u32, u32) = (h.parse().ok()?, m.parse().ok()?);
    if h > 23 || m > 59 {
        return None;
    }
    Some((t, sign * f64::from(h * 3600 + m * 60)))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's
/// `days_from_civil` algorithm, "chrono-Compatible Low-Level Date Algorithms").
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str, options: &LoadOptions) -> Result<Vec<TraceRequest>, SimError> {
        load_azure(text.as_bytes(), Path::new("azure.csv"), options)
    }

    #[test]
    fn days_from_civil_matches_known_dates() {
        // Unix epoch, and 2023-11-16 = 19677 days (1700092800 s / 86400, from `date -d`).
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2023, 11, 16), 19_677);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
    }

    #[test]
    fn iso_8601_timestamps_parse_as_the_azure_ones() {
        let azure = parse_timestamp("2023-11-16 18:17:03").unwrap();
        assert_eq!(parse_timestamp("2023-11-16T18:17:03Z"), Some(azure));
        assert_eq!(
            parse_timestamp("2023-11-16T18:17:03.25Z"),
            Some(azure + 0.25)
        );
        assert_eq!(parse_timestamp("2023-11-16T19:17:03+01:00"), Some(azure));
        assert_eq!(parse_timestamp("2023-11-16T13:17:03-0500"), Some(azure));
        let fraction = parse_timestamp("2023-11-16T18:17:03.9799600Z").unwrap() - azure;
        assert!((fraction - 0.97996).abs() < 1e-6, "{fraction}");
        for bad in [
            "2023-11-16T18:17:03+1:00",
            "2023-11-16T18:17:03+25:00",
            "2023-11-16T18:17:03ZZ",
        ] {
            assert_eq!(parse_timestamp(bad), None, "{bad}");
        }
        let text = "\u{feff}TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16T18:17:03Z,100,10\n2023-11-16T18:17:04.5Z,100,10\n";
        let rs = load(text, &LoadOptions::default()).unwrap();
        let times: Vec<f64> = rs.iter().map(|r| r.arrival_s).collect();
        assert_eq!(times, vec![0.0, 1.5]);
    }

    /// A JSON Lines trace given as `--format azure` asks whether the format is right.
    #[test]
    fn a_json_lines_file_is_told_to_check_the_format() {
        let e = load(
            "{\"arrival_s\": 0, \"prompt_len\": 4, \"output_len\": 1}\n",
            &LoadOptions::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("azure.csv:1: field `TIMESTAMP`: header lacks column `TIMESTAMP` (the line is a JSON object")
                && e.contains("is --format right for this file?"),
            "{e}"
        );
    }

    #[test]
    fn parses_rows_relative_to_first() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 23:59:59.5000000,100,10\r\n\
                    2023-11-17 00:00:01.2500000,2,1\n";
        let rs = load(text, &LoadOptions::default()).unwrap();
        assert_eq!(rs.len(), 2);
        assert_eq!(rs[0].arrival_s, 0.0);
        assert!((rs[1].arrival_s - 1.75).abs() < 1e-6, "{}", rs[1].arrival_s);
        assert_eq!(rs[0].prompt.len(), 100);
        assert_eq!(rs[1].output_len, 1);
        assert_ne!(rs[0].prompt[..2], rs[1].prompt[..2]);
    }

    #[test]
    fn options_limit_and_window() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 00:00:00,1,1\n2023-11-16 00:00:01,1,1\n\
                    2023-11-16 00:00:02,1,1\n2023-11-16 00:00:03,1,1\n";
        let limited = load(
            text,
            &LoadOptions {
                limit: Some(3),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(limited.len(), 3);
        let none = load(
            text,
            &LoadOptions {
                limit: Some(0),
                ..Default::default()
            },
        )
        .unwrap();
        assert!(none.is_empty(), "a limit of 0 keeps no request");
        let window = LoadOptions {
            start_s: Some(1.0),
            end_s: Some(3.0),
            ..Default::default()
        };
        let rs = load(text, &window).unwrap();
        let times: Vec<f64> = rs.iter().map(|r| r.arrival_s).collect();
        assert_eq!(times, vec![1.0, 2.0]);
    }

    #[test]
    fn malformed_rows_name_line_and_field() {
        let cases = [
            ("TIMESTAMP,ContextTokens\n", "azure.csv:1: field `GeneratedTokens`"),
            ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00,x,1\n", "azure.csv:2: field `ContextTokens`"),
            ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 00:00:00,1,1\n", "azure.csv:2: field `TIMESTAMP`"),
            ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00,1\n", "azure.csv:2: field `GeneratedTokens`"),
            ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00,0,1\n", "azure.csv:2: field `ContextTokens`"),
            ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00,99999999999,1\n", "azure.csv:2: field `ContextTokens`"),
            ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:05,1,1\n\n2023-11-16 00:00:01,1,1\n", "azure.csv:4: field `TIMESTAMP`"),
            ("", "azure.csv:1: field `<header>`"),
        ];
        for (text, want) in cases {
            let err = load(text, &LoadOptions::default()).unwrap_err().to_string();
            assert!(err.starts_with(want), "{text:?}: got {err}");
        }
    }
}
